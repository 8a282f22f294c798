"""benchmarks/workload_shapes.py: the workload matrix's arithmetic (issue 41), against numbers worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("workload_shapes", ROOT / "benchmarks" / "workload_shapes.py")
ws = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("workload_shapes", ws)  # dataclasses look their module up
_spec.loader.exec_module(ws)


def test_parameter_counts():
    # tiny: layer = 2*128*128 + 2*128*64 + 128 + 2*64 + 3*128*256 + 2*128 = 147,968; 2 layers + 2*512*128 + 128
    assert ws.n_params(ws.TINY) == 2 * 147_968 + 131_072 + 128 == 427_136
    assert ws.n_params(ws.QWEN2_1B) == 1_213_376_512  # gpu_step.py's recorded N
    assert ws.n_params(ws.QWEN2_1_5B) == 1_543_714_304  # Qwen2.5-1.5B's published count (tied embeddings)
    untied = dict(ws.QWEN2_1_5B, tie_word_embeddings=False)
    assert ws.n_params(untied) - ws.n_params(ws.QWEN2_1_5B) == 151_936 * 1536


def test_kv_bytes_per_token():
    assert ws.kv_bytes_per_token(ws.QWEN2_1_5B) == 2 * 28 * 2 * 128 * 2 == 28_672  # K and V, bf16
    assert ws.kv_bytes_per_token(ws.QWEN2_1B) == 2 * 24 * 4 * 128 * 2 == 49_152
    assert ws.kv_bytes_per_token(dict(ws.TINY, head_dim=64), dtype_bytes=4) == 2 * 2 * 2 * 64 * 4


def test_decode_floor_by_hand():
    # 4 steps read 3, 4, 5, 6 KV tokens per sequence: 18 x 2 sequences x 10 B = 360 B, weights 4 x 100 B = 400 B
    assert ws.decode_floor_s(100, 10, sequences=2, prompt=3, new=4, bandwidth=10) == pytest.approx(76.0)
    assert ws.decode_floor_s(100, 0, sequences=2, prompt=3, new=1, bandwidth=50) == pytest.approx(2.0)


def test_decode_floor_of_the_decode_heavy_shape():
    w = ws.SHAPES["decode-heavy"]
    assert (w.sequences, w.prompt, w.new) == (256, 256, 1024)
    weights = 1024 * 2 * 1_543_714_304  # 1024 steps x 3,087,428,608 B
    kv_tokens = 256 * (1024 * 256 + 1024 * 1023 // 2)  # 256 x 785,920 = 201,195,520
    assert kv_tokens == 201_195_520
    expected = (weights + kv_tokens * 28_672) / 4.8e12
    assert ws.workload_decode_floor_s(w) == pytest.approx(expected)
    assert expected == pytest.approx(1.8605, abs=1e-4)
    assert ws.workload_decode_floor_s(w, bandwidth=2.4e12) == pytest.approx(2 * expected)  # the argument is used


def test_tokens_mfu_and_tok_s_per_gpu():
    assert ws.step_tokens(64, 1536, 502.0) == 64 * 2038 == 130_432
    assert ws.mfu(1_000_000_000, 1000, 2.0, 1e12) == pytest.approx(3.0)  # 6e12 FLOP in 2 s on 1e12 FLOP/s
    assert ws.mfu(1_000_000_000, 1000, 2.0, 1e12, flops_per_token_param=2) == pytest.approx(1.0)
    assert ws.tok_s_per_gpu(1000, 2.0, 4) == 125.0
    with pytest.raises(ValueError):
        ws.tok_s_per_gpu(1000, 2.0, 0)


def test_the_shapes_meet_the_issue():
    assert {"prompt-heavy", "decode-heavy", "long-context"} <= set(ws.SHAPES)
    heavy, long = ws.SHAPES["decode-heavy"], ws.SHAPES["long-context"]
    assert heavy.sequences >= 256 and heavy.new >= 1024 and heavy.vllm_memory == 0.3  # TRL's default share
    assert 1.4e9 < ws.n_params(heavy.model) < 1.6e9 and heavy.model["num_kv_heads"] == 2
    assert long.prompt + long.new >= 8192 and long.model["max_position_embeddings"] >= long.prompt + long.new
    for w in ws.SHAPES.values():
        assert w.sequences % w.micro == 0 and w.gpus == 1


def test_row_figures_of_ours_and_of_trl():
    w = ws.Workload("t", ws.TINY, prompt=6, new=4, prompts=2, gens=2, micro=2)  # 4 sequences
    floor = ws.workload_decode_floor_s(w, 1e9)
    ours = {"phases": {"step": 2.0, "rollout": 1.0, "logprobs": 0.25, "update": 0.25, "refit": 0.1},
            "gen_len": 4.0, "startup_s": 20.0}
    f = ws.row_figures(ours, w, peak_tflops=1.0, bandwidth=1e9)
    assert f["tokens"] == 4 * (6 + 4) == 40
    assert f["update"] == 0.5 and f["startup"] == 20.0
    assert f["tok_s_per_gpu"] == 20.0 and f["gen_tok_s_per_gpu"] == 8.0  # 40 and 16 tokens in a 2 s step, 1 GPU
    assert f["rollout_over_floor"] == pytest.approx(1.0 / floor)
    assert f["update_mfu"] == pytest.approx(6 * 427_136 * 40 / 0.5 / 1e12)
    trl = {"summary": {"median_step_s": 4.0, "median_rollout_s": 2.0, "median_update_s": 1.5,
                       "median_refit_s": 0.05, "process_start_to_step1_s": 30.0}}
    t = ws.row_figures(trl, ws.Workload("t", ws.TINY, 6, 4, 2, 2, 2, gpus=2), peak_tflops=1.0, bandwidth=1e9)
    assert (t["gen_len"], t["tokens"], t["startup"]) == (4.0, 40, 30.0)
    assert t["tok_s_per_gpu"] == 40 / 4.0 / 2  # every GPU counts


def test_varied_reward_makes_every_group_vary():
    draws = [ws.varied_reward("p", "same completion") for _ in range(8)]
    assert len(set(draws)) == 8 and all(0.0 <= d < 1.0 for d in draws)


def test_the_start_up_is_read_from_the_launchers_own_line():
    from grpo_launcher.train.startup import StartupClock

    clock = StartupClock(t0=100.0)
    clock.last = 127.25  # as if step 1 ended 27.25 s after the process started
    line = clock.report()
    assert ws.startup_seconds(f"noise\n{line}\nmore") == pytest.approx(27.2, abs=0.051)  # printed to 0.1 s
    assert ws.startup_seconds("no such line") is None
