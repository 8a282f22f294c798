"""Every derived default and fill-in of the RunSpec, once, in this order, before validation.

    1. async placement   grpo.async_grpo.enabled alone: devices of their own for the engines   here
    2. model facts       model.path's config.json → model.* (architecture, name)                spec/model_dir.py
    3. prompt budget     env.max_prompt_tokens=0 → the data's longest prompt                    envs/preflight.py
  and, for a launch (pre-flight: what this launch fixes for its job, from this shell, cwd and moment):
    4. tracking store    MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME → logging.*               spec/mlflow_env.py
    5. job's view        cluster=slurm: output_root absolute (the job's cwd is not ours)        here
    6. HTTP API key      rollout.expose_http_server, http_api_key null → a fresh key            secrets.py

What comes out is what the rules judge, what spec.yaml holds and what the driver and every worker receive: after
pre-flight (launch/preflight.py) nothing rewrites the spec. A value only a worker can know (its own devices) is
derived there, beside the spec, never into it (policy/megatron_policy.py: the MoE dispatcher on CPU).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from ..envs.preflight import resolve_prompt_budget
from ..plan import world_size
from ..secrets import with_http_api_key
from .errors import Violation
from .mlflow_env import with_mlflow_env
from .model_dir import resolve_model
from .schema import ClusterKind, RunSpec

Fill = Callable[[RunSpec, frozenset[str]], tuple[RunSpec, list[Violation]]]


class Step(NamedTuple):
    name: str
    fill: Fill
    launch_only: bool = False  # this launch's value (its shell's variables, its cwd, a secret drawn now)


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


def absolute_output_root(spec: RunSpec) -> RunSpec:
    """cluster=slurm: the job reads output_root from spec.yaml in a cwd that is not ours, so it is made absolute."""
    if spec.cluster.kind != ClusterKind.slurm:
        return spec
    return dataclasses.replace(spec, output_root=str(Path(spec.output_root).resolve()))


def _plain(fn: Callable[[RunSpec], RunSpec]) -> Fill:
    return lambda spec, keys: (fn(spec), [])


STEPS: tuple[Step, ...] = (
    Step("async placement", lambda spec, keys: (async_placement(spec, keys), [])),
    Step("model facts", resolve_model),
    Step("prompt budget", lambda spec, keys: resolve_prompt_budget(spec)),
    Step("tracking store", lambda spec, keys: (with_mlflow_env(spec, keys), []), launch_only=True),
    Step("job's view", _plain(absolute_output_root), launch_only=True),
    Step("HTTP API key", _plain(with_http_api_key), launch_only=True),
)


def resolve(spec: RunSpec, cli_keys: Iterable[str] = (), launch: bool = False) -> tuple[RunSpec, list[Violation]]:
    """The spec with every step of STEPS applied in order, and the problems the steps found (model.path's
    config.json unreadable, a data set without a longest prompt ...). `launch`: pre-flight of a launch, which also
    fixes the launch's own values (steps 4-6); load_spec (a config read for a test, eval, a probe) stops at 3."""
    keys, problems = frozenset(cli_keys), []
    for step in STEPS:
        if step.launch_only and not launch:
            continue
        spec, found = step.fill(spec, keys)
        problems += found
    return spec, problems

