"""The memory pre-flight's words: the dry run's table (`report`), its one-line budget, and the violations of the
rule `gpu_memory_fits` (preflight/budgets.py) with the cheapest changes that make the plan fit. The figures are
preflight/memory_estimate.py's."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from ..plan import rollout_devices, rollout_model_parallel, train_model_parallel, world_size
from ..spec.errors import Violation
from ..spec.schema import RolloutBackend, RunSpec, TrainBackend
from .memory_estimate import (ALLOCATOR_SLACK, PHASE_PARTS, Estimate, engine_gib, estimate, mamba_path_of,
                              phase_reserved)
from .memory_shapes import gib, layout_of


def summary_line(est: Estimate) -> str:
    if not est.use_gpus:
        kv = est.rollout.get("KV cache")
        return "memory per GPU: CPU run (no GPU budget)" + (f"; vLLM KV cache {kv.bytes / 2**20:.0f} MiB per engine "
                                                             f"({kv.how.split(';')[0]})" if kv else "")
    asleep = "" if est.asleep_gib is None else f" ({est.asleep_gib:.1f} asleep through logprobs + update)"
    head = (f"memory per GPU: policy {est.policy_reserved_gib:.1f} GiB, rollout {est.rollout_gib:.1f} GiB{asleep}, "
            f"peak {est.peak_gib:.1f} GiB")
    if est.device_gib is None:
        return head + f" in the {est.peak_phase} phase (cluster.gpu_memory_gib unknown: check skipped)"
    return head + f" of {est.device_gib:g} GiB ({100 * est.peak_gib / est.device_gib:.0f} %) in the {est.peak_phase} phase"


def _kv_source(spec: RunSpec) -> str:
    mb = spec.rollout.kv_cache_memory_mb
    return "derived: the engine budget's rest" if mb is None else f"rollout.kv_cache_memory_mb={mb}"


def report(spec: RunSpec, est: Optional[Estimate] = None) -> str:
    """The dry run's memory section: the one-line budget, the table, host RAM, notes."""
    est = est or estimate(spec)
    lines = [summary_line(est)]
    if not est.use_gpus:
        return lines[0]
    lines.append(f"  {'per GPU':<30}{'GiB':>8}  how")
    for it in est.policy.values():
        lines.append(f"  {'policy ' + it.name:<30}{it.gib:>8.2f}  {it.how}")
    for it in est.rollout.values():
        lines.append(f"  {'rollout ' + it.name:<30}{it.gib:>8.2f}  {it.how}")
    if est.asleep_gib is not None:
        lines.append(f"  {'rollout asleep':<30}{est.asleep_gib:>8.2f}  vLLM sleep level 2 through logprobs + update: "
                     "weights + KV freed; its CUDA context, NCCL (TP > 1), CUDA graphs stay")
    lines.append(f"  {'CUDA contexts + NCCL':<30}{est.context_gib:>8.2f}  outside torch's counters")
    phases = " | ".join(f"{k} {v:.1f}" for k, v in est.phases.items())
    lines.append(f"  policy phases (allocated GiB): {phases}; peak phase: {est.policy_phase} "
                 f"(reserved ≈ + {ALLOCATOR_SLACK:g} × its transient part)")
    totals = " | ".join(f"{k} {v:.1f}" for k, v in est.totals.items())
    lines.append(f"  per GPU by phase (policy reserved + rollout + contexts, GiB): {totals}")
    if est.kv and est.kv.get("available") is not None and est.device_gib is not None:
        k = est.kv
        fit = k["available"] / k["one_seq"] if k["one_seq"] else 0
        lines.append(f"  KV cache: {gib(k['available']):.1f} GiB = {fit:.0f} sequences of {k['max_model_len']} tokens "
                     f"(the step sends {k['seqs']:.0f} per engine; {_kv_source(spec)})")
    host = ", ".join(f"{i.name} {i.gib:.1f}" for i in est.host.values())
    lines.append(f"host RAM per node: ~{est.host_gib:.0f} GiB at peak ({host} GiB)")
    if est.device_gib is None:
        lines.append("warning: cluster.gpu_memory_gib is null (unknown GPU): the memory check is skipped; "
                     "set it (H100 79.6, H200 140.4) to check the plan")
    lines += [f"note: {n}" for n in dict.fromkeys(est.notes)]
    return "\n".join(lines)


# ----------------------------------------------------------- the violations of gpu_memory_fits (preflight/budgets.py)


def _sane(spec: RunSpec) -> bool:
    """Sizes the estimate can be evaluated on (other rules report the rest)."""
    t = spec.train
    sizes = (t.micro_batch_size, t.logprob_batch_size, t.global_batch_size, t.tensor_parallel_size,
             t.pipeline_parallel_size, t.context_parallel_size, t.expert_parallel_size,
             t.expert_tensor_parallel_size, spec.rollout.tensor_parallel_size, spec.rollout.pipeline_parallel_size,
             spec.cluster.nodes, spec.model.num_attention_heads, spec.model.num_layers)
    if min(sizes) < 1 or spec.model.hidden_size % spec.model.num_attention_heads:
        return False
    world = world_size(spec)
    return world % train_model_parallel(spec) == 0 and world % rollout_model_parallel(spec) == 0


def _with(spec: RunSpec, section: str, **changes) -> RunSpec:
    return replace(spec, **{section: replace(getattr(spec, section), **changes)})


def _fixes(spec: RunSpec, est: Estimate) -> list[str]:
    """Cheapest first: each change that makes the plan fit, with its new peak."""
    t, r, c = spec.train, spec.rollout, spec.cluster
    g = est.device_gib
    out: list[str] = []

    def attempt(label: str, s: RunSpec) -> bool:
        if not _sane(s):
            return False
        e = estimate(s)
        if e.peak_gib <= g:
            out.append(f"{label} → peak {e.peak_gib:.1f} GiB ({100 * e.peak_gib / g:.0f} %)")
            return True
        return False

    if t.backend == TrainBackend.megatron and t.core_attention == "local":  # no [T, T] scores (score_bytes)
        attempt("train.core_attention=sdpa", _with(spec, "train", core_attention="sdpa"))
    if est.policy_phase == "train" and t.micro_batch_size > 1:
        mb = t.micro_batch_size // 2
        while mb >= 1 and not attempt(f"train.micro_batch_size={mb}", _with(spec, "train", micro_batch_size=mb)):
            mb //= 2
    if est.policy_phase == "logprobs" and t.logprob_batch_size > 1:
        lb = t.logprob_batch_size // 2
        while lb >= 1 and not attempt(f"train.logprob_batch_size={lb}",
                                      _with(spec, "train", logprob_batch_size=lb)):
            lb //= 2
    if not t.activation_checkpointing:
        attempt("train.activation_checkpointing=true", _with(spec, "train", activation_checkpointing=True))
    if t.backend == TrainBackend.megatron and not t.distributed_optimizer and layout_of(spec).dp > 1:
        attempt("train.distributed_optimizer=true", _with(spec, "train", distributed_optimizer=True))
    if r.backend == RolloutBackend.vllm and est.asleep_gib is None and not rollout_devices(spec):
        attempt("rollout.sleep_mode=true", _with(spec, "rollout", sleep_mode=True))
    if r.backend == RolloutBackend.vllm and g and r.kv_cache_memory_mb is not None:
        mb = r.kv_cache_memory_mb - math.ceil((est.peak_gib - g) * 1024)
        if mb * 2**20 >= est.kv["one_seq"]:
            attempt(f"rollout.kv_cache_memory_mb={mb}", _with(spec, "rollout", kv_cache_memory_mb=mb))
    elif r.backend == RolloutBackend.vllm and g:
        over = est.peak_gib - g
        u = math.floor((r.gpu_memory_utilization - over / g) * 100) / 100
        if u > 0:
            s = _with(spec, "rollout", gpu_memory_utilization=u)
            e = estimate(s)
            if e.kv.get("available", 0) >= e.kv.get("one_seq", 0) and e.peak_gib <= g:
                out.append(f"rollout.gpu_memory_utilization={u:.2f} → peak {e.peak_gib:.1f} GiB "
                           f"(KV {gib(e.kv['available']):.1f} GiB = "
                           f"{e.kv['available'] / e.kv['one_seq']:.0f} sequences of {e.kv['max_model_len']})")
    if t.backend == TrainBackend.torch and spec.model.family == "nemotron_h" and mamba_path_of(spec)[0] == "torch":
        e = estimate(spec, mamba="kernels")  # the Mamba-2 layers on mamba-ssm's Triton scan (torch conv1d)
        if g and e.peak_gib <= g:
            out.append(f"mamba-ssm where the policy runs (scripts/gpu-kit.sh; its Triton chunk scan instead of "
                       f"transformers' pure-torch Mamba-2) → peak {e.peak_gib:.1f} GiB ({100 * e.peak_gib / g:.0f} %)")
    if t.backend == TrainBackend.megatron:
        tp = t.tensor_parallel_size * 2
        while tp <= max(c.gpus_per_node, 1) and not attempt(f"train.tensor_parallel_size={tp}",
                                                            _with(spec, "train", tensor_parallel_size=tp)):
            tp *= 2
    for k in (2, 4, 8, 16, 32, 64):
        if attempt(f"cluster.nodes={c.nodes * k}", _with(spec, "cluster", nodes=c.nodes * k)):
            break
    return out


def _kv_violations(spec: RunSpec, est: Estimate) -> list[Violation]:
    """The engine's KV cache holds one max_model_len sequence (vLLM refuses to start otherwise): the user's size, or
    the rest of its budget once its weights and activations are in."""
    r, c = spec.rollout, spec.cluster
    if r.backend != RolloutBackend.vllm or not est.kv or est.kv["available"] >= est.kv["one_seq"]:
        return []
    if r.kv_cache_memory_mb is not None:
        return [Violation(
            "gpu_memory_fits", ("rollout.kv_cache_memory_mb", "rollout.max_model_len", "rollout.tensor_parallel_size"),
            f"rollout.kv_cache_memory_mb={r.kv_cache_memory_mb} holds less than one {est.kv['max_model_len']}-token "
            f"sequence ({est.kv['one_seq'] / 2**20:.0f} MiB per engine GPU; vLLM refuses to start)",
            f"set rollout.kv_cache_memory_mb ≥ {math.ceil(est.kv['one_seq'] / 2**20)}, or null (derived: the rest of "
            "the engine's budget)")]
    return [Violation(
        "gpu_memory_fits", ("rollout.gpu_memory_utilization", "rollout.max_model_len", "rollout.tensor_parallel_size"),
        f"the engine's budget {r.gpu_memory_utilization:g} × {c.gpu_memory_gib:g} GiB = "
        f"{r.gpu_memory_utilization * (c.gpu_memory_gib or 0):.1f} GiB − weights "
        f"{est.rollout['engine weights'].gib:.1f} − activations {est.rollout['engine activations'].gib:.1f} leaves "
        f"{gib(est.kv['available']):.1f} GiB of KV cache; one {est.kv['max_model_len']}-token sequence needs "
        f"{gib(est.kv['one_seq']):.2f} GiB (vLLM refuses to start)",
        "raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size, or lower rollout.max_model_len")]


def violations(spec: RunSpec) -> list[Violation]:
    """A config error when the peak per GPU exceeds cluster.gpu_memory_gib (skipped when unknown or CPU), or the
    engine's KV cache holds less than one sequence."""
    c = spec.cluster
    if c.gpus_per_node < 1 or not _sane(spec):
        return []
    if c.gpu_memory_gib is not None and c.gpu_memory_gib <= 0:
        return [Violation("gpu_memory_fits", ("cluster.gpu_memory_gib",), f"must be > 0 or null, got "
                          f"{c.gpu_memory_gib}", "set the GPU's memory in GiB (H100 79.6, H200 140.4) or null")]
    est = estimate(spec)
    out = _kv_violations(spec, est)
    r = spec.rollout
    if c.gpu_memory_gib is None:
        return out
    if est.peak_gib > c.gpu_memory_gib:
        p = est.policy
        parts = ", ".join(f"{k} {p[k].gib:.1f}" for k in PHASE_PARTS[est.peak_phase] if k in p)
        fixes = _fixes(spec, est)
        t = spec.train
        keys: tuple[str, ...] = ("cluster.gpu_memory_gib", "train.micro_batch_size", "train.max_total_sequence_length",
                                 "rollout.gpu_memory_utilization", "train.tensor_parallel_size", "cluster.nodes")
        if not t.activation_checkpointing:
            keys = (*keys, "train.activation_checkpointing")
        if t.backend == TrainBackend.torch:  # data parallel only: no TP to raise
            keys = tuple(k for k in keys if k != "train.tensor_parallel_size")
        if r.backend == RolloutBackend.vllm:
            keys = (*keys, "rollout.sleep_mode")
        if t.backend == TrainBackend.megatron and t.core_attention == "local":
            keys = (*keys, "train.core_attention")
        if r.backend == RolloutBackend.vllm and r.kv_cache_memory_mb is not None:  # the engine's size is the user's
            keys = tuple(k for k in keys if k != "rollout.gpu_memory_utilization") + ("rollout.kv_cache_memory_mb",)
        phase = est.peak_phase
        asleep = " (asleep)" if est.asleep_gib is not None and phase != "generate" else ""
        out.append(Violation(
            "gpu_memory_fits", keys,
            f"peak per GPU {est.peak_gib:.1f} GiB > {c.gpu_memory_gib:g} GiB "
            f"({100 * est.peak_gib / c.gpu_memory_gib:.0f} %) in the {phase} phase: policy "
            f"{phase_reserved(est, phase):.1f} ({parts}; + allocator slack) + rollout "
            f"{engine_gib(est, phase):.1f}{asleep} + CUDA contexts {est.context_gib:.1f}",
            ("cheapest: " + "; or ".join(fixes)) if fixes else
            "no single change found: lower the sequence length or raise several of the keys above"
            + ("; the torch backend has no context parallelism (train.backend=megatron has)"
               if t.backend == TrainBackend.torch else "")))
    return out
