"""The Plan: everything cluster- and batch-shaped, derived once from a validated RunSpec.

The sbatch header, the Ray bring-up, the placement groups, the worker counts, the workers' engine context
and the driver's batch split (prompts, groups, minibatches, row shards) all read this; nothing else
recomputes world sizes, engine counts or batch shapes. The functions below take a spec that may not be
valid yet: the rules (preflight/) check the shapes with them before a Plan is made.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .logit_heads import head_for
from .secrets import redact_value
from .spec.schema import ClusterKind, RolloutBackend, RunSpec
from .stop_tokens import describe as describe_stop_tokens

# Fixed Ray port block, offsets from cluster.ray_port (documented in README "Ports").
PORT_OFFSETS = {
    "gcs": 0,
    "client": 1,
    "dashboard": 2,
    "node_manager": 3,
    "object_manager": 4,
    "runtime_env_agent": 5,
    "metrics_export": 6,
    "dashboard_agent_grpc": 7,
    "dashboard_agent_http": 8,
    "min_worker": 100,
    "max_worker": 199,
}


def devices_per_node(spec: RunSpec) -> int:
    """GPUs per node, or CPU worker slots per node on CPU-only runs."""
    c = spec.cluster
    return c.gpus_per_node if c.gpus_per_node > 0 else c.cpu_workers_per_node


def cpus_per_slot(spec: RunSpec) -> float:
    """A CPU worker slot's cores: cluster.cpus_per_worker, or (0, cluster=local) this machine's cores shared out."""
    c = spec.cluster
    if c.cpus_per_worker > 0:
        return c.cpus_per_worker
    return float(max(1, len(os.sched_getaffinity(0)) // max(c.cpu_workers_per_node, 1)))


def world_size(spec: RunSpec) -> int:
    return spec.cluster.nodes * devices_per_node(spec)


def rollout_devices(spec: RunSpec) -> int:
    """Devices the rollout engines have to themselves (cluster.rollout_devices); 0 = colocated with the policy."""
    return spec.cluster.rollout_devices


def train_devices(spec: RunSpec) -> int:
    """Devices the policy workers run on: all of them, less the separate rollout devices."""
    return world_size(spec) - rollout_devices(spec)


def engine_devices(spec: RunSpec) -> int:
    """Devices the engines run on: their own (non-colocated), else the policy's."""
    return rollout_devices(spec) or world_size(spec)


def train_model_parallel(spec: RunSpec) -> int:
    t = spec.train
    return t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size


def rollout_model_parallel(spec: RunSpec) -> int:
    return spec.rollout.tensor_parallel_size * spec.rollout.pipeline_parallel_size


def dp_size(spec: RunSpec) -> int:
    """The policy's data-parallel size: its devices over TP·PP·CP (exact once the spec is valid)."""
    return train_devices(spec) // train_model_parallel(spec)


def rollouts_per_step(spec: RunSpec) -> int:
    """Samples one step generates and trains on: prompts × generations per prompt (each group contiguous)."""
    return spec.grpo.num_prompts_per_step * spec.grpo.num_generations_per_prompt


def engine_sleeps(spec: RunSpec) -> bool:
    """rollout.sleep_mode=true: vLLM engines that share their GPUs with the policy sleep at level 2 (weights and
    KV cache freed: the refit rewrites every weight anyway) while the logprob and update phases run.
    preflight/engines.py refuses it elsewhere (CPU engines have no sleep mode; engines on devices of their own free
    nothing useful)."""
    return (spec.rollout.sleep_mode and spec.rollout.backend == RolloutBackend.vllm
            and spec.cluster.gpus_per_node > 0 and not rollout_devices(spec))


def engine_max_model_len(spec: RunSpec) -> int:
    """rollout.max_model_len, or (null) the prompt budget plus the generation budget."""
    return spec.rollout.max_model_len or spec.env.max_prompt_tokens + spec.rollout.max_new_tokens


def parse_duration(text: str) -> int:
    """Slurm time formats → seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise ValueError(f"not a Slurm duration: {text!r}")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = a, b or 0, c or 0
    elif c is not None:  # HH:MM:SS
        h, mi, s = a, b, c
    else:  # MM or MM:SS
        h, mi, s = 0, a, b or 0
    bounded = [("seconds", s, 60)] + ([("minutes", mi, 60)] if b is not None else []) \
        + ([("hours", h, 24)] if days is not None else [])
    for what, value, top in bounded:  # a field after another one: 99:99:99 is a slip, not 4-04:41:39
        if int(value) >= top:
            raise ValueError(f"{text!r}: {what} {int(value)} ≥ {top}")
    return int(days or 0) * 86400 + int(h) * 3600 + int(mi) * 60 + int(s)


@dataclass(frozen=True)
class Plan:
    nodes: int
    devices_per_node: int
    use_gpus: bool
    world_size: int  # every device of the job (policy + separate rollout devices)
    dp_size: int  # policy data-parallel size = train_devices / (TP·PP·CP)
    rollout_engines: int  # = engine devices / (rollout TP·PP): the policy's (colocated) or their own
    rollouts_per_step: int  # prompts × generations
    prompts_per_step: int  # grpo.num_prompts_per_step
    group_size: int  # grpo.num_generations_per_prompt: one prompt's samples, contiguous in every batch
    minibatch_size: int  # train.global_batch_size: the rows of one optimizer step, over all policy ranks
    optimizer_steps_per_rollout: int  # minibatches per step = rollouts_per_step / minibatch_size
    hybrid_rollout: bool  # rollout=hf: the policy workers generate themselves (no rollout actors, no transfer)
    # exactly on-policy (one optimizer step per rollout, no IS correction): the update's own forward gives the
    # old logprobs (detached) instead of a separate logprob pass
    logprobs_from_update: bool
    max_model_len: int
    bundle: dict[str, float]  # resources of one placement-group bundle (one per device)
    ports: dict[str, int]
    run_dir: Path
    checkpoint_dir: Path
    tracking_uri: str
    # policy ranks on bundles [0, train_devices); separate engines (rollout_devices > 0) on the bundles after them
    train_devices: int = 0
    rollout_devices: int = 0  # 0 = colocated: engine e shares bundle e·TP with the policy
    async_grpo: bool = False  # grpo.async_grpo.enabled: generation overlaps the update (train/async_loop.py)
    max_trajectory_age: int = 0  # grpo.async_grpo.max_trajectory_age_steps (async only)
    engine_sleeps: bool = False  # rollout.sleep_mode resolved: the engines sleep through logprobs + update
    logprob_head: str = ""  # the policy's logprob head for this family (logit_heads.head_for: what the worker builds)
    model_path: Optional[str] = None  # model.path: the summary prints the stop tokens the engines read from it
    mlflow: bool = True  # logging.mlflow: the summary names the tracking store only when runs go to it
    compute: str = "fp32"  # train.precision as the workers apply it (bf16 is a GPU setting)
    local_cores: int = 0  # a CPU run on cluster=local: this machine's cores (the summary says when slots ask for more)

    @property
    def policy_ranks(self) -> int:
        """Policy workers, one per training device (DP × TP·PP·CP): the driver shards every batch's rows over
        all of them (model-parallel ranks gather theirs)."""
        return self.train_devices or self.world_size

    @property
    def engine_bundle0(self) -> int:
        """The first bundle of the engines: after the policy's when they have devices of their own."""
        return self.train_devices if self.rollout_devices else 0

    def oversubscribed(self) -> str:
        """A local CPU run whose slots ask for more cores than the machine has: said, as the run still goes."""
        asked = self.bundle.get("CPU", 0.0) * self.world_size
        if not self.local_cores or asked <= self.local_cores:
            return ""
        return (f" (warning: {asked:g} cores asked, this machine has {self.local_cores}: the workers' threads share "
                "them, each step slower; lower cluster.cpus_per_worker)")

    def summary(self) -> str:
        kind = "GPU" if self.use_gpus else "CPU slot"
        return "\n".join(
            [
                f"nodes × {kind}s/node : {self.nodes} × {self.devices_per_node} = {self.world_size}",
                f"policy DP size       : {self.dp_size}",
                f"rollout engines      : {self.rollout_engines}",
                f"rollouts per step    : {self.rollouts_per_step} "
                f"({self.optimizer_steps_per_rollout} optimizer step(s))",
                f"rollout engine       : {'hybrid (in the policy workers)' if self.hybrid_rollout else 'separate workers'}",
                "placement            : " + (f"separate: {self.train_devices} policy + {self.rollout_devices} rollout "
                                              f"device(s)" if self.rollout_devices else "colocated")
                + ("; engines sleep through logprobs + update (vLLM sleep level 2)" if self.engine_sleeps else ""),
                "loop                 : " + (f"async (max trajectory age {self.max_trajectory_age} step(s))"
                                              if self.async_grpo else "sync"),
                f"old logprobs         : {'from the update forward (on-policy)' if self.logprobs_from_update else 'separate pass'}",
                f"logprob head         : {self.logprob_head}",
                f"compute              : {self.compute}",
                f"max model len        : {self.max_model_len}",
                f"stop tokens          : {describe_stop_tokens(self.model_path)}",
                f"Ray bundle / device  : {self.bundle}{self.oversubscribed()}",
                f"run dir              : {self.run_dir}",
                "tracking             : " + (redact_value(self.tracking_uri) if self.mlflow  # a password: ***
                                              else "MLflow off (logging.mlflow=false)"),
            ]
        )


def make_plan(spec: RunSpec) -> Plan:
    """Derive the plan. Call only on a spec that passed `validate` (divisions are exact then)."""
    world, train, separate = world_size(spec), train_devices(spec), rollout_devices(spec)
    use_gpus = spec.cluster.gpus_per_node > 0
    rollouts = rollouts_per_step(spec)
    root = Path(spec.output_root).resolve()
    run_dir = root / spec.name
    bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpus else {"CPU": cpus_per_slot(spec)}
    tracking = spec.logging.tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
    a = spec.grpo.async_grpo
    return Plan(
        nodes=spec.cluster.nodes,
        devices_per_node=devices_per_node(spec),
        use_gpus=use_gpus,
        world_size=world,
        dp_size=dp_size(spec),
        rollout_engines=engine_devices(spec) // rollout_model_parallel(spec),
        rollouts_per_step=rollouts,
        prompts_per_step=spec.grpo.num_prompts_per_step,
        group_size=spec.grpo.num_generations_per_prompt,
        minibatch_size=spec.train.global_batch_size,
        optimizer_steps_per_rollout=rollouts // spec.train.global_batch_size,
        hybrid_rollout=spec.rollout.backend == RolloutBackend.hf and not separate,
        logprobs_from_update=(rollouts == spec.train.global_batch_size and not a.enabled  # async: off-policy
                              and not spec.loss.importance_sampling_correction),
        max_model_len=engine_max_model_len(spec),
        bundle=bundle,
        ports={k: spec.cluster.ray_port + v for k, v in PORT_OFFSETS.items()},
        run_dir=run_dir,
        checkpoint_dir=run_dir / "checkpoints",
        tracking_uri=tracking,
        train_devices=train,
        rollout_devices=separate,
        async_grpo=a.enabled,
        max_trajectory_age=a.max_trajectory_age_steps if a.enabled else 0,
        engine_sleeps=engine_sleeps(spec),
        model_path=spec.model.path,
        mlflow=spec.logging.mlflow,
        logprob_head=head_for(spec.model.path, spec.model.family, spec.train.logprob_chunk_tokens).why,
        compute=compute_line(spec, use_gpus),
        local_cores=len(os.sched_getaffinity(0)) if spec.cluster.kind == ClusterKind.local and not use_gpus else 0,
    )


def compute_line(spec: RunSpec, use_gpus: bool) -> str:
    """train.precision as the workers apply it: bf16 compute over fp32 master weights on GPUs; a CPU run computes
    in fp32 whatever it says (both backends), which the plan says rather than the run ignoring it silently."""
    if spec.train.precision.value != "bfloat16":
        return "fp32"
    if use_gpus:
        return "bf16 compute, fp32 master weights (train.precision=bfloat16)"
    return "fp32 (train.precision=bfloat16 applies on GPUs: a CPU run computes in fp32)"
