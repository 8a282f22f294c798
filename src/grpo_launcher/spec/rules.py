"""Pre-flight validation: every cross-field rule, each a named check, ALL reported at once.

A rule is a function `spec -> Iterable[Violation]` registered with `@rule(kind)` next to the room it checks: the
cross-room rules here, a room's own in ROOM/rules.py (envs/, gym/, policy/), which validate() imports, so nothing
here imports a room above spec. Each violation names the dotted key(s), shows the arithmetic, and says the fix.
These run before any node, GPU or Ray process is asked for. A rule's kind:
  pure   the spec and what it names (data, reward code, model config): every validation runs it, a dry run too;
  probe  what only a real launch from here needs (this machine's GPUs and paths, a reachable cluster, this build's
         backends, the run dir's checkpoints): a dry run skips it, so a plan for another cluster or build renders.
Sources: NeMo-RL's 35 late-firing rules and its gap table, verl's batch rules, and the seed recipe's two review bugs.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from ..plan import (
    devices_per_node,
    dp_size,
    engine_devices,
    engine_max_model_len,
    parse_duration,
    rollout_devices,
    rollout_model_parallel,
    rollouts_per_step,
    train_devices,
    train_model_parallel,
    world_size,
)
from .errors import Violation
from .model_dir import model_facts
from .versions import untested
from .schema import (
    Aggregation,
    ClusterKind,
    EnvName,
    ISTruncation,
    RatioLevel,
    Resume,
    RolloutBackend,
    RunSpec,
)

Kind = Literal["pure", "probe"]
Check = Callable[[RunSpec], Iterable[Violation]]


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str  # what its violations are named
    kind: Kind
    check: Check


RULES: dict[str, Rule] = {}  # by check function; a rule checked in two kinds or rooms has a check for each

# Metrics the trainer logs that checkpoint.metric may rank by, each with its direction (True = higher is better).
METRIC_HIGHER_IS_BETTER = {
    "val/reward_mean": True,
    "val/accuracy": True,
    "train/reward_mean": True,
    "train/accuracy": True,
    "train/loss": False,
}
KNOWN_METRICS = tuple(METRIC_HIGHER_IS_BETTER)
RAY_MIN_OBJECT_STORE_MB = 75  # Ray refuses an object store below 75 MiB (ray._private.ray_constants)
SAFE_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:+=@%/-]+")
SAFE_NAME = re.compile(r"[A-Za-z0-9_.+=,@-]+")
MAX_NAME = 200  # a directory name (255 bytes) with room for the sweep suffixes
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHECKPOINT_MARGIN_S = 300  # time a checkpoint write may take before Slurm's --time ends the job


def rule(kind: Kind, name: str | None = None) -> Callable[[Check], Check]:
    """Register a check as rule `name` (default: the function's name)."""
    def register(fn: Check) -> Check:
        if fn.__name__ in RULES:
            raise ValueError(f"two checks named {fn.__name__}")
        RULES[fn.__name__] = Rule(name or fn.__name__, kind, fn)
        return fn
    return register


def V(name: str, keys: str | tuple[str, ...], message: str, fix: str) -> Violation:  # noqa: N802
    return Violation(name, (keys,) if isinstance(keys, str) else keys, message, fix)


@cache
def _import_rooms() -> None:
    """Each room's checks register themselves when its ROOM/rules.py is imported: import every one there is."""
    package = __name__.rsplit(".", 2)[0]
    for path in sorted(Path(__file__).resolve().parents[1].glob("*/rules.py")):
        if path.parent.name != "spec":
            importlib.import_module(f"{package}.{path.parent.name}.rules")


def registered() -> dict[str, Rule]:
    """Every check: spec's own and every room's."""
    _import_rooms()
    return RULES


def rule_names() -> set[str]:
    return {r.name for r in registered().values()}


def validate(spec: RunSpec) -> list[Violation]:
    """Run every rule (a dry run skips the probes); a rule that itself crashes is reported as a violation."""
    out: list[Violation] = []
    crashed: list[Violation] = []
    for r in registered().values():
        if r.kind == "probe" and spec.dry_run:
            continue
        try:
            out.extend(r.check(spec))
        except Exception as exc:  # values so wrong that the rule's arithmetic fails: the other rules name them
            crashed.append(V(r.name, "<spec>", f"could not evaluate ({type(exc).__name__}: {exc})",
                             "fix the values named by the other problems"))
    return out or crashed  # a crash is shown only when no rule named the key behind it


def build_gap(keys: tuple[str, ...], what: str, fix: str) -> Violation:
    """A violation of build_implements_run: a part of the spec this build cannot run (a probe in every room)."""
    return V("build_implements_run", keys, what, f"{fix}; dry_run=true still shows the plan")


# ---------------------------------------------------------------- sizes ----------------------


@rule("pure")
def positive_sizes(s: RunSpec) -> Iterator[Violation]:
    sizes = {
        "grpo.num_prompts_per_step": s.grpo.num_prompts_per_step,
        "grpo.max_steps": s.grpo.max_steps,
        "grpo.val_batch_size": s.grpo.val_batch_size,
        "train.global_batch_size": s.train.global_batch_size,
        "train.micro_batch_size": s.train.micro_batch_size,
        "train.logprob_batch_size": s.train.logprob_batch_size,
        "train.tensor_parallel_size": s.train.tensor_parallel_size,
        "train.pipeline_parallel_size": s.train.pipeline_parallel_size,
        "train.context_parallel_size": s.train.context_parallel_size,
        "train.expert_parallel_size": s.train.expert_parallel_size,
        "train.expert_tensor_parallel_size": s.train.expert_tensor_parallel_size,
        "rollout.tensor_parallel_size": s.rollout.tensor_parallel_size,
        "rollout.pipeline_parallel_size": s.rollout.pipeline_parallel_size,
        "rollout.max_new_tokens": s.rollout.max_new_tokens,
        "cluster.nodes": s.cluster.nodes,
        "checkpoint.save_period": s.checkpoint.save_period,
        "checkpoint.keep_top_k": s.checkpoint.keep_top_k,
        "logging.train_data_log_every": s.logging.train_data_log_every,
    }
    for key, value in sizes.items():
        if value < 1:
            yield V("positive_sizes", key, f"must be ≥ 1, got {value}", f"set {key} to a positive integer"
                    + (" (to score a checkpoint without training: python launch.py eval RUN_DIR|MODEL_DIR)"
                       if key == "grpo.max_steps" else ""))
    if s.cluster.gpus_per_node < 0:
        yield V("positive_sizes", "cluster.gpus_per_node", "must be ≥ 0", "0 for CPU, else GPUs per node")
    if s.train.logprob_chunk_tokens < 0:
        yield V("positive_sizes", "train.logprob_chunk_tokens", f"must be ≥ 0, got {s.train.logprob_chunk_tokens}",
                "set a chunk of tokens (e.g. 4096), or 0 for whole logits")
    if s.cluster.gpus_per_node == 0 and s.cluster.cpu_workers_per_node < 1:
        yield V("positive_sizes", "cluster.cpu_workers_per_node", "a CPU run needs ≥ 1 worker slot per node",
                "set cluster.cpu_workers_per_node=1")
    if s.cluster.cpus_per_worker < 0 or (s.cluster.cpus_per_worker == 0 and s.cluster.kind != ClusterKind.local):
        yield V("positive_sizes", "cluster.cpus_per_worker", f"must be > 0 (0, the machine's cores shared out, "
                f"is for cluster=local only), got {s.cluster.cpus_per_worker}", "set cluster.cpus_per_worker=1")
    if s.grpo.val_period < 0:
        yield V("positive_sizes", "grpo.val_period", "must be ≥ 0 (0 = no periodic validation)",
                "set grpo.val_period=0 or a positive step count")
    if not 0 <= s.logging.profile_step <= s.grpo.max_steps:
        yield V("positive_sizes", "logging.profile_step", f"must be 0 (off) or a step ≤ grpo.max_steps "
                f"({s.grpo.max_steps}), got {s.logging.profile_step}", "set logging.profile_step=0 or e.g. 2")


@rule("pure")
def value_ranges(s: RunSpec) -> Iterator[Violation]:
    """Scalars that have a range of their own and no other rule: each refused here, before anything starts."""
    m, e, c, d = s.model, s.env, s.cluster, s.deadlines
    checks = [  # key, value, ok, what it must be
        *((f"model.{k}", getattr(m, k), getattr(m, k) >= 1, "≥ 1") for k in
          ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "max_position_embeddings")),
        ("model.warm_start_steps", m.warm_start_steps, m.warm_start_steps >= 0, "≥ 0 (0 = random weights)"),
        ("env.max_prompt_tokens", e.max_prompt_tokens, e.max_prompt_tokens >= 0, "≥ 0 (0 = counted from the files)"),
        ("env.num_val_prompts", e.num_val_prompts, e.num_val_prompts >= 0, "≥ 0"),
        ("rollout.gpu_memory_utilization", s.rollout.gpu_memory_utilization,
         0 < s.rollout.gpu_memory_utilization <= 1, "in (0, 1]"),
        ("rollout.kv_cache_memory_mb", s.rollout.kv_cache_memory_mb, s.rollout.kv_cache_memory_mb >= 0, "≥ 0"),
        ("cluster.signal_before_s", c.signal_before_s, c.signal_before_s >= 0, "≥ 0 (0 = no save signal)"),
        ("cluster.ray_join_timeout_s", c.ray_join_timeout_s, c.ray_join_timeout_s >= 1, "≥ 1"),
        ("deadlines.factor", d.factor, d.factor > 0, "> 0"),
        ("deadlines.floor_s", d.floor_s, d.floor_s >= 0, "≥ 0"),
        ("deadlines.first_s", d.first_s, d.first_s > 0, "> 0"),
        ("deadlines.window", d.window, d.window >= 1, "≥ 1"),
        ("deadlines.stop_grace_s", d.stop_grace_s, d.stop_grace_s >= 0, "≥ 0"),
    ]
    for key, value, ok, what in checks:
        if not ok:
            yield V("value_ranges", key, f"must be {what}, got {value}", f"set {key} {what.split(' (')[0]}")
    validates = s.grpo.val_period > 0 or s.grpo.val_at_start or s.grpo.val_at_end
    if validates and e.name == "toy" and e.num_val_prompts == 0:  # the env that draws its held-out set
        yield V("value_ranges", ("env.num_val_prompts", "grpo.val_period", "grpo.val_at_end"),
                "validation runs on a held-out set of 0 prompts", "set env.num_val_prompts ≥ 1, or "
                "grpo.val_period=0 grpo.val_at_start=false grpo.val_at_end=false (no validation)")


@rule("pure")
def group_size_at_least_two(s: RunSpec) -> Iterator[Violation]:
    g = s.grpo.num_generations_per_prompt
    if g < 2:
        yield V("group_size_at_least_two", "grpo.num_generations_per_prompt",
                f"GRPO needs ≥ 2 samples per prompt for a group baseline, got {g}",
                "set grpo.num_generations_per_prompt ≥ 2 (4-16 is usual)")


@rule("pure")
def train_parallel_divides_world(s: RunSpec) -> Iterator[Violation]:
    world, mp = train_devices(s), train_model_parallel(s)  # = world_size unless cluster.rollout_devices
    if mp > 0 and world % mp:
        t = s.train
        yield V("train_parallel_divides_world",
                ("train.tensor_parallel_size", "train.pipeline_parallel_size", "train.context_parallel_size",
                 "cluster.nodes", "cluster.gpus_per_node"),
                f"TP·PP·CP = {t.tensor_parallel_size}·{t.pipeline_parallel_size}·{t.context_parallel_size} = {mp} "
                f"does not divide the world size {s.cluster.nodes}·{devices_per_node(s)} = {world}",
                f"pick parallel sizes whose product divides {world}, or change the node count")


@rule("pure")
def rollout_parallel_divides_world(s: RunSpec) -> Iterator[Violation]:
    world, mp = engine_devices(s), rollout_model_parallel(s)  # the engines' own devices when separate
    if mp > 0 and world % mp:
        yield V("rollout_parallel_divides_world",
                ("rollout.tensor_parallel_size", "rollout.pipeline_parallel_size", "cluster.gpus_per_node"),
                f"engine TP·PP = {mp} does not divide the {world} devices: "
                f"{world} / {mp} = {world / mp:.2f} engines",
                f"use a rollout.tensor_parallel_size that divides {world}")


@rule("pure")
def rollout_tp_within_node(s: RunSpec) -> Iterator[Violation]:
    per_node, tp = devices_per_node(s), s.rollout.tensor_parallel_size
    if s.rollout.backend == RolloutBackend.vllm and tp > per_node:
        yield V("rollout_tp_within_node", ("rollout.tensor_parallel_size", "cluster.gpus_per_node"),
                f"an engine's TP group ({tp}) must fit on one node ({per_node} devices)",
                f"set rollout.tensor_parallel_size ≤ {per_node}")


@rule("pure")
def rollout_batch_divisible_by_gbs(s: RunSpec) -> Iterator[Violation]:
    p, g, gbs = s.grpo.num_prompts_per_step, s.grpo.num_generations_per_prompt, s.train.global_batch_size
    rollouts = rollouts_per_step(s)
    if gbs > 0 and rollouts % gbs:
        yield V("rollout_batch_divisible_by_gbs",
                ("train.global_batch_size", "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt"),
                f"rollouts per step {p}·{g} = {rollouts} is not a multiple of train.global_batch_size={gbs} "
                f"({rollouts} % {gbs} = {rollouts % gbs}); NeMo-RL finds this at step 1, after a full generation",
                f"set train.global_batch_size to a divisor of {rollouts}, e.g. {rollouts}")


@rule("pure")
def gbs_divisible_by_dp(s: RunSpec) -> Iterator[Violation]:
    mp, world, gbs = train_model_parallel(s), train_devices(s), s.train.global_batch_size
    if mp <= 0 or world % mp:
        return
    dp = dp_size(s)
    if gbs % dp:
        yield V("gbs_divisible_by_dp", ("train.global_batch_size", "cluster.nodes"),
                f"train.global_batch_size={gbs} is not divisible by DP = {world}/{mp} = {dp}",
                f"use a global batch that is a multiple of {dp}")
    elif not s.train.sequence_packing and s.train.micro_batch_size > 0 and (gbs // dp) % s.train.micro_batch_size:
        yield V("gbs_divisible_by_dp", ("train.micro_batch_size", "train.global_batch_size"),
                f"per-rank batch {gbs}/{dp} = {gbs // dp} is not a multiple of "
                f"train.micro_batch_size={s.train.micro_batch_size}",
                f"pick a micro batch that divides {gbs // dp}, or enable train.sequence_packing")


@rule("pure")
def logprob_batch_divides(s: RunSpec) -> Iterator[Violation]:
    mp, world = train_model_parallel(s), train_devices(s)
    if mp <= 0 or world % mp or s.train.sequence_packing or s.train.logprob_batch_size < 1:
        return
    dp, rollouts = dp_size(s), rollouts_per_step(s)
    if rollouts % dp or (rollouts // dp) % s.train.logprob_batch_size:
        yield V("logprob_batch_divides", ("train.logprob_batch_size", "grpo.num_prompts_per_step"),
                f"rollouts per DP rank {rollouts}/{dp} must be a whole multiple of "
                f"train.logprob_batch_size={s.train.logprob_batch_size}",
                "make the rollouts per step a multiple of DP × logprob_batch_size")


@rule("pure")
def expert_parallelism(s: RunSpec) -> Iterator[Violation]:
    t, m = s.train, s.model
    ep, etp, pp = t.expert_parallel_size, t.expert_tensor_parallel_size, t.pipeline_parallel_size
    if ep * etp == 1:
        return
    if m.num_experts == 0:
        yield V("expert_parallelism", ("train.expert_parallel_size", "model.num_experts"),
                f"expert parallelism {ep}×{etp} on a dense model ({m.name})", "set train.expert_parallel_size=1")
        return
    if m.num_experts % ep:
        yield V("expert_parallelism", ("train.expert_parallel_size", "model.num_experts"),
                f"{m.num_experts} experts cannot be split over EP={ep} ({m.num_experts} % {ep} ≠ 0)",
                f"use an EP that divides {m.num_experts}")
    world = train_devices(s)
    if pp > 0 and (world % pp or (world // pp) % (ep * etp)):
        yield V("expert_parallelism", ("train.expert_parallel_size", "train.expert_tensor_parallel_size"),
                f"(world/PP) = {world}/{pp} must be a multiple of EP·ETP = {ep}·{etp} = {ep * etp}",
                "choose EP·ETP dividing the devices of one pipeline stage")


@rule("pure")
def tp4_logprob_batch_matches_micro_batch(s: RunSpec) -> Iterator[Violation]:
    """NeMo-RL's check 13: with TP ≥ 4, logprobs of the same tokens differ between batch sizes (reduction order),
    so the 'old' logprobs (logprob batch) and the update's (micro batch) disagree on-policy."""
    t = s.train
    if t.tensor_parallel_size >= 4 and t.micro_batch_size != t.logprob_batch_size:
        yield V("tp4_logprob_batch_matches_micro_batch",
                ("train.logprob_batch_size", "train.micro_batch_size", "train.tensor_parallel_size"),
                f"TP={t.tensor_parallel_size} ≥ 4 with train.micro_batch_size={t.micro_batch_size} ≠ "
                f"train.logprob_batch_size={t.logprob_batch_size}: the on-policy ratio is not 1",
                f"set train.logprob_batch_size={t.micro_batch_size}")


# head widths vLLM's CPU attention runs (vLLM 0.32 v1/attention/backends/cpu_attn.py get_supported_head_sizes)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@rule("pure")
def heads_divide(s: RunSpec) -> Iterator[Violation]:
    m = s.model
    if m.head_dim is not None and m.head_dim < 1:
        yield V("heads_divide", ("model.head_dim",), f"must be ≥ 1, got {m.head_dim}",
                "set model.head_dim to the attention head width, or null (hidden_size / num_attention_heads)")
        return
    # an explicit head_dim (config.json's) is the head width itself: hidden_size need not split over the heads
    if m.num_attention_heads < 1 or m.num_kv_heads < 1 or (m.head_dim is None and m.hidden_size % m.num_attention_heads):
        yield V("heads_divide", ("model.hidden_size", "model.num_attention_heads"),
                f"hidden {m.hidden_size} must split evenly over {m.num_attention_heads} heads", "fix the model shape")
        return
    if m.num_attention_heads % m.num_kv_heads:
        yield V("heads_divide", ("model.num_kv_heads",),
                f"{m.num_attention_heads} query heads are not a multiple of {m.num_kv_heads} KV heads", "fix the model shape")
    for section, tp in (("train", s.train.tensor_parallel_size), ("rollout", s.rollout.tensor_parallel_size)):
        if m.num_attention_heads % tp:
            yield V("heads_divide", (f"{section}.tensor_parallel_size", "model.num_attention_heads"),
                    f"{m.num_attention_heads} attention heads cannot be split over TP={tp}",
                    f"use a {section}.tensor_parallel_size dividing {m.num_attention_heads}")
    if s.rollout.backend == RolloutBackend.vllm and s.cluster.gpus_per_node == 0:
        yield from _vllm_cpu_head_dim(s)


def _vllm_cpu_head_dim(s: RunSpec) -> Iterator[Violation]:
    """vLLM's CPU build refuses a head width it has no kernel for; a checkpoint's own width is not the user's to
    change: the fix is the engine (rollout=hf, or vLLM on GPUs), the tiny model's is its shape."""
    m, f = s.model, model_facts(s.model)
    if f.head_dim in VLLM_CPU_HEAD_DIMS:
        return
    got = f"head_dim {f.head_dim} (" + (f"{s.model.path}/config.json" if m.path else " / ".join(f.head_dim_keys)) + ")"
    why = f"vLLM's CPU attention runs head_dim {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}; this model has {got}"
    if m.path:
        yield V("heads_divide", ("rollout.backend", "cluster.gpus_per_node", "model.path"), why,
                "the model is valid, vLLM's CPU build cannot run it: use rollout=hf, or vLLM on GPUs "
                "(cluster.gpus_per_node > 0)")
    else:
        yield V("heads_divide", (*f.head_dim_keys, "rollout.backend"), why,
                "use rollout=hf, or give the tiny model a head width from that list (e.g. model.hidden_size="
                f"{32 * m.num_attention_heads} for {m.num_attention_heads} heads)")


# ---------------------------------------------------------------- lengths --------------------


@rule("pure")
def sequence_lengths(s: RunSpec) -> Iterator[Violation]:
    prompt, new, total = s.env.max_prompt_tokens, s.rollout.max_new_tokens, s.train.max_total_sequence_length
    if prompt + new > total:
        yield V("sequence_lengths",
                ("rollout.max_new_tokens", "env.max_prompt_tokens", "train.max_total_sequence_length"),
                f"prompt {prompt} + generation {new} = {prompt + new} > train.max_total_sequence_length={total}",
                f"lower rollout.max_new_tokens to ≤ {total - prompt}, or raise the total" if total - prompt >= 1 else
                f"set train.max_total_sequence_length ≥ {prompt + new}, or lower env.max_prompt_tokens below {total}")
    mml = s.rollout.max_model_len
    if mml is not None and mml < prompt + new:
        yield V("sequence_lengths", ("rollout.max_model_len",),
                f"the engine's max_model_len {mml} < prompt {prompt} + generation {new} = {prompt + new}",
                f"set rollout.max_model_len ≥ {prompt + new} (or null to derive it)")
    if mml is not None and s.rollout.backend == RolloutBackend.vllm and mml < total:
        yield V("sequence_lengths", ("rollout.max_model_len", "train.max_total_sequence_length"),
                f"the engine's max_model_len {mml} < train.max_total_sequence_length={total}: the engine refuses "
                "sequences that training accepts", f"set rollout.max_model_len ≥ {total}, or null (derived)")
    if s.model.max_position_embeddings < total:
        yield V("sequence_lengths", ("train.max_total_sequence_length", "model.max_position_embeddings"),
                f"{total} tokens exceed the model's {s.model.max_position_embeddings} positions",
                f"set train.max_total_sequence_length ≤ {s.model.max_position_embeddings}")


# ---------------------------------------------------------------- rollout --------------------


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
    if s.cluster.gpus_per_node == 0:  # CPU engines: the KV cache is sized in MiB, never from free RAM
        # K and V of every layer: num_key_value_heads × head_dim (config.json's head_dim when set), as spec/memory.py
        per_token = 2 * m.num_layers * model_facts(m).kv_dim * (4 if m.dtype.value == "float32" else 2)
        tokens = -(-mml // 128) * 128  # vLLM's CPU KV blocks hold 128 tokens
        need_mb = per_token * tokens / 2**20
        if r.kv_cache_memory_mb < 1:
            yield V("vllm_engine_memory_and_length", "rollout.kv_cache_memory_mb",
                    f"must be ≥ 1 MiB, got {r.kv_cache_memory_mb}: an unset KV size lets vLLM take ~92 % of RAM",
                    "set rollout.kv_cache_memory_mb (64 fits the tiny model many times over)")
        elif need_mb > r.kv_cache_memory_mb:
            yield V("vllm_engine_memory_and_length", ("rollout.kv_cache_memory_mb", "rollout.max_model_len"),
                    f"one {mml}-token sequence needs {per_token} B/token × {tokens} (128-token blocks) = "
                    f"{need_mb:.0f} MiB of KV cache, "
                    f"more than rollout.kv_cache_memory_mb={r.kv_cache_memory_mb}",
                    f"set rollout.kv_cache_memory_mb ≥ {int(need_mb) + 1}")


@rule("pure")
def sampling_keeps_logprobs_exact(s: RunSpec) -> Iterator[Violation]:
    r = s.rollout
    if r.temperature <= 0:
        yield V("sampling_keeps_logprobs_exact", "rollout.temperature",
                f"RL sampling needs temperature > 0, got {r.temperature}", "set rollout.temperature=1.0")


# ---------------------------------------------------------------- loss -----------------------


@rule("pure")
def loss_ranges(s: RunSpec) -> Iterator[Violation]:
    lo = s.loss
    if not 0 <= lo.clip_low < 1:
        yield V("loss_ranges", "loss.clip_low", f"must be in [0, 1), got {lo.clip_low}", "e.g. loss.clip_low=0.2")
    if lo.clip_high < 0:
        yield V("loss_ranges", "loss.clip_high", f"must be ≥ 0, got {lo.clip_high}", "e.g. loss.clip_high=0.28")
    if lo.dual_clip_c is not None and lo.dual_clip_c <= 1:
        yield V("loss_ranges", "loss.dual_clip_c", f"dual clip needs c > 1, got {lo.dual_clip_c}",
                "set loss.dual_clip_c=3 or null")
    if lo.kl_coef < 0:
        yield V("loss_ranges", "loss.kl_coef", f"must be ≥ 0, got {lo.kl_coef}", "set loss.kl_coef=0 to disable")
    if lo.kl_clamp is not None and lo.kl_clamp <= 0:
        yield V("loss_ranges", "loss.kl_clamp", f"must be > 0 or null, got {lo.kl_clamp}", "e.g. loss.kl_clamp=10")
    if lo.dynamic_sampling and lo.dynamic_sampling_max_rounds < 1:
        yield V("loss_ranges", "loss.dynamic_sampling_max_rounds", "dynamic sampling needs ≥ 1 generation round",
                "set loss.dynamic_sampling_max_rounds=3")


@rule("pure")
def sequence_ratios_need_sequence_loss(s: RunSpec) -> Iterator[Violation]:
    lo = s.loss
    if lo.ratio_level == RatioLevel.sequence and lo.aggregation == Aggregation.token_mean:
        yield V("sequence_ratios_need_sequence_loss", ("loss.aggregation", "loss.ratio_level"),
                "sequence-level ratios (GSPO) with a token-level loss mix two granularities",
                "set loss.aggregation=seq_mean_token_mean")


@rule("pure")
def importance_sampling_truncation(s: RunSpec) -> Iterator[Violation]:
    lo, low = s.loss, s.loss.is_threshold_low
    if low is not None and lo.is_truncation != ISTruncation.icepop:
        yield V("importance_sampling_truncation", ("loss.is_threshold_low", "loss.is_truncation"),
                f"loss.is_threshold_low is icepop's lower bound, but loss.is_truncation={lo.is_truncation.value}",
                "set loss.is_threshold_low=null, or loss.is_truncation=icepop")
    elif low is not None and not 0 < low < 1:
        yield V("importance_sampling_truncation", "loss.is_threshold_low",
                f"icepop keeps weights in [low, high] around 1: low must be in (0, 1), got {low}",
                "e.g. loss.is_threshold_low=0.5 (the IcePop paper's)")
    if lo.is_truncation == ISTruncation.none:
        return
    if not lo.importance_sampling_correction:
        yield V("importance_sampling_truncation", ("loss.importance_sampling_correction", "loss.is_truncation"),
                f"loss.is_truncation={lo.is_truncation.value} truncates IS weights, but the correction is off",
                "set loss.importance_sampling_correction=true")
    floor = 1.0 if lo.is_truncation == ISTruncation.icepop else 0.0
    if lo.is_threshold is None or lo.is_threshold <= floor:
        yield V("importance_sampling_truncation", ("loss.is_threshold",),
                f"{lo.is_truncation.value} needs loss.is_threshold > {floor:g}, got {lo.is_threshold}",
                "e.g. loss.is_threshold=2.0")


# ---------------------------------------------------------------- placement / async GRPO ---


@rule("pure")
def separate_rollout_devices(s: RunSpec) -> Iterator[Violation]:
    """cluster.rollout_devices: engines on devices of their own, after the policy's (train/workers.py)."""
    n, world = rollout_devices(s), world_size(s)
    per_node = "cluster.gpus_per_node" if s.cluster.gpus_per_node > 0 else "cluster.cpu_workers_per_node"
    if n < 0:
        yield V("separate_rollout_devices", "cluster.rollout_devices", f"must be ≥ 0, got {n}",
                "0 = engines colocated with the policy, else the number of devices the engines get")
    elif n >= world > 0:
        yield V("separate_rollout_devices", ("cluster.rollout_devices", per_node),
                f"{n} of the job's {world} device(s) for the engines leaves none for the policy",
                f"set cluster.rollout_devices ≤ {world - 1}, or give the job more devices ({per_node})")


def async_placement(s: RunSpec, cli_keys: Iterable[str]) -> RunSpec:
    """grpo.async_grpo.enabled without cluster.rollout_devices: the engines get devices of their own, said on stdout
    (the plan's placement line shows them): half the job's devices (whole engines of rollout.tensor_parallel_size),
    or, on a one-slot CPU run, one more CPU worker slot. A one-GPU job (or stated values) is the rule's to refuse."""
    keys = set(cli_keys)
    if not s.grpo.async_grpo.enabled or s.cluster.rollout_devices or "cluster.rollout_devices" in keys:
        return s
    world, tp, c = world_size(s), s.rollout.tensor_parallel_size, s.cluster
    if world >= 2 * tp:
        picked = dataclasses.replace(c, rollout_devices=max(tp, world // 2 // tp * tp))
        said = f"cluster.rollout_devices={picked.rollout_devices}"
    elif c.gpus_per_node == 0 and c.nodes == 1 and tp == 1 and "cluster.cpu_workers_per_node" not in keys:
        picked = dataclasses.replace(c, rollout_devices=1, cpu_workers_per_node=c.cpu_workers_per_node + 1)
        said = f"cluster.rollout_devices=1 cluster.cpu_workers_per_node={picked.cpu_workers_per_node}"
    else:
        return s
    print(f"grpo-launcher: grpo.async_grpo.enabled: the rollout engines get devices of their own: {said} (set "
          "cluster.rollout_devices to choose)", flush=True)
    return dataclasses.replace(s, cluster=picked)


@rule("pure")
def async_grpo_combinations(s: RunSpec) -> Iterator[Violation]:
    """grpo.async_grpo (train/async_loop.py): what async GRPO needs, and what it does not support."""
    a, name = s.grpo.async_grpo, "async_grpo_combinations"
    if a.max_trajectory_age_steps < 1:
        yield V(name, "grpo.async_grpo.max_trajectory_age_steps",
                f"must be ≥ 1, got {a.max_trajectory_age_steps} (age 0 is the synchronous loop)",
                "set grpo.async_grpo.max_trajectory_age_steps=1 (one step off-policy), or grpo.async_grpo.enabled=false")
    if not a.enabled:
        if a.in_flight_weight_updates:
            yield V(name, ("grpo.async_grpo.in_flight_weight_updates", "grpo.async_grpo.enabled"),
                    "in-flight weight updates only exist in the async loop (the sync loop never generates while "
                    "it updates)", "set grpo.async_grpo.enabled=true, or grpo.async_grpo.in_flight_weight_updates=false")
        return
    if rollout_devices(s) < 1:
        world = world_size(s)
        per_node = "cluster.gpus_per_node" if s.cluster.gpus_per_node > 0 else "cluster.cpu_workers_per_node"
        fix = (f"add cluster.rollout_devices=1 {per_node}={devices_per_node(s) + 1} (one more device for the "
               "engine)" if world < 2 else f"set cluster.rollout_devices (1 ≤ it < {world}), e.g. {max(1, world // 4)}")
        yield V(name, ("cluster.rollout_devices", "grpo.async_grpo.enabled"),
                f"async GRPO generates while the trainer updates, so the engines need devices of their own; "
                f"cluster.rollout_devices=0 keeps them on the policy's {world} device(s)", fix)
    if s.loss.dynamic_sampling:
        yield V(name, ("loss.dynamic_sampling", "grpo.async_grpo.enabled"),
                "dynamic sampling refills a step's batch until its groups' rewards vary; async generates batches "
                "steps ahead, so the refills would come from a staler policy and their number would change how far "
                "ahead the engines run: not implemented", "set loss.dynamic_sampling=false, or run sync")
    if s.env.name == EnvName.nemo_gym:
        yield V(name, ("grpo.async_grpo.enabled", "env.name"),
                "env=nemo_gym rolls out through Gym's agents (GymTrainer), which has no async loop yet",
                "set grpo.async_grpo.enabled=false")
    gpu_bf16 = s.cluster.gpus_per_node > 0 and "bfloat16" in (s.train.precision.value, s.model.dtype.value)
    if not s.loss.importance_sampling_correction and (s.rollout.backend == RolloutBackend.vllm or gpu_bf16):
        why = "vLLM's kernels" if s.rollout.backend == RolloutBackend.vllm else "a bf16 engine"
        yield V(name, ("loss.importance_sampling_correction", "grpo.async_grpo.enabled"),
                f"async trains on samples up to {a.max_trajectory_age_steps} policy version(s) old from an engine "
                f"whose numerics differ from the trainer's ({why}): without the importance-sampling correction "
                "pi_trainer / pi_rollout is ignored and the update is biased",
                "set loss.importance_sampling_correction=true (e.g. with loss.is_truncation=tis loss.is_threshold=2)")


@rule("pure")
def optimizer_ranges(s: RunSpec) -> Iterator[Violation]:
    """Values both backends would accept and then train wrongly with (or not at all)."""
    t = s.train
    if not t.lr > 0:
        yield V("optimizer_ranges", "train.lr", f"the learning rate must be > 0, got {t.lr}", "e.g. train.lr=1e-6")
    if t.weight_decay < 0:
        yield V("optimizer_ranges", "train.weight_decay", f"must be ≥ 0, got {t.weight_decay} (it would grow the "
                "weights)", "set train.weight_decay=0 (off) or e.g. 0.01")
    if not t.max_grad_norm > 0:
        yield V("optimizer_ranges", "train.max_grad_norm",
                f"must be > 0, got {t.max_grad_norm}: the torch backend would scale every gradient to 0, while "
                "megatron reads 0 as 'no clipping'", "set train.max_grad_norm=1.0 (clipping cannot be turned off)")
    if t.warmup_steps < 0:
        yield V("optimizer_ranges", "train.warmup_steps", f"must be ≥ 0, got {t.warmup_steps}",
                "set train.warmup_steps=0 (no warm-up)")


# ---------------------------------------------------------------- validation / checkpoints --


@rule("pure")
def validation_sizes(s: RunSpec) -> Iterator[Violation]:
    """The seed's second review bug: `max_val_samples: null` must mean 'all', never crash."""
    g = s.grpo
    if g.max_val_samples is not None and g.max_val_samples < 1:
        yield V("validation_sizes", "grpo.max_val_samples", f"must be ≥ 1 or null (= all), got {g.max_val_samples}",
                "set grpo.max_val_samples=null to validate on the whole set")
    elif g.max_val_samples is not None and g.max_val_samples < g.val_batch_size:
        yield V("validation_sizes", ("grpo.max_val_samples", "grpo.val_batch_size"),
                f"max_val_samples={g.max_val_samples} < val_batch_size={g.val_batch_size}: "
                f"{g.max_val_samples} // {g.val_batch_size} = 0 full batches",
                f"raise grpo.max_val_samples to ≥ {g.val_batch_size}, lower the batch, or use null (= all)")


@rule("pure")
def checkpoint_metric_is_produced(s: RunSpec) -> Iterator[Violation]:
    c, g = s.checkpoint, s.grpo
    if not c.enabled:
        return
    if c.metric not in KNOWN_METRICS:
        yield V("checkpoint_metric_is_produced", "checkpoint.metric",
                f"'{c.metric}' is not a metric this trainer logs", f"use one of: {', '.join(KNOWN_METRICS)}")
    elif c.metric.startswith("val/"):
        if g.val_period == 0:
            yield V("checkpoint_metric_is_produced", ("checkpoint.metric", "grpo.val_period"),
                    f"top-k by {c.metric} needs validation, but grpo.val_period=0",
                    "set grpo.val_period, or rank checkpoints by a train/ metric")
        elif c.save_period % g.val_period:
            yield V("checkpoint_metric_is_produced", ("checkpoint.save_period", "grpo.val_period"),
                    f"checkpoints every {c.save_period} steps but validation every {g.val_period}: "
                    f"{c.save_period} % {g.val_period} = {c.save_period % g.val_period}, so saves miss {c.metric}",
                    f"make checkpoint.save_period a multiple of {g.val_period}")


@rule("pure")
def checkpoint_metric_direction(s: RunSpec) -> Iterator[Violation]:
    c = s.checkpoint
    higher = METRIC_HIGHER_IS_BETTER.get(c.metric)
    if c.enabled and higher is not None and higher != c.higher_is_better:
        yield V("checkpoint_metric_direction", ("checkpoint.higher_is_better", "checkpoint.metric"),
                f"{c.metric} is better when {'higher' if higher else 'lower'}, but checkpoint.higher_is_better="
                f"{str(c.higher_is_better).lower()}: top-k would keep the worst checkpoints",
                f"set checkpoint.higher_is_better={str(higher).lower()}")


# ---------------------------------------------------------------- cluster --------------------


@rule("pure")
def ray_object_store_minimum(s: RunSpec) -> Iterator[Violation]:
    mb = s.cluster.object_store_memory_mb
    if mb < RAY_MIN_OBJECT_STORE_MB:
        yield V("ray_object_store_minimum", "cluster.object_store_memory_mb",
                f"Ray refuses an object store below {RAY_MIN_OBJECT_STORE_MB} MiB, got {mb} MiB "
                "(ray start fails on every node)", f"set cluster.object_store_memory_mb ≥ {RAY_MIN_OBJECT_STORE_MB}")


@rule("pure")
def local_is_one_node(s: RunSpec) -> Iterator[Violation]:
    if s.cluster.kind == ClusterKind.local and s.cluster.nodes != 1 and s.cluster.ray_address is None:
        yield V("local_is_one_node", ("cluster.nodes", "cluster.kind"),
                f"cluster=local runs on this machine, but cluster.nodes={s.cluster.nodes}",
                "use cluster=slurm for several nodes")


@rule("probe")
def local_gpus_present(s: RunSpec) -> Iterator[Violation]:
    """cluster=local asking for GPUs this machine does not have: Ray would wait forever for them."""
    if s.cluster.kind != ClusterKind.local or s.cluster.gpus_per_node <= 0 or s.cluster.ray_address:
        return  # an existing Ray cluster's GPUs are its nodes', not this machine's
    import torch  # only for a GPU request: device_count reads the driver (NVML) without starting CUDA

    have = torch.cuda.device_count()
    if have < s.cluster.gpus_per_node:
        yield V("local_gpus_present", ("cluster.gpus_per_node", "cluster.kind"),
                f"cluster=local asks for {s.cluster.gpus_per_node} GPU(s), but this machine has {have} visible CUDA "
                f"device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                f"set cluster.gpus_per_node={have}" + (" (the CPU default)" if not have else "")
                + ", or run on a GPU node / with cluster=slurm")


RAY_ADDRESS_FIX = ("cluster.ray_address=HOST:PORT of the cluster's head (its GCS port, `ray start --head --port`), "
                   "or RAY_ADDRESS")


def ray_host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    return None if not host or not port.isdigit() or "://" in address else (host.strip("[]"), int(port))


@rule("pure")
def ray_cluster_reachable(s: RunSpec) -> Iterator[Violation]:
    """cluster=ray: an address is given, HOST:PORT (ray_cluster_answers: something listens there). Its auth is
    checked when the driver joins (launch/local.py)."""
    address = s.cluster.ray_address
    if address is None:
        return
    if s.cluster.kind != ClusterKind.local:
        yield V("ray_cluster_reachable", ("cluster.ray_address", "cluster.kind"), "an existing Ray cluster is joined "
                f"by a driver on this machine (cluster=ray), not by a {s.cluster.kind.value} job", "use cluster=ray")
    elif ray_host_port(address) is None:
        yield V("ray_cluster_reachable", "cluster.ray_address", f"cluster=ray needs the cluster's address HOST:PORT, "
                f"got {address!r}" + (" (RAY_ADDRESS is unset)" if not address else ""), RAY_ADDRESS_FIX)


@rule("probe", name="ray_cluster_reachable")
def ray_cluster_answers(s: RunSpec) -> Iterator[Violation]:
    """Something listens at cluster=ray's address (Ray's own connect would retry for a minute, then a traceback)."""
    address = s.cluster.ray_address
    where = ray_host_port(address) if address and s.cluster.kind == ClusterKind.local else None
    if where is None:
        return
    import socket

    try:
        socket.create_connection(where, timeout=5).close()
    except OSError as exc:
        yield V("ray_cluster_reachable", "cluster.ray_address", f"no Ray cluster answers at {address}: {exc}",
                RAY_ADDRESS_FIX)


@rule("pure")
def slurm_fields(s: RunSpec) -> Iterator[Violation]:
    c = s.cluster
    if c.kind != ClusterKind.slurm:
        return
    if c.requires_account and not c.account:
        yield V("slurm_fields", "cluster.account", "this cluster needs an account (--account)",
                "set cluster.account=<your account>")
    if c.requires_partition and not c.partition:
        yield V("slurm_fields", "cluster.partition", "this cluster needs a partition (--partition)",
                "set cluster.partition=<partition>")
    for key in ("partition", "account", "qos", "job_name"):
        value = getattr(c, key)
        if value is not None and not SAFE_SLURM_WORD.fullmatch(value):
            yield V("slurm_fields", f"cluster.{key}", f"{value!r} has characters Slurm names never contain",
                    "use letters, digits and . _ - , : only")
    for name in c.env_passthrough:
        if not ENV_NAME.fullmatch(name):
            yield V("slurm_fields", "cluster.env_passthrough", f"{name!r} is not an environment variable name",
                    "list names only (values are read from the environment at submission)")


@rule("pure")
def ray_temp_dir_short(s: RunSpec) -> Iterator[Violation]:
    d = s.cluster.ray_temp_dir
    if len(d) > 40 or not d.startswith("/"):
        yield V("ray_temp_dir_short", "cluster.ray_temp_dir",
                f"{d!r}: Ray's socket paths under it must stay below 107 bytes (AF_UNIX)",
                "use a short absolute path, e.g. /tmp/ray")


# Paths, images and mounts that reach the job's shell (quoted there as well): no blanks, quotes or shell syntax.
SAFE_SHELL_VALUE = re.compile(r"[A-Za-z0-9_.,:+=@%/#~-]+")
JOB_PORT_SLOTS = 16  # = launch.sbatch.JOB_PORT_SLOTS (kept here: rules must not import the launcher)
PORT_BLOCK = 200  # ports one node uses from cluster.ray_port on (plan.PORT_OFFSETS: 0-8 and 100-199)


@rule("pure")
def shell_values(s: RunSpec) -> Iterator[Violation]:
    c = s.cluster
    if c.kind != ClusterKind.slurm:
        return
    values = [("cluster.python", c.python), ("cluster.ray_temp_dir", c.ray_temp_dir),
              ("cluster.container_image", c.container_image), *(("cluster.container_mounts", m) for m in c.container_mounts)]
    for key, value in values:
        if value is not None and not SAFE_SHELL_VALUE.fullmatch(value):
            yield V("shell_values", key, f"{value!r} has blanks, quotes or shell syntax",
                    "use a plain path/name: letters, digits and . _ - / : , + = @ % # ~ only")
    for m in c.container_mounts:
        if SAFE_SHELL_VALUE.fullmatch(m) and not re.fullmatch(r"/[^:]*:/[^:]*(:[a-z,]+)?", m):
            yield V("shell_values", "cluster.container_mounts", f"{m!r} is not SRC:DST[:FLAGS] with absolute paths",
                    "e.g. cluster.container_mounts=[/data:/data:ro]")


@rule("pure")
def slurm_log_paths(s: RunSpec) -> Iterator[Violation]:
    """sbatch/srun --output expand %-patterns (a % is escaped as %%), and one backslash switches every pattern
    of the name off (the job log would lose its %j): the run dir must not hold a backslash."""
    if s.cluster.kind != ClusterKind.slurm:
        return
    for key, value in (("output_root", s.output_root), ("name", s.name)):
        if "\\" in value:
            yield V("slurm_log_paths", key, f"{value!r} holds a backslash: Slurm would not expand %j in the log names",
                    "use a path without backslashes")


@rule("pure")
def slurm_node_shape(s: RunSpec) -> Iterator[Violation]:
    """GPUs per node vs the cluster's nodes; containers; the Ray port block per node."""
    c = s.cluster
    if c.kind != ClusterKind.slurm:
        return
    if c.node_gpus is not None and c.gpus_per_node > c.node_gpus:
        yield V("slurm_node_shape", ("cluster.gpus_per_node", "cluster.node_gpus"),
                f"the plan puts {c.gpus_per_node} GPUs on each node, but this cluster's nodes have {c.node_gpus}",
                f"set cluster.gpus_per_node ≤ {c.node_gpus} and raise cluster.nodes instead")
    if c.container_image and not c.python:
        yield V("slurm_node_shape", ("cluster.python", "cluster.container_image"),
                "with a container image the launcher's own interpreter path means nothing inside the image",
                "set cluster.python to the image's interpreter, e.g. cluster.python=python")
    if c.container_mounts and not c.container_image:
        yield V("slurm_node_shape", ("cluster.container_mounts", "cluster.container_image"),
                "container mounts without a container image would be ignored", "set cluster.container_image")
    if c.node_port_stride and c.node_port_stride < PORT_BLOCK:
        yield V("slurm_node_shape", "cluster.node_port_stride",
                f"nodes sharing a host need port blocks {PORT_BLOCK} apart, got a stride of {c.node_port_stride}",
                f"set cluster.node_port_stride ≥ {PORT_BLOCK} (e.g. 1000), or 0 on real clusters")
    span = PORT_BLOCK + c.node_port_stride * (c.nodes - 1)  # ports one job uses from its first port
    if c.job_port_stride and c.job_port_stride < span:
        yield V("slurm_node_shape", "cluster.job_port_stride",
                f"one job's ports span {span}; jobs {c.job_port_stride} apart would overlap",
                f"set cluster.job_port_stride ≥ {span}")
    top = c.ray_port + span - 1 + c.job_port_stride * (JOB_PORT_SLOTS - 1)
    if c.ray_port < 1024 or top > 65535:
        yield V("slurm_node_shape", ("cluster.ray_port", "cluster.node_port_stride"),
                f"the Ray port block spans {c.ray_port}..{top}: it must lie within 1024..65535",
                "lower cluster.ray_port, cluster.node_port_stride or cluster.job_port_stride")


@rule("pure")
def time_budget(s: RunSpec) -> Iterator[Violation]:
    c = s.cluster
    try:
        limit = parse_duration(c.time)
    except ValueError as exc:
        yield V("time_budget", "cluster.time", str(exc), "use [D-]HH:MM:SS, e.g. cluster.time=04:00:00")
        return
    if c.kind == ClusterKind.slurm and c.signal_before_s >= limit:
        yield V("time_budget", ("cluster.signal_before_s", "cluster.time"),
                f"the save signal {c.signal_before_s}s before the end comes before the job starts ({limit}s)",
                "lower cluster.signal_before_s")
    if s.checkpoint.must_save_by is None:
        return
    try:
        save_by = parse_duration(s.checkpoint.must_save_by)
    except ValueError as exc:
        yield V("time_budget", "checkpoint.must_save_by", str(exc), "use HH:MM:SS")
        return
    if c.kind == ClusterKind.slurm and save_by + CHECKPOINT_MARGIN_S > limit:
        yield V("time_budget", ("checkpoint.must_save_by", "cluster.time"),
                f"save by {save_by}s + {CHECKPOINT_MARGIN_S}s write margin = {save_by + CHECKPOINT_MARGIN_S}s "
                f"> the job's --time {limit}s: Slurm kills the job before the checkpoint lands",
                f"set checkpoint.must_save_by ≤ {limit - CHECKPOINT_MARGIN_S}s before cluster.time")


@rule("pure")
def safe_names(s: RunSpec) -> Iterator[Violation]:
    if not SAFE_NAME.fullmatch(s.name):
        yield V("safe_names", "name", f"run name {s.name!r} becomes a directory and a job name",
                "use letters, digits and . _ - = + , @ only")
    elif s.name.startswith("."):
        yield V("safe_names", "name", f"run name {s.name[:40]!r}{'...' if len(s.name) > 40 else ''} must not start "
                f"with '.' (output_root/{s.name[:8]} would leave or hide in output_root)", "use a name like my-run_1")
    elif len(s.name) > MAX_NAME:
        yield V("safe_names", "name", f"run name {s.name[:40]!r}... has {len(s.name)} characters, more than "
                f"{MAX_NAME} (a directory and a job name)", "use a shorter name, like my-run_1")


@rule("probe")
def local_paths_exist(s: RunSpec) -> Iterator[Violation]:
    """Paths a local run reads must exist here (a Slurm job's paths live on the cluster's filesystem)."""
    if s.cluster.kind != ClusterKind.local:
        return
    if s.model.path and not Path(s.model.path).is_dir():
        yield V("local_paths_exist", "model.path", f"no model directory at {s.model.path}",
                "point model.path at an HF checkpoint directory (or null for the tiny model)")
    for key in ("train_path", "val_path"):
        path = getattr(s.env, key)
        if path and not Path(path).exists():
            yield V("local_paths_exist", f"env.{key}", f"no file at {path}",
                    f"point env.{key} at a JSONL / Parquet file or a saved datasets directory")


@rule("pure")
def model_weights_readable(s: RunSpec) -> Iterator[Violation]:
    """model.path's *.safetensors headers against their files' sizes (spec/safetensors_check.py)."""
    from .safetensors_check import weights_problems

    yield from weights_problems(s)


# ---------------------------------------------------------------- values, and what this build runs --


INT_LIMIT = 2**31 - 1  # every count, size, port and seed of the schema fits (torch, Ray and Slurm take int32)
MAX_TEXT = 4096
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def leaf_values(obj: Any, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf field of a spec section."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from leaf_values(value, f"{key}.")
        else:
            yield key, value


def value_problem(value: object) -> str | None:
    """Why a single value cannot travel to the job and back (spec.yaml, sbatch, Ray), or None."""
    if value is None or isinstance(value, (bool, Enum)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"must be a finite number, got {value}"
    if isinstance(value, int):
        return None if abs(value) <= INT_LIMIT else f"{str(value)[:12]}... ({len(str(value))} digits) is out of range"
    if isinstance(value, str):
        if CONTROL_CHARS.search(value):
            return f"{value[:40]!r} holds a line break or control character"
        if "${" in value:
            return f"{value[:40]!r} holds '${{': the job would resolve it as an interpolation when it reads spec.yaml"
        return None if len(value) <= MAX_TEXT else f"is {len(value)} characters long (at most {MAX_TEXT})"
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (list, tuple, dict)):
                return f"items must be plain values, got a nested {type(item).__name__}"
            why = value_problem(item)
            if why:
                return f"item {why}"
        return None
    return f"unexpected value of type {type(value).__name__}"


@rule("pure")
def field_values(s: RunSpec) -> Iterator[Violation]:
    """Every leaf value: finite floats, int32-sized integers, one-line text without `${`, flat lists."""
    for key, value in leaf_values(s):
        why = value_problem(value)
        if why:
            yield V("field_values", key, why, f"set {key} to a plain, finite, one-line value")


@rule("pure", name="field_values")
def list_keys_hold_lists(s: RunSpec) -> Iterator[Violation]:
    """A list key holds a list: an interpolation of a scalar into one (cluster.container_mounts=${train.lr}) passes
    OmegaConf's merge unchecked, and the job's reload of spec.yaml would refuse it on the node."""
    for key, value in non_lists(s):
        yield V("field_values", key, f"is a list key but holds the {type(value).__name__} {str(value)[:40]!r} "
                "(an interpolation of a single value?)", f"set {key} to a list: {key}=[a,b] (or [${{...}}])")


def non_lists(obj: Any, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every list-typed field whose value is not a list."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from non_lists(value, f"{key}.")
        elif str(f.type).startswith(("list[", "tuple[")) and not isinstance(value, (list, tuple)):
            yield key, value


@rule("probe")
def build_implements_run(s: RunSpec) -> Iterator[Violation]:
    """Backend × family × layout × env this build cannot run: refused before anything is started or submitted
    (a dry run still plans and renders, so recipes for other builds stay inspectable). The rooms check their own
    parts under this name (policy/rules.py, gym/rules.py)."""
    m = s.model
    for package, why in untested(s):
        yield build_gap(("cluster.untested_versions",), f"{why} (this interpreter's, which the run uses)",
                        f"install a tested {package} (src/grpo_launcher/spec/versions.py), or set "
                        "cluster.untested_versions=true")
    builds = (m.family == "qwen2" and not m.num_experts) or (m.family == "nemotron_h" and m.num_experts > 0)
    if m.path is None and (not builds or m.tie_word_embeddings):
        yield build_gap(("model.path", "model.family", "model.num_experts", "model.tie_word_embeddings"),
                        f"model.path=null builds an untied dense Qwen2 or MoE nemotron_h model here (models/), not "
                        f"family={m.family}, num_experts={m.num_experts}, tie_word_embeddings={m.tie_word_embeddings}",
                        "set model.path to an HF checkpoint directory of that architecture")


@rule("pure")
def trackers_installed(s: RunSpec) -> Iterator[Violation]:
    """logging.wandb and logging.tensorboard need their packages (dependencies of this package); the W&B project
    (WANDB_PROJECT, else logging.experiment) must be a name wandb's own settings accept."""
    import importlib.util
    import os

    if s.logging.wandb and importlib.util.find_spec("wandb") is None:
        yield V("trackers_installed", "logging.wandb", "the `wandb` package is not installed",
                "pip install wandb (a dependency of this package: reinstall it), or logging.wandb=false")
    elif s.logging.wandb:
        import wandb
        from wandb.errors import UsageError

        project = os.environ.get("WANDB_PROJECT") or s.logging.experiment
        try:
            wandb.Settings(project=project)
        except UsageError as exc:
            key = "WANDB_PROJECT" if os.environ.get("WANDB_PROJECT") else "logging.experiment"
            yield V("trackers_installed", ("logging.wandb", key), f"W&B refuses the project from {key}: {exc}",
                    f"set {key} to a W&B project name (no / \\ # ? % :, at most 128 characters)")
    if s.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        yield V("trackers_installed", "logging.tensorboard", "the `tensorboard` package is not installed",
                "pip install tensorboard (a dependency of this package: reinstall it), or logging.tensorboard=false")


@rule("probe")
def output_root_writable(s: RunSpec) -> Iterator[Violation]:
    """The run directory can be made: the nearest existing part of OUTPUT_ROOT/NAME is a directory this user may
    write (nothing is created here); else the launcher would fail making RUN_DIR after the plan."""
    path = Path(s.output_root).expanduser().absolute() / s.name
    while not path.exists() and path != path.parent:
        path = path.parent
    problem = ("is not a directory" if not path.is_dir() else
               None if os.access(path, os.W_OK | os.X_OK) else "is not writable by this user")
    if problem:
        yield V("output_root_writable", "output_root", f"{path} {problem}: the run directory cannot be made there",
                "set output_root to a directory you can write (it is created if missing)")


@rule("probe")
def run_name_not_finished(s: RunSpec) -> Iterator[Violation]:
    """Re-launching a finished run's name would train nothing (and overwrite its summary): refused."""
    from ..finished import finished_problem

    problem = finished_problem(s)
    if problem:
        yield V("run_name_not_finished", ("name", "checkpoint.resume", "grpo.max_steps"), *problem)


@rule("probe")
def run_name_checkpoints_compatible(s: RunSpec) -> Iterator[Violation]:
    """Resuming a run name whose newest checkpoint was written by another model, parallelism or env would be
    refused by the job after it had built a model and rewritten spec.yaml: refused here, nothing touched."""
    from ..checkpoint.manager import incompatibilities, load_meta
    from ..finished import last_checkpoint_step

    run_dir = Path(s.output_root).resolve() / s.name
    step = None if s.checkpoint.resume != Resume.auto else last_checkpoint_step(run_dir)
    if step is None:
        return
    try:
        meta = load_meta(run_dir / "checkpoints" / f"step_{step:06d}")
    except (OSError, ValueError):  # unreadable: the job's resume verifies it and falls back to an older one
        return
    diffs = incompatibilities(meta, s) if "compat" in meta or "spec" in meta else []  # the job's own check
    if diffs:
        keys = tuple(dict.fromkeys(d.split(":")[0] for d in diffs))
        yield V("run_name_checkpoints_compatible", (*keys, "checkpoint.resume"),
                f"run '{s.name}' has checkpoints (step {step}) from an incompatible spec (checkpoint → this run): "
                + "; ".join(diffs), "checkpoint.resume=fresh (moves its checkpoints aside), or a new name=...")


# ---------------------------------------------------------------- memory (spec/memory.py) ----


@rule("pure")
def gpu_memory_fits(s: RunSpec) -> Iterator[Violation]:
    """The memory pre-flight: the plan's peak per GPU against cluster.gpu_memory_gib (null: skipped)."""
    from .memory import violations as memory_violations

    yield from memory_violations(s)


@rule("probe")
def checkpoint_disk_room(s: RunSpec) -> Iterator[Violation]:
    """output_root holds the run's checkpoints at their peak: kept + one being written (spec/disk.py)."""
    from .disk import room_violations

    yield from room_violations(s)


@rule("pure")
def deadlines_health_keys(s: RunSpec) -> Iterator[Violation]:
    """The engines' health probe and restart cap (deadlines.py EngineProbe, train/driver.py recover)."""
    d = s.deadlines
    for key, value, ok, fix in (("health_period_s", d.health_period_s, d.health_period_s >= 0, "0 = no probe"),
                                ("health_timeout_s", d.health_timeout_s, d.health_timeout_s > 0, "e.g. 10"),
                                ("engine_restarts", d.engine_restarts, d.engine_restarts >= 0, "0 = never restart")):
        if not ok:
            yield V("deadlines_health_keys", f"deadlines.{key}", f"must be {'> 0' if key == 'health_timeout_s' else '≥ 0'}"
                    f", got {value}", f"set deadlines.{key} ({fix})")
