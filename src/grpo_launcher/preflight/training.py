"""The training side: the loss's ranges and combinations, async GRPO's placement and limits, the optimizer, and
validation and the checkpoint metric it ranks by."""

from __future__ import annotations

import math
from typing import Iterator

from ..plan import devices_per_node, rollout_devices, world_size
from ..spec.errors import Violation
from ..spec.schema import Aggregation, EnvName, ISTruncation, RatioLevel, RolloutBackend, RunSpec
from .registry import V, rule

# Metrics the trainer logs that checkpoint.metric may rank by, each with its direction (True = higher is better).
METRIC_HIGHER_IS_BETTER = {
    "val/reward_mean": True,
    "val/accuracy": True,
    "train/reward_mean": True,
    "train/accuracy": True,
    "train/loss": False,
}
KNOWN_METRICS = tuple(METRIC_HIGHER_IS_BETTER)


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
        if lo.is_threshold is not None:  # the weights would stay untruncated, silently
            yield V("importance_sampling_truncation", ("loss.is_threshold", "loss.is_truncation"),
                    f"loss.is_threshold={lo.is_threshold} bounds the IS weights only under a truncation, but "
                    "loss.is_truncation=none", "set loss.is_truncation=tis (or icepop), or loss.is_threshold=null")
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
    warm_beyond_the_run(s)
    lr_for_a_pretrained_model(s)


PRETRAINED_LR_MAX = 1e-4  # above this on a pretrained model of ≥ 1e8 parameters: a warning
PRETRAINED_PARAMS = 1e8


def lr_for_a_pretrained_model(s: RunSpec) -> None:
    """A warning (the run goes on): a learning rate fit for the tiny model built from scratch (the default 3e-4) on
    pretrained weights of 1e8 parameters or more, where GRPO post-training uses 1e-7..1e-5: the first updates
    would wreck what the model knows, silently (the rewards fall, nothing fails)."""
    t, m = s.train, s.model
    if m.path is None or not t.lr > PRETRAINED_LR_MAX:
        return
    from .memory_shapes import arch_of, param_counts

    try:
        a = arch_of(s)
        n = param_counts(a).total(a)
    except (ValueError, KeyError, ZeroDivisionError, TypeError):  # the sizes' own rules name bad values
        return
    if n >= PRETRAINED_PARAMS:
        from ..envs.preflight import warn

        warn(f"train.lr={t.lr:g} on the pretrained {n / 1e9:.2f}B-parameter model at model.path: GRPO post-training "
             "at this size uses 1e-7 to 1e-5 (the nanov3 recipe: 3e-6); a rate this high is the tiny model's and would "
             "undo the pretrained weights in a few steps; set train.lr, e.g. train.lr=1e-6")


def warm_beyond_the_run(s: RunSpec) -> None:
    """A warning (the run goes on: a later resume may go further): a warm-up longer than the run's optimizer steps,
    whose learning rate then never reaches train.lr."""
    t, g = s.train, s.grpo
    per_step = g.num_prompts_per_step * g.num_generations_per_prompt // max(t.global_batch_size, 1)
    total = g.max_steps * per_step
    if total > 0 and t.warmup_steps > total:
        from ..envs.preflight import warn  # the pre-flight warnings' one voice (stderr, once per process)

        warn(f"train.warmup_steps={t.warmup_steps} is longer than the run's {total} optimizer steps "
             f"(grpo.max_steps={g.max_steps} × {per_step} a step): the learning rate ends at "
             f"{total / t.warmup_steps:.0%} of train.lr={t.lr:g}")


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


def first_validated_checkpoint(s: RunSpec) -> int | None:
    """The first step whose checkpoint carries a val/ metric, from train/driver.py's loop: it saves every
    checkpoint.save_period steps and at grpo.max_steps; it validates every grpo.val_period steps (0 = never) and at
    grpo.max_steps with grpo.val_at_end. A checkpoint's meta.json holds its own step's metrics only (what
    checkpoint/manager.py ranks by), so grpo.val_at_start (step 0, no checkpoint) ranks nothing. A stop (a signal,
    checkpoint.must_save_by) saves off-period: not counted. None: no checkpoint of the run carries one."""
    g, c = s.grpo, s.checkpoint
    last, save, val = g.max_steps, max(c.save_period, 1), g.val_period
    both = math.lcm(save, val) if val > 0 else None
    periodic = both if both is not None and both <= last else None
    at_end = last if last >= 1 and (g.val_at_end or (val > 0 and last % val == 0)) else None
    found = [k for k in (periodic, at_end) if k is not None]
    return min(found) if found else None


@rule("pure")
def checkpoint_metric_is_produced(s: RunSpec) -> Iterator[Violation]:
    """A val/ checkpoint.metric ranks the checkpoints that carry it (the rest rank last): refused only when no
    checkpoint the run saves would carry it, so top-k would rank nothing (and the summary name no best)."""
    c, g = s.checkpoint, s.grpo
    if not c.enabled:
        return
    if c.metric not in KNOWN_METRICS:
        yield V("checkpoint_metric_is_produced", "checkpoint.metric",
                f"'{c.metric}' is not a metric this trainer logs", f"use one of: {', '.join(KNOWN_METRICS)}")
        return
    if not c.metric.startswith("val/") or g.max_steps < 1 or c.save_period < 1:
        return  # train/ metrics come with every step; the ranges are value_ranges' / sizes' to refuse
    if first_validated_checkpoint(s) is not None:
        return
    saves = list(range(c.save_period, min(g.max_steps, 3 * c.save_period) + 1, c.save_period))
    shown = ", ".join(map(str, saves)) + (", ..." if 3 * c.save_period < g.max_steps else "")
    shown = f"{shown} and {g.max_steps}" if shown and saves[-1] != g.max_steps else (shown or str(g.max_steps))
    when = (f"every {g.val_period} steps (first at step {g.val_period})" if g.val_period else "never periodically "
            "(grpo.val_period=0)")
    start = "; grpo.val_at_start=true validates at step 0, which has no checkpoint" if g.val_at_start else ""
    last = g.max_steps
    period_fix = (f"grpo.val_period={c.save_period}" if c.save_period <= last else f"grpo.val_period={last}")
    yield V("checkpoint_metric_is_produced",
            ("checkpoint.metric", "grpo.val_period", "grpo.val_at_end", "checkpoint.save_period", "grpo.max_steps"),
            f"top-k by {c.metric} ranks the checkpoints that carry it, but none will: checkpoints at step(s) {shown} "
            f"(checkpoint.save_period={c.save_period}, grpo.max_steps={last}), validation {when} and "
            f"grpo.val_at_end=false{start}",
            f"set grpo.val_at_end=true (validates at step {last}, which is always checkpointed), or {period_fix}, "
            "or rank by a train/ metric (checkpoint.metric=train/reward_mean)")


@rule("pure")
def checkpoint_metric_direction(s: RunSpec) -> Iterator[Violation]:
    c = s.checkpoint
    higher = METRIC_HIGHER_IS_BETTER.get(c.metric)
    if c.enabled and higher is not None and higher != c.higher_is_better:
        yield V("checkpoint_metric_direction", ("checkpoint.higher_is_better", "checkpoint.metric"),
                f"{c.metric} is better when {'higher' if higher else 'lower'}, but checkpoint.higher_is_better="
                f"{str(c.higher_is_better).lower()}: top-k would keep the worst checkpoints",
                f"set checkpoint.higher_is_better={str(higher).lower()}")
