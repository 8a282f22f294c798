"""The cluster: Ray's object store, cluster=local on this machine, and an existing Ray cluster (cluster=ray)."""

from __future__ import annotations

import os
import socket
from typing import Iterator

from ..spec.errors import Violation
from ..spec.schema import ClusterKind, RunSpec
from .registry import V, rule

RAY_MIN_OBJECT_STORE_MB = 75  # Ray refuses an object store below 75 MiB (ray._private.ray_constants)


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
    try:
        socket.create_connection(where, timeout=5).close()
    except OSError as exc:
        yield V("ray_cluster_reachable", "cluster.ray_address", f"no Ray cluster answers at {address}: {exc}",
                RAY_ADDRESS_FIX)
