"""The time before step 1, and one line that says where it went.

The driver (train/driver.run) creates the workers first: they import torch/transformers and load the model
while the driver opens its MLflow run, records the launch and loads its tokenizer. The line, after step 1:

    grpo-launcher: start-up 27.0 s to the end of step 1 (imports 4.4, env 0.0, model 0.0, ray 6.2,
    workers started 0.1, mlflow 3.1, repro 0.5, tokenizer 3.0, workers ready 9.3, step 1 0.4)

Overlapping more in this process does not pay: importing torch, transformers and MLflow in a thread while
`ray.init` runs took as long in all and slowed `ray.init` (the cores are busy with Ray's own processes, and the
GIL serialises the rest). Figures: benchmarks/results/step_phases.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import psutil  # a Ray dependency


def process_start() -> float:
    return psutil.Process().create_time()


class StartupClock:
    """Where the time before step 1 went: one line in the log after the first step."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = self.last = t0 if t0 is not None else process_start()
        self.parts: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.parts.append((name, now - self.last))
        self.last = now

    def report(self) -> str:
        parts = ", ".join(f"{n} {s:.1f}" for n, s in self.parts)
        return f"grpo-launcher: start-up {self.last - self.t0:.1f} s to the end of step 1 ({parts})"


def quiet_libraries() -> None:
    """Third-party chatter off at its source (set before they are imported): transformers' and the Hub's
    progress/info output, MLflow's INFO lines (e.g. "Creating initial MLflow database tables"), raw colour codes
    in a log file."""
    for key, value in {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                       "MLFLOW_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not sys.stderr.isatty():  # workers' lines reach a log file: Ray's "(Worker pid=...)" prefix uncoloured
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
