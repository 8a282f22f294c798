"""Registries against the schema's Enums: every member has an implementation and every entry is a member;
every registered worker class has the methods of its contract (grpo_launcher/interfaces.py)."""

from __future__ import annotations

from enum import Enum

import pytest

from grpo_launcher import algos, envs, interfaces
from grpo_launcher.launch import EXECUTORS
from grpo_launcher.policy import POLICY_BACKENDS, policy_class
from grpo_launcher.rollout import ROLLOUT_BACKENDS, rollout_class
from grpo_launcher.train.engines import ENGINE_KINDS
from grpo_launcher.spec.schema import (
    Advantage,
    Aggregation,
    ClusterKind,
    EnvName,
    KLEstimator,
    RolloutBackend,
    TrainBackend,
)

HYBRID = {RolloutBackend.hf}  # colocated rollout=hf: the policy workers generate themselves (policy/hybrid.py)


def _names(keys) -> set[str]:
    return {getattr(k, "value", k) for k in keys}


REGISTRIES = [
    (TrainBackend, POLICY_BACKENDS),
    (RolloutBackend, {**ROLLOUT_BACKENDS, **{k: "hybrid" for k in HYBRID}}),
    (RolloutBackend, ENGINE_KINDS),  # the engines' traits and refit strategy, as the loop's engine pool sees them
    (ClusterKind, EXECUTORS),
    (Advantage, algos.ADVANTAGE_ESTIMATORS),
    (Aggregation, algos.LOSS_AGGREGATIONS),
    (KLEstimator, algos.KL_ESTIMATORS),
]


@pytest.mark.parametrize("enum, registry", [pytest.param(e, r, id=e.__name__) for e, r in REGISTRIES])
def test_every_enum_member_has_an_implementation_and_vice_versa(enum: type[Enum], registry: dict) -> None:
    assert _names(registry) == _names(enum), f"{enum.__name__} vs its registry"
    for member in enum:  # a member finds its entry, whether the registry is keyed by members or by names
        assert member in registry


def test_every_builtin_env_name_has_an_env_class() -> None:
    lazy = envs.LAZY_ENVS  # built-ins imported on first use (nemo_gym)
    assert _names(envs.ENVS).union(lazy) >= _names(EnvName)
    builtin = {k for k, cls in envs.ENVS.items() if cls.__module__.startswith("grpo_launcher.")}
    assert _names(builtin).union(lazy) <= _names(EnvName)  # names a program adds itself are not built-ins


@pytest.mark.parametrize("backend", list(TrainBackend))
def test_policy_classes_keep_the_policy_worker_contract(backend: TrainBackend) -> None:
    assert issubclass(policy_class(backend), interfaces.PolicyWorker)


@pytest.mark.parametrize("backend", sorted(ROLLOUT_BACKENDS))
def test_rollout_classes_keep_the_rollout_worker_contract(backend: str) -> None:
    assert issubclass(rollout_class(backend), interfaces.RolloutWorker)


def test_the_env_worker_keeps_its_contract() -> None:
    from grpo_launcher.train.workers import EnvWorker

    assert issubclass(EnvWorker, interfaces.EnvWorker)


def test_exit_codes_agree_with_the_job_script_and_the_driver() -> None:
    """ExitCode is the one list: the stop handler maps signals to it, the job script gets the numbers it tests
    rendered from it, and no module spells an exit number of its own."""
    import re

    from grpo_launcher.exit_codes import ExitCode
    from grpo_launcher.launch.sbatch import render
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.train import loop_state
    from helpers import ROOT

    assert set(loop_state.EXIT_CODES.values()) == {ExitCode.REQUEUE, ExitCode.TERMINATED, ExitCode.INTERRUPTED}
    spec = load_spec(["cluster=local_slurm", "dry_run=true"])
    values = render(spec, make_plan(spec)).splitlines()
    assert f"REQUEUE_CODE={ExitCode.REQUEUE:d}" in values and f"USR1_KILLED={ExitCode.USR1_KILLED:d}" in values
    own = re.compile(r"^\w*(REQUEUE|USR1_KILLED|EXIT)\w* = \d", re.M)
    assert [p.name for p in (ROOT / "src" / "grpo_launcher").rglob("*.py") if own.search(p.read_text())] == []


def test_metric_names_are_the_one_list() -> None:
    """Names spelled elsewhere (the skipped-step counter, checkpoint.metric's choices) are in tracking/metric_names."""
    from grpo_launcher.preflight.training import KNOWN_METRICS
    from grpo_launcher.tracking import metric_names

    assert set(KNOWN_METRICS) <= metric_names.METRICS
    assert metric_names.is_metric("time/rollout_s") and not metric_names.is_metric("val/reward_men")


@pytest.mark.parametrize("overrides", [
    [],
    ["cluster.cpu_workers_per_node=4", "train.global_batch_size=16", "grpo.num_prompts_per_step=8",
     "train.micro_batch_size=2", "train.logprob_batch_size=2"],
    ["cluster.cpu_workers_per_node=3", "cluster.rollout_devices=1", "grpo.async_grpo.enabled=true",
     "loss.importance_sampling_correction=true"],
])
def test_the_plan_is_the_one_source_of_batch_shape(overrides: list[str]) -> None:
    """The driver and the workers read the batch split from the Plan; rules check it with the same functions."""
    from grpo_launcher import plan as P
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.preflight.validate import validate

    spec = load_spec(overrides)
    assert validate(spec) == []
    plan = P.make_plan(spec)
    assert plan.rollouts_per_step == P.rollouts_per_step(spec) == plan.prompts_per_step * plan.group_size
    assert (plan.prompts_per_step, plan.group_size, plan.minibatch_size) == (
        spec.grpo.num_prompts_per_step, spec.grpo.num_generations_per_prompt, spec.train.global_batch_size)
    assert plan.optimizer_steps_per_rollout * plan.minibatch_size == plan.rollouts_per_step
    assert plan.dp_size == P.dp_size(spec) and plan.policy_ranks == plan.dp_size * P.train_model_parallel(spec)
    assert plan.policy_ranks == plan.world_size - plan.rollout_devices
