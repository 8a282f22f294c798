"""The workload matrix's shapes (issue 41) and the pure arithmetic its table is made of: parameters, tokens, the
decode floor, MFU, tok/s per GPU. No torch, no launcher imports: tests/unit/test_workload_shapes.py reaches it.

Decode floor: a decode step reads every weight once and, for each live sequence, the K and V of every token
before it; at HBM bandwidth B that step takes at least (weight bytes + KV bytes) / B. Summed over the `new`
decode steps of a batch of `sequences` sequences whose prompt is `prompt` tokens (step t reads prompt + t tokens
of KV per sequence, t = 0 .. new - 1; every sequence stays live to the end):

    floor = new * W / B + sequences * kv_per_token * (new * prompt + new * (new - 1) / 2) / B

Prefill (compute-bound) is not in it, nor sharing a prompt's KV between a group's G sequences (each sequence's
attention reads its own copy of the prompt's KV), nor waves when the batch does not fit the KV cache at once.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

H200_HBM_BYTES_S = 4.8e12  # H200 HBM3e, B/s (NVIDIA's figure)

# the 1.21B Qwen2 shape of benchmarks/gpu_step.py (untied)
QWEN2_1B = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_kv_heads=4, ffn_hidden_size=5632,
                vocab_size=32000, max_position_embeddings=4096)
# Qwen2.5-1.5B's shape (conf/model/qwen2_5_1_5b.yaml), random weights, tied embeddings: 1,543,714,304 parameters
QWEN2_1_5B = dict(num_layers=28, hidden_size=1536, num_attention_heads=12, num_kv_heads=2, ffn_hidden_size=8960,
                  vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
# conf/model/tiny.yaml's shape: the CPU smoke run
TINY = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=256,
            vocab_size=512, max_position_embeddings=1024)


@dataclass(frozen=True)
class Workload:
    """One GRPO step's work: `prompts` x `gens` sequences of `prompt` tokens + `new` generated ones."""

    name: str
    model: dict = field(hash=False)  # model.* keys (launch.py overrides; trl_vllm.py builds the same config)
    prompt: int
    new: int
    prompts: int
    gens: int
    micro: int  # train.micro_batch_size (TRL: per_device_train_batch_size)
    vllm_memory: float | None = None  # ours: rollout.gpu_memory_utilization (None: the launcher's default, 0.5)
    gpus: int = 1  # cluster.gpus_per_node (0: the CPU smoke run)

    @property
    def sequences(self) -> int:
        return self.prompts * self.gens


SHAPES = {w.name: w for w in (
    # today's benchmark (gpu_step.py): prompt-heavy, ours at the launcher's vLLM share, TRL at its 0.3
    Workload("prompt-heavy", QWEN2_1B, prompt=1536, new=512, prompts=8, gens=8, micro=4),
    # issue 41's decode-heavy work: ~1.5B Qwen2, 256 completions of 1024 new tokens, vLLM at TRL's default share
    Workload("decode-heavy", QWEN2_1_5B, prompt=256, new=1024, prompts=32, gens=8, micro=4, vllm_memory=0.3),
    # 8,192 tokens per sequence
    Workload("long-context", QWEN2_1_5B, prompt=7168, new=1024, prompts=4, gens=8, micro=1, vllm_memory=0.3),
)}
CPU_SMOKE = Workload("cpu-smoke", TINY, prompt=64, new=16, prompts=4, gens=4, micro=4, gpus=0)


def head_dim(m: dict) -> int:
    return m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]


def n_params(m: dict) -> int:
    """Qwen2 shape: embeddings (+ the output layer unless tied) + layers (q/k/v/o with q/k/v biases, SwiGLU, two
    norms) + the final norm."""
    h, q, kv = m["hidden_size"], head_dim(m) * m["num_attention_heads"], head_dim(m) * m["num_kv_heads"]
    layer = 2 * h * q + 2 * h * kv + q + 2 * kv + 3 * h * m["ffn_hidden_size"] + 2 * h
    embeddings = (1 if m.get("tie_word_embeddings") else 2) * m["vocab_size"] * h
    return embeddings + m["num_layers"] * layer + h


def kv_bytes_per_token(m: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    return 2 * m["num_layers"] * m["num_kv_heads"] * head_dim(m) * dtype_bytes


def decode_floor_s(weight_bytes: float, kv_per_token: float, sequences: int, prompt: int, new: int,
                   bandwidth: float = H200_HBM_BYTES_S) -> float:
    """The module docstring's floor: `new` decode steps, each reading the weights and the live KV once."""
    kv_tokens = sequences * (new * prompt + new * (new - 1) / 2)  # sum over steps of the KV tokens read
    return (new * weight_bytes + kv_per_token * kv_tokens) / bandwidth


def workload_decode_floor_s(w: Workload, bandwidth: float = H200_HBM_BYTES_S, dtype_bytes: int = 2) -> float:
    """The floor of a workload's rollout: bf16 weights and KV (vLLM's dtype for these runs)."""
    return decode_floor_s(dtype_bytes * n_params(w.model), kv_bytes_per_token(w.model, dtype_bytes), w.sequences,
                          w.prompt, w.new, bandwidth)


def step_tokens(sequences: int, prompt: int, gen_len: float) -> float:
    """Tokens the update trains on: every sequence's prompt and its generated tokens (gen_len: the mean)."""
    return sequences * (prompt + gen_len)


def mfu(n: int, tokens: float, seconds: float, peak_flops: float, flops_per_token_param: int = 6) -> float:
    """Model FLOPs utilisation, a fraction: flops_per_token_param * N * tokens / s over the peak (FLOP/s); 6 for a
    forward + backward, 2 for a forward alone."""
    return flops_per_token_param * n * tokens / seconds / peak_flops


def tok_s_per_gpu(tokens: float, seconds: float, gpus: int) -> float:
    """Throughput counting every GPU the run holds (engines and trainers alike); gpus >= 1."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    return tokens / seconds / gpus


def row_figures(r: dict, w: Workload, peak_tflops: float, bandwidth: float = H200_HBM_BYTES_S) -> dict:
    """A benchmark row's times and what follows from them. Ours (gpu_step.run_ours: "phases", medians of
    metrics.jsonl; update = its logprob + update phases) or TRL's (trl_vllm.py's summary.json under "summary": the
    step less its generate and weight push is its update; exactly w.new tokens generated)."""
    if "phases" in r:
        ph = r["phases"]
        t = dict(step=ph["step"], rollout=ph["rollout"], update=ph["logprobs"] + ph["update"], refit=ph["refit"],
                 startup=r.get("startup_s"), gen_len=r["gen_len"], refit_parts=r.get("refit_parts", {}))
    else:
        s = r["summary"]
        t = dict(step=s["median_step_s"], rollout=s["median_rollout_s"], update=s["median_update_s"],
                 refit=s["median_refit_s"], startup=s.get("process_start_to_step1_s"), gen_len=float(w.new))
    tokens = step_tokens(w.sequences, w.prompt, t["gen_len"])
    devices = max(w.gpus, 1)  # the CPU smoke run: one CPU process stands for a GPU
    floor = workload_decode_floor_s(w, bandwidth)
    return {**t, "tokens": tokens, "tok_s_per_gpu": tok_s_per_gpu(tokens, t["step"], devices),
            "gen_tok_s_per_gpu": tok_s_per_gpu(w.sequences * t["gen_len"], t["step"], devices),
            "decode_floor_s": floor, "rollout_over_floor": t["rollout"] / floor,
            "update_mfu": mfu(n_params(w.model), tokens, t["update"], peak_tflops * 1e12)}


STARTUP = re.compile(r"grpo-launcher: start-up ([0-9.]+) s to the end of step 1")


def startup_seconds(log: str) -> float | None:
    """Process start -> end of step 1, from launch.py's own start-up line (train/startup.py); None without one."""
    m = STARTUP.search(log)
    return float(m[1]) if m else None


_REWARDS = random.Random(0)


def varied_reward(prompt, completion, **_) -> float:
    """env.reward_fn of our benchmark rows: a seeded uniform draw per completion, so that every group's rewards vary
    and the update runs in full (a step whose groups all have equal rewards takes no optimizer step: with env=math's
    grader a random model scores 0 everywhere and the update would be its forward alone). TRL's rows take their
    optimizer step whatever the rewards."""
    return _REWARDS.random()
