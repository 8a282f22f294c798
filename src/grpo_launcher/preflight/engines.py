"""What the rollout engines run: switches only vLLM has, what vLLM itself would refuse at start-up (its length
and KV cache), and sampling that keeps the logprobs exact."""

from __future__ import annotations

import json
from typing import Iterator

from ..logit_heads import read_text_config
from ..plan import engine_max_model_len
from ..spec.errors import Violation
from ..spec.model_dir import model_facts
from ..spec.schema import RolloutBackend, RunSpec
from .memory_estimate import CPU_KV_CACHE_MB
from .registry import V, rule


@rule("pure")
def vllm_only_switches(s: RunSpec) -> Iterator[Violation]:
    r = s.rollout
    if r.backend == RolloutBackend.vllm:
        if r.pipeline_parallel_size > 1 and not r.async_engine:
            yield V("vllm_only_switches", ("rollout.async_engine", "rollout.pipeline_parallel_size"),
                    "vLLM pipeline parallelism needs the async engine", "set rollout.async_engine=true")
        if r.expose_http_server and not r.async_engine:
            yield V("vllm_only_switches", ("rollout.expose_http_server", "rollout.async_engine"),
                    "the OpenAI-compatible server serves the async engine (AsyncLLM); the offline vllm.LLM "
                    "cannot be served", "set rollout.async_engine=true")
        if r.sleep_mode and (s.cluster.gpus_per_node == 0 or s.cluster.rollout_devices):
            yield V("vllm_only_switches", ("rollout.sleep_mode", "cluster.gpus_per_node", "cluster.rollout_devices"),
                    "vLLM's sleep mode frees GPU memory for a policy on the same GPUs: "
                    + ("CPU engines have none" if s.cluster.gpus_per_node == 0 else
                       "these engines have devices of their own (cluster.rollout_devices)"),
                    "set rollout.sleep_mode=false")
        if r.hf_compile:
            yield V("vllm_only_switches", ("rollout.hf_compile", "rollout.backend"),
                    "rollout.hf_compile compiles the hf engine's decode; vLLM has its own (CUDA graphs)",
                    "set rollout.hf_compile=false (rollout.enforce_eager=false gives vLLM's CUDA graphs)")
        return
    for key in ("async_engine", "expose_http_server", "sleep_mode"):
        if getattr(r, key):
            yield V("vllm_only_switches", (f"rollout.{key}", "rollout.backend"),
                    f"rollout.{key} is a vLLM engine feature, but rollout.backend={r.backend.value}",
                    f"set rollout=vllm, or rollout.{key}=false")
    if r.tensor_parallel_size * r.pipeline_parallel_size != 1:
        yield V("vllm_only_switches", ("rollout.tensor_parallel_size", "rollout.backend"),
                "the hf rollout backend runs one model copy per worker (no engine parallelism)",
                "set rollout=vllm, or the rollout parallel sizes to 1")


@rule("pure")
def vllm_engine_memory_and_length(s: RunSpec) -> Iterator[Violation]:
    """What vLLM itself would refuse at start-up (minutes into a job): the engine length and a bounded KV cache."""
    r, m = s.rollout, s.model
    if r.backend != RolloutBackend.vllm:
        return
    mml = engine_max_model_len(s)
    if mml > m.max_position_embeddings:
        yield V("vllm_engine_memory_and_length", ("rollout.max_model_len", "model.max_position_embeddings"),
                f"the engine's max_model_len {mml} exceeds the model's {m.max_position_embeddings} positions",
                f"lower rollout.max_model_len (or the prompt/generation budget) to ≤ {m.max_position_embeddings}")
    if r.kv_cache_memory_mb is not None and r.kv_cache_memory_mb < 1:
        yield V("vllm_engine_memory_and_length", "rollout.kv_cache_memory_mb",
                f"must be ≥ 1 MiB or null, got {r.kv_cache_memory_mb}",
                "set rollout.kv_cache_memory_mb=null (derived: the GPU budget's rest, 64 MiB on CPU) or a size")
    elif s.cluster.gpus_per_node == 0:  # CPU engines: the KV cache is sized in MiB, never from free RAM (a GPU's
        # KV size against its budget: gpu_memory_fits). K and V of every layer: num_key_value_heads × head_dim
        # (config.json's head_dim when set), as preflight/memory_shapes.py
        per_token = 2 * m.num_layers * model_facts(m).kv_dim * (4 if m.dtype.value == "float32" else 2)
        tokens = -(-mml // 128) * 128  # vLLM's CPU KV blocks hold 128 tokens
        need_mb = per_token * tokens / 2**20
        mb = CPU_KV_CACHE_MB if r.kv_cache_memory_mb is None else r.kv_cache_memory_mb
        given = f"rollout.kv_cache_memory_mb={mb}" + (" (null: the CPU default)" if r.kv_cache_memory_mb is None else "")
        if need_mb > mb:
            yield V("vllm_engine_memory_and_length", ("rollout.kv_cache_memory_mb", "rollout.max_model_len"),
                    f"one {mml}-token sequence needs {per_token} B/token × {tokens} (128-token blocks) = "
                    f"{need_mb:.0f} MiB of KV cache, more than {given}",
                    f"set rollout.kv_cache_memory_mb ≥ {int(need_mb) + 1}")


# vLLM samples greedily below this temperature (vllm/sampling_params.py _SAMPLING_EPS) and its processed logprobs
# are then log softmax(logits) at temperature 1, while the policy's are log softmax(logits / T)
MIN_TEMPERATURE = 1e-5


@rule("pure")
def sampling_keeps_logprobs_exact(s: RunSpec) -> Iterator[Violation]:
    r = s.rollout
    if not r.temperature >= MIN_TEMPERATURE:
        yield V("sampling_keeps_logprobs_exact", "rollout.temperature",
                f"RL sampling needs temperature ≥ {MIN_TEMPERATURE:g}, got {r.temperature} (below it vLLM samples "
                "greedily and returns logprobs at temperature 1, the policy's are at the temperature)",
                "set rollout.temperature=1.0")


# model_type -> config.json switches vLLM 0.32's model class does not read: set true, the engine would be another
# model than the policy's. stablelm.py has no q/k LayerNorm (the tiny stablelm_v's first refit stopped at "There is
# no module or parameter named 'model.layers.0.self_attn.k_layernorm'", rc 1 after start-up) and always sums the
# residual after attention (use_parallel_residual is not read). benchmarks/results/families.md. olmo.py / olmoe.py do
# not clamp Q/K/V to clip_qkv (transformers does): the tiny olmoe with clip_qkv=0.5 ran rc 0, rollouts 1.24 nats off.
VLLM_UNREAD_SWITCHES = {"stablelm": ("qk_layernorm", "use_parallel_residual"), "olmo": ("clip_qkv",),
                        "olmoe": ("clip_qkv",)}


@rule("pure")
def vllm_model_reads_the_checkpoint(s: RunSpec) -> Iterator[Violation]:
    """rollout=vllm with a checkpoint whose config.json turns on what vLLM's model class ignores."""
    if s.rollout.backend != RolloutBackend.vllm:
        return
    cfg = read_text_config(s.model.path) or {}
    family = cfg.get("model_type", "")
    keys = [k for k in VLLM_UNREAD_SWITCHES.get(family, ()) if cfg.get(k)]
    if keys:
        yield V("vllm_model_reads_the_checkpoint", ("rollout.backend", "model.path"),
                f"{s.model.path}/config.json sets {', '.join(f'{k}={json.dumps(cfg[k])}' for k in keys)}: vLLM's "
                f"{family} model does not implement it, so its engine would not run the policy's model",
                "use rollout=hf for this checkpoint")
