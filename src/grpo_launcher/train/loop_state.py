"""What the loop carries across steps and restarts: step counter, tracker, checkpoints, data log, progress."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..plan import Plan
from ..spec.schema import RunSpec


@dataclass
class StopRequest:
    """SIGUSR1 (Slurm's warning before --time) → checkpoint and requeue; SIGTERM/SIGINT → checkpoint and stop."""

    requested: bool = False
    requeue: bool = False
    reason: str = ""

    @classmethod
    def install(cls) -> "StopRequest":
        req = cls()

        def handler(signum, _frame):
            req.requested, req.reason = True, signal.Signals(signum).name
            req.requeue = req.requeue or signum == signal.SIGUSR1

        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
        return req


@dataclass
class LoopState:
    spec: RunSpec
    plan: Plan
    ckpt: Any  # CheckpointManager
    tracker: Any  # Tracker or None
    step: int = 0  # last completed step
    checkpoint_path: Optional[Path] = None  # set when resuming
    data_log: Any = None
    started: float = field(default_factory=time.monotonic)
    last: dict = field(default_factory=dict)  # latest value of every metric (summary.json, sweeps)

    @classmethod
    def start(cls, spec: RunSpec, plan: Plan, ckpt) -> "LoopState":
        return cls(spec, plan, ckpt, _tracker(spec, plan, None), data_log=_data_log(spec, plan))

    @classmethod
    def resume(cls, spec: RunSpec, plan: Plan, ckpt, path: Path) -> "LoopState":
        meta = ckpt.load_meta(path)
        run_id = meta["state"].get("mlflow_run_id")
        print(f"grpo-launcher: resuming from {path.name} (step {meta['step']})", flush=True)
        return cls(spec, plan, ckpt, _tracker(spec, plan, run_id), step=meta["step"], checkpoint_path=path,
                   data_log=_data_log(spec, plan))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        self.last.update(metrics)
        if self.tracker is not None:
            self.tracker.log_metrics(step, metrics)
        if self.tracker is not None and not self.spec.checkpoint.enabled:
            self.tracker.commit()

    def train_data(self, step, prompts, gens, rewards, batch, tokenizer) -> None:
        if self.data_log is None or not self.data_log.enabled_for(step):
            return
        from ..tracking.records import train_data_records

        self.data_log.write_step(step, train_data_records(step, prompts, gens, rewards, batch, self.spec, tokenizer))

    def save_checkpoint(self, step: int, write: Callable[[Path], None], metrics: dict[str, float]) -> None:
        state = {"mlflow_run_id": self.tracker.run_id if self.tracker else None}
        self.ckpt.save(step, write, state, {k: v for k, v in metrics.items() if isinstance(v, float)})
        if self.tracker is not None:
            self.tracker.commit()  # MLflow's step axis only ever holds checkpointed steps: no repeats on resume

    def abort(self) -> None:
        if self.tracker is not None:
            self.tracker.discard()
            self.tracker.close("FAILED")

    def finish(self, status: str) -> None:
        import json

        from ..launch.rundir import write_atomic

        summary = {"status": status, "step": self.step, "metrics": self.last,
                   "mlflow_run_id": self.tracker.run_id if self.tracker else None}
        write_atomic(self.plan.run_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
        if self.tracker is not None:
            self.tracker.close(status)

    def progress_bar(self, max_steps: int) -> "Progress":
        return Progress(max_steps, self.step, enabled=self.spec.logging.progress)


def _tracker(spec: RunSpec, plan: Plan, run_id: Optional[str]):
    if not spec.logging.mlflow:
        return None
    import os

    from ..tracking import Tracker

    parent = os.environ.get("GRPO_PARENT_RUN_ID")  # set by the sweep launcher for child runs
    return Tracker(spec, plan.tracking_uri, plan.run_dir, run_id=run_id, parent_run_id=parent,
                   buffer_until_commit=spec.checkpoint.enabled)


def _data_log(spec: RunSpec, plan: Plan):
    if not spec.logging.train_data_log:
        return None
    from ..tracking import TrainDataLog

    return TrainDataLog(plan.run_dir / "train_data", spec.logging.train_data_log_every)


class Progress:
    """A live line per step: a tqdm bar on a terminal, one printed line per step in logs."""

    KEYS = (("reward", "train/reward_mean"), ("val", "val/reward_mean"), ("loss", "train/loss"),
            ("len", "train/gen_len_mean"), ("s", "time/step_s"))

    def __init__(self, total: int, initial: int, enabled: bool = True):
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self.bar = None
        self.total = total
        if enabled and self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="grpo", dynamic_ncols=True)

    def update(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        parts = {k: f"{m[key]:.3g}" for k, key in self.KEYS if key in m}
        if self.bar is not None:
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}/{self.total} " + " ".join(f"{k}={v}" for k, v in parts.items()), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
