"""What the loop carries across steps and restarts: step counter, tracker, checkpoints, data log, progress."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tqdm import tqdm

from ..checkpoint.manager import fault_point, has_optimizer, record_spec_changes
from ..exit_codes import ExitCode
from ..plan import Plan
from ..runfiles import own_mlflow_run, record_mlflow_run, write_atomic
from ..spec.schema import RunSpec
from ..tracking import TrainDataLog
from ..tracking import metric_names as M
from ..tracking.trackers import Trackers, step_logs


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
EXIT_CODES: dict[int, ExitCode] = {signal.SIGUSR1: ExitCode.REQUEUE, signal.SIGTERM: ExitCode.TERMINATED,
                                   signal.SIGINT: ExitCode.INTERRUPTED}


@dataclass
class StopRequest:
    """One signal path for every stop: SIGUSR1 (Slurm's warning before --time, or a preemption notice) →
    finish the step, checkpoint, exit 3 (requeue me); SIGTERM (scancel, preemption, requeue, kill) and SIGINT
    (Ctrl-C) → finish the step, checkpoint, exit 143 / 130 (the sbatch script asks Slurm whether the job is
    being requeued). A second signal abandons the step at once (SystemExit with the same code: the last
    checkpoint stands); so does the first one when the step has not finished `grace_s` later (deadlines.stop_grace_s,
    a SIGALRM timer; `step_done()` disarms it before the checkpoint is written). `install()` runs first thing; `reinstall()` right after `ray.init()`, which replaces
    the SIGTERM handler with its own (that one exits without saving)."""

    requested: bool = False
    requeue: bool = False
    reason: str = ""
    signum: int = 0
    count: int = 0
    grace_s: float | None = None  # the first signal waits this long for the step (None: for ever)
    saves: bool = True  # checkpoint.enabled: the step's checkpoint is written before the exit

    @classmethod
    def install(cls, grace_s: float | None = None, pending: Sequence[int] = (), saves: bool = True) -> "StopRequest":
        """Takes the stop signals; the first of `pending` (signals held before, launch/local.py) is a stop now."""
        req = cls(grace_s=grace_s, saves=saves)
        req.reinstall()
        if pending:
            req.handler(pending[0], None)
        return req

    def handler(self, signum: int, _frame: object) -> None:
        self.count += 1
        self.requested, self.reason = True, signal.Signals(signum).name
        self.requeue = self.requeue or signum == signal.SIGUSR1
        self.signum = self.signum or signum
        if self.count == 1:
            bound = f" (at most deadlines.stop_grace_s={self.grace_s:g} s)" if self.grace_s else ""
            then = "checkpoint and exit" if self.saves else "exit (checkpoint.enabled=false: no checkpoint)"
            print(f"grpo-launcher: {self.reason}: finishing the current step{bound}, then {then} "
                  f"(a second signal abandons the step)", file=sys.stderr, flush=True)
            if self.grace_s:
                signal.signal(signal.SIGALRM, self.overdue)
                signal.setitimer(signal.ITIMER_REAL, self.grace_s)
        else:
            print(f"grpo-launcher: {self.reason} again: abandoning the step; resume starts from the last checkpoint",
                  file=sys.stderr, flush=True)
            raise SystemExit(self.exit_code)

    def overdue(self, _signum: int, _frame: object) -> None:
        """SIGALRM: the step did not finish within grace_s of the first signal: abandon it as a second signal does."""
        print(f"grpo-launcher: {self.reason}: the step did not finish within deadlines.stop_grace_s={self.grace_s:g} s; "
              "abandoning it; resume starts from the last checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(self.exit_code)

    def step_done(self) -> None:
        """The step finished after a stop request: no abandoning it now (the checkpoint has its own deadline)."""
        if self.grace_s:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def reinstall(self) -> None:
        """(Re)take SIGUSR1/SIGTERM/SIGINT: call after anything that installs its own handlers (ray.init)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handler)

    def installed(self) -> bool:
        return all(signal.getsignal(sig) == self.handler for sig in STOP_SIGNALS)

    @property
    def exit_code(self) -> int:
        """3 (requeue) after SIGUSR1, else 128 + the first signal (143 SIGTERM, 130 SIGINT)."""
        if self.requeue:
            return ExitCode.REQUEUE
        return EXIT_CODES.get(self.signum, ExitCode.INTERRUPTED) if self.signum else ExitCode.INTERRUPTED


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
    gpu_peak: Any = None  # tracking/gpu_memory.GpuPeak: the measured whole-GPU peak, reported at the end
    mlflow_run_id: Optional[str] = None  # the resumed checkpoint's: kept in the next ones while logging.mlflow=false
    data_origin: tuple[int, int] = (0, 0)  # (a step, the prompts drawn through it): envs/base.py first_position

    def prompts_drawn(self, step: int) -> int:
        """Prompts the run's steps 1..step drew from its data (round 0), with this launch's per-step count."""
        s0, c0 = self.data_origin
        return c0 + (step - s0) * self.plan.prompts_per_step

    @classmethod
    def start(cls, spec: RunSpec, plan: Plan, ckpt) -> "LoopState":
        return cls(spec, plan, ckpt, _tracker(spec, plan, None), data_log=_data_log(spec, plan))

    @classmethod
    def resume(cls, spec: RunSpec, plan: Plan, ckpt, path: Path) -> "LoopState":
        meta = ckpt.load_meta(path)
        # the run dir's own record first: a copy's checkpoints name the original's run until the copy saves one
        run_id = own_mlflow_run(plan.run_dir, spec.name) or meta["state"].get("mlflow_run_id")
        print(f"grpo-launcher: resuming from {path.name} (step {meta['step']})", flush=True)
        fresh = not has_optimizer(path) or distributed_optimizer_unsaved(spec)
        if fresh:
            print(fresh_optimizer_line(spec, path), flush=True)
        # whatever MLflow holds past the checkpoint is of a trajectory this resume leaves: steps a start with
        # checkpoint.enabled=false committed, or those of a newer checkpoint that could not be used
        tracker = _tracker(spec, plan, run_id, diverges_after=int(meta["step"]))
        changes = record_spec_changes(plan.run_dir, meta, spec)  # keys changed on relaunch: file, message, MLflow
        if tracker is not None and changes:
            tracker.log_spec_changes(int(meta["step"]) + 1, changes)
        if tracker is not None and meta.get("pending_metrics"):
            # the checkpoint became visible but the process died before its MLflow commit: replay it
            sent = tracker.replay(meta["pending_metrics"])
            if sent:
                print(f"grpo-launcher: replayed {sent} metric value(s) of {path.name} that never reached MLflow",
                      flush=True)
        step = int(meta["step"])  # before prompts_drawn was saved: the checkpoint's own count per step, throughout
        drawn = meta["state"].get("prompts_drawn", step * int(meta["spec"]["grpo"]["num_prompts_per_step"]))
        return cls(spec, plan, ckpt, tracker, step=meta["step"], checkpoint_path=path,
                   data_log=_data_log(spec, plan), mlflow_run_id=run_id, data_origin=(step, int(drawn)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        if self.gpu_peak is not None and step > 0:  # memory/gpu_step_peak_gib; a growing peak is warned once
            self.gpu_peak.step_done(step, metrics)
        self.last.update(metrics)
        if self.tracker is not None:
            self.tracker.log_metrics(step, metrics)
        if self.tracker is not None and not self.spec.checkpoint.enabled:
            self.tracker.commit()

    def train_data(self, step, prompts, gens, rewards, batch, tokenizer, versions, scored=()) -> None:
        """`versions`: (first, last) policy version per sample (the records' policy_version, policy_version_last)."""
        if self.data_log is None or not self.data_log.enabled_for(step):
            return
        from ..tracking.records import train_data_records  # here: it imports torch (train/setup.py imports us)

        self.data_log.write_step(step, train_data_records(step, prompts, gens, rewards, batch, self.spec, tokenizer,
                                                          self.plan.group_size, scored), versions)

    def save_checkpoint(self, step: int, write: Callable[[Path], None], metrics: dict[str, float]) -> None:
        """Metrics are durable before the checkpoint is visible: they go into its meta.json (pending), the
        checkpoint is renamed into place, then they are committed to MLflow (a crash in between: replayed
        on resume). MLflow's step axis only ever holds checkpointed steps: no repeats, no gaps."""
        # a start with logging.mlflow=false keeps the run's MLflow run: switched on again, it continues there
        state = {"mlflow_run_id": self.tracker.run_id if self.tracker else self.mlflow_run_id,
                 "prompts_drawn": self.prompts_drawn(step)}  # where a resume's data carries on
        pending = self.tracker.pending() if self.tracker is not None else []
        self.ckpt.save(step, write, state, {k: v for k, v in metrics.items() if isinstance(v, float)},
                       pending_metrics=pending)
        if self.tracker is not None:
            self.tracker.commit()
        fault_point(f"after:commit@{step}")

    def abort(self) -> None:
        if self.tracker is not None:
            self.tracker.discard()
            self.tracker.close("FAILED")

    def finish(self, status: str) -> None:
        summary = {"status": status, "step": self.step, "metrics": self.last,
                   "mlflow_run_id": self.tracker.run_id if self.tracker else None}
        gpu = self.gpu_peak.report() if self.gpu_peak is not None else {}
        if gpu:  # measured whole-GPU peak vs the memory pre-flight (tracking/gpu_memory.py)
            summary["gpu_memory"] = gpu
            for k, v in gpu.items():
                if self.tracker is not None and hasattr(self.tracker, "set_tag"):
                    self.tracker.set_tag(f"grpo.{k}", v)
        write_atomic(self.plan.run_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
        if self.tracker is not None:
            self.tracker.close(status)

    def progress_bar(self, max_steps: int) -> "Progress":
        return Progress(max_steps, self.step, enabled=self.spec.logging.progress, groups=self.plan.prompts_per_step)


def distributed_optimizer_unsaved(spec: RunSpec) -> bool:
    """Megatron's distributed optimizer: its sharded state is not in the checkpoint (policy/megatron_policy.py
    save; preflight/disk.py counts none), so every resume of such a run starts a fresh optimizer."""
    return spec.train.backend.value == "megatron" and spec.train.distributed_optimizer


def fresh_optimizer_line(spec: RunSpec, path: Path) -> str:
    """What a resume from a checkpoint without optimizer state does (checkpoint/manager.py: only the newest
    checkpoint keeps it; an older one is resumed when the newest fails verification, or was moved away)."""
    t = spec.train
    master = ", fp32 master weights from the saved weights" if t.backend.value == "megatron" else ""
    why = ("train.distributed_optimizer=true: megatron's sharded optimizer state is not saved" if
           distributed_optimizer_unsaved(spec) else "only the newest checkpoint keeps it")
    return (f"grpo-launcher: {path.name} holds the weights but no optimizer state ({why}): training continues with a fresh optimizer (AdamW moments zero{master}; the lr warm-up, "
            f"train.warmup_steps={t.warmup_steps}, starts over)")


def _tracker(spec: RunSpec, plan: Plan, run_id: Optional[str], diverges_after: Optional[int] = None):
    tracker = _mlflow(spec, plan, run_id, diverges_after)
    if not (spec.logging.tensorboard or spec.logging.wandb):
        return tracker
    return Trackers(tracker, step_logs(spec, plan.run_dir))


def _mlflow(spec: RunSpec, plan: Plan, run_id: Optional[str], diverges_after: Optional[int] = None):
    if not spec.logging.mlflow:
        return None
    from ..tracking import Tracker  # here: mlflow's import, for logging.mlflow runs only

    parent = os.environ.get("GRPO_PARENT_RUN_ID")  # set by the sweep launcher for child runs
    tracker = Tracker(spec, plan.tracking_uri, plan.run_dir, run_id=run_id, parent_run_id=parent,
                      buffer_until_commit=spec.checkpoint.enabled, diverges_after=diverges_after)
    record_mlflow_run(plan.run_dir, tracker.run_id, spec.name)  # before any step: a crash from here on reopens it
    return tracker


def _data_log(spec: RunSpec, plan: Plan):
    if not spec.logging.train_data_log:
        return None
    return TrainDataLog(plan.run_dir / "train_data", spec.logging.train_data_log_every)


class Progress:
    """A live line per step: a tqdm bar on a terminal, one printed line per step in logs."""

    # what a user reads (no loss: GRPO's is ~0 by construction, the advantages are centred)
    KEYS = (("reward", M.TRAIN_REWARD_MEAN), ("val", M.VAL_REWARD_MEAN),
            ("len", M.TRAIN_GEN_LEN_MEAN), ("kl", M.TRAIN_KL), ("clip", M.TRAIN_CLIP_FRACTION),
            ("tok/s", M.TRAIN_TOKENS_PER_S), ("s", M.TIME_STEP_S))

    def __init__(self, total: int, initial: int, enabled: bool = True, groups: int = 0):
        self.enabled, self.tty, self.groups = enabled, sys.stderr.isatty(), groups
        self.bar = None
        self.total, self.initial, self.t0 = total, initial, time.monotonic()
        if enabled and self.tty:
            self.bar = tqdm(total=total, initial=initial, desc="grpo", dynamic_ncols=True)

    def update(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        parts = {k: f"{m[key]:.3g}" for k, key in self.KEYS if key in m}
        note = no_update_note(m, self.groups)
        if self.bar is not None:
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(1)
            if note:
                self.bar.write(f"step {step}: {note}")
        else:
            words = [f"step {step}/{self.total}", *(f"{k}={v}" for k, v in parts.items()), self.timing(step)]
            print(" ".join(words) + (f" ({note})" if note else ""), flush=True)

    def timing(self, step: int) -> str:
        """'elapsed H:MM:SS eta H:MM:SS': this process's time so far, and the rest at its mean step time."""
        elapsed = time.monotonic() - self.t0
        eta = elapsed / max(step - self.initial, 1) * max(self.total - step, 0)
        clock = [str(datetime.timedelta(seconds=round(t))) for t in (elapsed, eta)]
        return f"elapsed {clock[0]} eta {clock[1]}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def no_update_note(m: dict[str, float], groups: int) -> str:
    """Why a step took no optimizer step (train/optimizer_steps 0); '' when it took one, or did not say."""
    if m.get(M.TRAIN_OPTIMIZER_STEPS, 1.0) > 0:
        return ""
    equal, rounds = int(m.get(M.TRAIN_EQUAL_REWARD_GROUPS, 0)), int(m.get(M.TRAIN_DYNAMIC_SAMPLING_ROUNDS, 1))
    if groups and equal >= groups:
        return f"all {groups} groups had equal rewards after {rounds} round{'s' if rounds != 1 else ''}: no update"
    if equal:
        return f"{equal} of {groups} groups had equal rewards, the other samples carry no loss (masked): no update"
    return "no sample carries loss (all masked): no update"
