"""What the rollout engines run: switches only vLLM has, what vLLM itself would refuse at start-up (its length
and KV cache), and sampling that keeps the logprobs exact."""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from typing import Iterator

from ..logit_heads import read_text_config
from ..plan import engine_max_model_len
from ..spec.errors import Violation
from ..spec.model_dir import model_facts
from ..spec.schema import ClusterKind, RolloutBackend, RunSpec
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



HOSTNAME_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_syntax_problem(host: str) -> str | None:
    """Why `host` is neither an IP literal (IPv6 without brackets, as rollout/vllm.py binds it) nor a hostname."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if ":" in host or host.startswith("["):
        return "not an IPv6 literal (write it without brackets, e.g. ::1)"
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(HOSTNAME_LABEL.match(label) for label in name.split(".")):
        return "not an IP literal or a hostname (letters, digits, '-' in dot-separated labels of ≤ 63)"
    return None


def bind_problem(host: str) -> str | None:
    """Binding `host` here as rollout/vllm.py does (IPv6 when it has a ':', a free port), then closing: the OS's
    reason when it cannot."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except socket.gaierror as exc:
        return f"cannot be resolved on this machine: [gaierror {exc.errno}] {exc.strerror}"
    except OSError as exc:
        return f"cannot be bound on this machine: [Errno {exc.errno}] {exc.strerror}"
    except (UnicodeError, ValueError) as exc:  # e.g. a label too long for IDNA encoding
        return f"cannot be bound on this machine: {exc}"
    return None


@rule("pure")
def http_host_bindable(s: RunSpec) -> Iterator[Violation]:
    """rollout.http_host, the exposed vLLM HTTP server's bind address (rollout/vllm.py): an empty one would bind
    every interface unasked; cluster=local binds it here, so it must bind now (else OSError after start-up);
    on Slurm (and an existing Ray cluster) the engines' nodes bind it: a valid IP literal or hostname."""
    r = s.rollout
    if not r.expose_http_server:
        return
    host, name = r.http_host, "http_host_bindable"
    fix = "set rollout.http_host=127.0.0.1 (this node only), or an address of the node; 0.0.0.0 (or ::) = all"
    if not host.strip():
        yield V(name, "rollout.http_host", f"an empty host ({host!r}) binds every interface, never meant silently",
                "set rollout.http_host=127.0.0.1 (this node only), or rollout.http_host=0.0.0.0 to serve every "
                "interface explicitly")
        return
    here = s.cluster.kind == ClusterKind.local and not s.cluster.ray_address
    problem = bind_problem(host) if here else host_syntax_problem(host)
    if problem:
        where = "" if here else f" (cluster.kind={s.cluster.kind.value}: the engines' node binds it)"
        yield V(name, "rollout.http_host", f"rollout.http_host={host!r} {problem}{where}", fix)
        return
    if host in ("0.0.0.0", "::") and r.http_api_key == "":
        from ..envs.preflight import warn  # the pre-flight warnings' one voice (stderr, once per process)

        warn(f"rollout.http_host={host} serves the vLLM HTTP server on every interface with no API key "
             "(rollout.http_api_key=''): anyone who reaches this node can use it; null gives a fresh key per run")

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
