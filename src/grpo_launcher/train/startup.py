"""The time before step 1, and one line that says where it went.

The driver (train/driver.run) creates the workers first: they import torch/transformers and load the model
while the driver opens its MLflow run and records the launch; then it waits for the policy workers, takes the
tokenizer from rank 0, joins the policy's process group, and waits for separate rollout engines last (they
start beside the policy's load). Each actor times its own start-up (`startup_marks`: process start -> its
__init__ -> each phase of it) and the line names the slowest actor's phases after its wait. After step 1:

    grpo-launcher: start-up 19.5 s to the end of step 1 (imports 1.9, env 0.0, model 0.0, ray 2.2,
    workers started 3.4, checkpoints 0.0, repro 0.1, policy ready 3.5 [from 5.0, imports 2.5, transformers 3.5,
    device 0.0, load 0.1, setup 0.0, engine 0.0], tokenizer 0.0, process group 0.0, engines ready 5.9 [from 7.5,
    imports 5.0, engine 4.6], step 1 2.3)

A bracket is the slowest actor's own account: when its process started (seconds into the start-up), then its
phases. Those are not parts of the driver's wait: the wait is what the actor took beyond what the driver did
meanwhile.

Overlapping more in this process does not pay: importing torch, transformers and MLflow in a thread while
`ray.init` runs took as long in all and slowed `ray.init` (the cores are busy with Ray's own processes, and the
GIL serialises the rest). What runs while the driver only waits (the tokenizer's imports, during the wait for the
policy: prefetch_tokenizer_imports) is off the critical path where the cores are many. Figures:
benchmarks/results/step_phases.md, benchmarks/results/startup.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time

from typing import TYPE_CHECKING, Any, Sequence

import psutil  # a Ray dependency

if TYPE_CHECKING:
    from .workers import Workers


def process_start() -> float:
    return psutil.Process().create_time()


class StartupClock:
    """Where the time before step 1 went: one line in the log after the first step."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = self.last = t0 if t0 is not None else process_start()
        self.parts: list[tuple[str, float, str]] = []  # (name, seconds, an actor's own phases)

    def mark(self, name: str, detail: str = "") -> None:
        """The time since the last mark, named; `detail` (an actor's own phases) follows it in brackets."""
        now = time.time()
        self.parts.append((name, now - self.last, detail))
        self.last = now

    def report(self, step: int = 1) -> str:
        """The line; `step`: this start's first step (a resumed run's is not step 1)."""
        parts = ", ".join(f"{n} {s:.1f}" + (f" [{d}]" if d else "") for n, s, d in self.parts)
        return f"grpo-launcher: start-up {self.last - self.t0:.1f} s to the end of step {step} ({parts})"


def actor_startup(actor: Any) -> dict:
    """Run inside an actor (Ray's `__ray_call__`), queued behind its __init__: when it became ready and how its
    start-up went. The actor's `startup_marks`, made in its __init__, are (phase, the time it ended) from its
    process's start: `imports` first (Ray's worker boot, then the imports that unpickling the actor's class pulls
    in), then its own phases. Without them: its __init__'s `startup_s` if it keeps one (the vLLM engine), else
    one `init` figure."""
    now, process = time.time(), process_start()
    marks = getattr(actor, "startup_marks", None)
    if marks:
        ends = [process] + [t for _, t in marks]
        parts = [(name, ends[i + 1] - ends[i]) for i, (name, _) in enumerate(marks)]
    elif isinstance(getattr(actor, "startup_s", None), float):
        parts = [("imports", max(now - actor.startup_s - process, 0.0)), ("engine", actor.startup_s)]
    else:
        parts = [("init", now - process)]
    return {"process": process, "ready": now, "parts": parts}


def describe(report: dict, t0: float) -> str:
    """`from a, imports b, load c, ...`: when the actor's process started (seconds into the start-up), then the
    actor's own phases."""
    return ", ".join([f"from {report['process'] - t0:.1f}"] + [f"{n} {s:.1f}" for n, s in report["parts"]])


class Readiness:
    """Every policy rank's and separate engine's start-up report, asked for as soon as they are created (each call
    waits in its actor's queue behind __init__); `wait` takes one group's within the deadlines (Workers.get)."""

    def __init__(self, workers: "Workers") -> None:
        separate = [r for r in workers.rollout if not any(r is p for p in workers.policy)]  # hybrid: none
        self.groups = {"policy": workers.policy, "engines": separate}
        self.refs = {g: [a.__ray_call__.remote(actor_startup) for a in actors] for g, actors in self.groups.items()}

    def wait(self, workers: "Workers", group: str, clock: StartupClock) -> None:
        """Wait for the group's actors (phase `<group>_start`); the clock marks `<group> ready` with the slowest's
        own phases."""
        actors: Sequence[Any] = self.groups[group]
        if not actors:
            return
        reports = workers.get(f"{group}_start", self.refs[group], actors)
        slowest = max(reports, key=lambda r: r["ready"])
        clock.mark(f"{group} ready", describe(slowest, clock.t0))


TOKENIZER_MODULES = ("transformers.tokenization_utils_tokenizers", "transformers.models")


def prefetch_tokenizer_imports() -> threading.Thread:
    """What unpickling the tokenizer from policy rank 0 imports in the driver (transformers' base and its tokenizers
    backend, ~1.3 s of CPU; never its auto classes), imported in a thread while the driver waits for the policy
    workers, its main thread idle in Ray's get. Join it before the tokenizer arrives."""
    def run() -> None:
        try:
            for name in TOKENIZER_MODULES:
                importlib.import_module(name)
        except ImportError:  # the tokenizer's own unpickling names what is missing
            pass

    thread = threading.Thread(target=run, name="grpo-tokenizer-imports", daemon=True)
    thread.start()
    return thread


def quiet_libraries() -> None:
    """Third-party chatter off at its source (set before they are imported): transformers' and the Hub's
    progress/info output, MLflow's INFO lines (e.g. "Creating initial MLflow database tables"), raw colour codes
    in a log file; and Triton's autotune choices kept on disk (below)."""
    for key, value in {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                       "MLFLOW_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    # Triton keeps each autotuned kernel's winning config on disk beside its compiled binaries: mamba-ssm's Mamba-2
    # kernels try ~200 configs on their first call (~300 s of a nemotron_h run's first update on an H100, 2026-12-06);
    # a later run, or the workers after the driver's warm start, reads the choice back (TRITON_CACHE_AUTOTUNING=0: off)
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not sys.stderr.isatty():  # workers' lines reach a log file: Ray's "(Worker pid=...)" prefix uncoloured
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
