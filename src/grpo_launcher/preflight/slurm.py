"""A Slurm job: its fields, the values that reach the job's shell, its Ray ports, and its --time against the save
signal and checkpoint.must_save_by."""

from __future__ import annotations

import re
from typing import Iterator

from ..plan import parse_duration
from ..spec.errors import Violation
from ..spec.schema import ClusterKind, RunSpec
from .registry import V, rule

SAFE_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:+=@%/-]+")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHECKPOINT_MARGIN_S = 300  # time a checkpoint write may take before Slurm's --time ends the job


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


# Ray's temp dir, at most (characters): session_<time>_<pid>/sockets/plasma_store under it stays below AF_UNIX's 107
RAY_TEMP_DIR_MAX = 40


@rule("pure")
def ray_temp_dir_short(s: RunSpec) -> Iterator[Violation]:
    d = s.cluster.ray_temp_dir
    if len(d) > RAY_TEMP_DIR_MAX or not d.startswith("/"):
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


NO_LIMIT = ("UNLIMITED", "INFINITE")  # Slurm's words for no time limit (cluster.time)


@rule("pure")
def time_budget(s: RunSpec) -> Iterator[Violation]:
    c = s.cluster
    try:  # Slurm's UNLIMITED / INFINITE / 0: no time limit (the partition's own may still apply)
        limit = None if c.time.strip().upper() in NO_LIMIT else parse_duration(c.time) or None
    except ValueError as exc:
        yield V("time_budget", "cluster.time", str(exc), "use [D-]HH:MM:SS (or UNLIMITED), e.g. cluster.time=04:00:00")
        return
    if c.kind == ClusterKind.slurm and limit is not None and c.signal_before_s >= limit:
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
    if c.kind == ClusterKind.slurm and limit is not None and save_by + CHECKPOINT_MARGIN_S > limit:
        yield V("time_budget", ("checkpoint.must_save_by", "cluster.time"),
                f"save by {save_by}s + {CHECKPOINT_MARGIN_S}s write margin = {save_by + CHECKPOINT_MARGIN_S}s "
                f"> the job's --time {limit}s: Slurm kills the job before the checkpoint lands",
                f"set checkpoint.must_save_by ≤ {limit - CHECKPOINT_MARGIN_S}s before cluster.time")
