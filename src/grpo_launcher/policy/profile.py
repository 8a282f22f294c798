"""logging.profile_step=N: one step of each policy worker under torch.profiler, summed by kernel class.

The driver arms the workers before step N and collects after it. While armed, every profiled phase
(generate, logprobs, update, refit) runs under its own profiler, so its time splits by phase first and by
kernel class second (GEMM, attention, softmax/loss, elementwise, ...): the table that says where an update
goes and what would speed it up. Each rank writes RUN_DIR/profile/step_N/rank_R.json and a Chrome trace
per phase (open in Perfetto or chrome://tracing).
"""

from __future__ import annotations

import functools
import json
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.autograd import DeviceType

# First match wins: attention before GEMM (flash kernels use tensor cores too), loss before reductions.
KERNEL_CLASSES: tuple[tuple[str, re.Pattern], ...] = tuple((k, re.compile(p, re.I)) for k, p in (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_scatter|broadcast"),
    ("attention", r"flash|fmha|attention|sdpa|attn"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|matmul|splitk|aten::(mm|addmm|bmm|baddbmm|linear)$"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("softmax/loss", r"softmax|cross_entropy|nll|logsumexp|vocab_parallel"),
    ("copy/cast", r"copy_kernel|CatArray|memcpy|memset|FillFunctor|aten::(to|_to_copy|copy_|cat|fill_)$"),
    ("reduction", r"reduce|reduction|aten::(sum|mean|norm|amax|max)$"),
    ("elementwise", r"elementwise|vectorized|unrolled|aten::(mul|add|sub|div|pow|rsqrt|silu|exp|neg|cat|where)"),
))


MAX_TRACE_EVENTS = 200_000


def top_kernels(times: list[tuple[str, float]], n: int = 12) -> list[tuple[str, str, float]]:
    """The n kernels (or CPU ops) with the most total time: (class, name cut to 120 chars, ms)."""
    total: dict[str, float] = {}
    for name, us in times:
        total[name] = total.get(name, 0.0) + us / 1e3
    top = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [(kernel_class(k), k[:120], round(v, 2)) for k, v in top]


def kernel_class(name: str) -> str:
    return next((k for k, pat in KERNEL_CLASSES if pat.search(name)), "other")


def by_class(times: Iterable[tuple[str, float]]) -> dict[str, float]:
    """(kernel name, microseconds) pairs → milliseconds per kernel class, largest first."""
    out: dict[str, float] = {}
    for name, us in times:
        k = kernel_class(name)
        out[k] = out.get(k, 0.0) + us / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def event_times(events: Iterable[Any], device: torch.device) -> list[tuple[str, float]]:
    """GPU: every kernel's duration. CPU: every op's self time (nested ops are not counted twice)."""
    if device.type == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU]


class PhaseProfiler:
    def __init__(self) -> None:
        self.armed: Path | None = None  # the directory this rank writes to while armed
        self.phases: dict[str, dict[str, Any]] = {}
        self.active = False  # a phase called inside another (update → logprobs) is part of the outer one

    @contextmanager
    def phase(self, name: str, device: torch.device) -> Iterator[None]:
        if self.armed is None or self.active:
            yield
            return
        self.active = True
        # GPU: kernels only (recording every CPU op of a 512-token generate costs minutes); CPU: the ops
        acts = [torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU]
        t0 = time.perf_counter()
        try:
            with torch.profiler.profile(activities=acts) as prof:
                yield
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        finally:
            self.active = False
        wall_ms = (time.perf_counter() - t0) * 1e3
        times = event_times(prof.events(), device)
        classes = by_class(times)
        key = name if name not in self.phases else f"{name}_{len(self.phases)}"
        self.phases[key] = {"wall_ms": round(wall_ms, 2), "busy_ms": round(sum(classes.values()), 2),
                            "classes_ms": {k: round(v, 2) for k, v in classes.items()}, "top": top_kernels(times)}
        if len(times) <= MAX_TRACE_EVENTS:  # a decode loop's trace runs to millions of events: table only
            prof.export_chrome_trace(str(self.armed / f"{self.armed.name}_{key}.trace.json"))


def profiled(phase: str) -> Callable:
    """Method decorator for policy workers (they have `device`): the phase is profiled while armed."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.profiler.phase(phase, self.device):
                return fn(self, *args, **kwargs)
        return inner
    return wrap


class Profiling:
    """Mixed into the policy workers: the driver's two calls around the profiled step."""
    profiler: PhaseProfiler = PhaseProfiler()  # replaced per instance on arming
    rank: int  # the worker's (annotation only: set by the worker's __init__)

    def start_profile(self, directory: str) -> None:
        path = Path(directory) / f"rank_{self.rank}"
        path.mkdir(parents=True, exist_ok=True)
        self.profiler = PhaseProfiler()
        self.profiler.armed = path

    def stop_profile(self) -> dict[str, Any]:
        """This rank's phases (wall, kernel-busy and per-class ms); also written to rank_R/rank_R.json."""
        prof, self.profiler = self.profiler, PhaseProfiler()
        if prof.armed is None:
            return {}
        (prof.armed / f"{prof.armed.name}.json").write_text(json.dumps(prof.phases, indent=1))
        return prof.phases


def summary_line(phases: dict[str, dict[str, Any]]) -> str:
    """'update 3180 ms (busy 96%): gemm 58%, attention 14%, ...' for each phase."""
    parts = []
    for name, p in phases.items():
        busy = p["busy_ms"] or 1e-9
        top = ", ".join(f"{k} {100 * v / busy:.0f}%" for k, v in list(p["classes_ms"].items())[:5])
        parts.append(f"{name} {p['wall_ms']:.0f} ms (busy {100 * p['busy_ms'] / max(p['wall_ms'], 1e-9):.0f}%): {top}")
    return "; ".join(parts)
