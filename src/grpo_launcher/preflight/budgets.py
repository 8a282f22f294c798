"""Budgets: GPU memory per GPU (the memory model), disk for the run's checkpoints, the engines' health deadlines."""

from __future__ import annotations

from typing import Iterator

from ..spec.errors import Violation
from ..spec.schema import RunSpec
from .disk import room_violations
from .memory_report import violations as memory_violations
from .registry import V, rule


@rule("pure")
def gpu_memory_fits(s: RunSpec) -> Iterator[Violation]:
    """The memory pre-flight: the plan's peak per GPU against cluster.gpu_memory_gib (null: skipped)."""
    yield from memory_violations(s)


@rule("probe")
def checkpoint_disk_room(s: RunSpec) -> Iterator[Violation]:
    """output_root holds the run's checkpoints at their peak: kept + one being written (preflight/disk.py)."""
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
