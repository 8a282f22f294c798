"""Before the loop: the model directory, and where the run starts (fresh, or from its last checkpoint)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..checkpoint import CheckpointManager, CheckpointRefused, IncompatibleCheckpoint
from ..models.tiny import ensure_tiny_model
from ..plan import Plan
from ..runfiles import write_atomic
from ..spec.schema import Resume, RunSpec
from .loop_state import LoopState


def prepare_model(spec: RunSpec, plan: Plan, env: Any) -> Path:
    """The HF directory the workers load: model.path, or the tiny model built (and cached) here."""
    if spec.model.path:
        return Path(spec.model.path)
    cache = Path(spec.output_root).resolve() / ".models"
    cache.mkdir(parents=True, exist_ok=True)
    env_name = getattr(spec.env.name, "value", spec.env.name)  # an enum, or a user class "module:Class"
    return ensure_tiny_model(spec.model, env, str(env_name).replace(":", "-").replace("/", "-"), cache,
                             seed=spec.grpo.seed)


def resume_or_start(spec: RunSpec, plan: Plan) -> LoopState | None:
    """Resume from the latest complete checkpoint (refusing an incompatible one), or start fresh."""
    ckpt = CheckpointManager(plan.checkpoint_dir, spec)
    if spec.checkpoint.resume == Resume.fresh:
        moved = ckpt.start_fresh()
        if moved:
            print(f"grpo-launcher: starting fresh; previous checkpoints moved to {moved}", flush=True)
        set_aside_records(plan.run_dir, moved)
        return LoopState.start(spec, plan, ckpt)
    try:  # the newest checkpoint that verifies against its manifest (an invalid one is named and moved aside)
        latest = ckpt.resume_point(spec.grpo.max_steps)
    except CheckpointRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if latest is None:
        set_aside_records(plan.run_dir, None)
        return LoopState.start(spec, plan, ckpt)
    try:
        ckpt.check_compatible(latest)
    except IncompatibleCheckpoint as exc:
        print(f"error: cannot resume from {latest}:\n{exc}", file=sys.stderr)
        return None
    state = LoopState.resume(spec, plan, ckpt, latest)
    trim_metrics(plan.run_dir / "metrics.jsonl", state.step)
    backfill_mlflow_run(state, plan.run_dir / "metrics.jsonl")
    return state


def backfill_mlflow_run(state: LoopState, metrics_jsonl: Path) -> None:
    """The MLflow run gets the steps so far it lacks, from metrics.jsonl (tracking/mlflow_tracker.py
    Tracker.backfill; what it holds is never sent twice): all of them for a new run (the checkpoint's belongs to
    another run dir: a copy), the steps logged while logging.mlflow=false for the run reopened."""
    mlflow = getattr(state.tracker, "mlflow", state.tracker)  # a Trackers wraps it
    if mlflow is None or not hasattr(mlflow, "backfill"):
        return
    sent = mlflow.backfill(metrics_jsonl)
    if sent:
        which = "the new MLflow run" if getattr(mlflow, "adopted_from", None) else f"MLflow run {mlflow.run_id}"
        print(f"grpo-launcher: sent {sent} value(s) of steps 1..{state.step} in {metrics_jsonl.name} that "
              f"{which} lacked", flush=True)


RECORDS = ("metrics.jsonl", "reward_curve.png", "summary.json", "spec_changes.jsonl", "train_data", "tensorboard",
           "wandb")  # written step by step, or start by start


def trim_metrics(path: Path, step: int) -> None:
    """A resume from step k: the lines of steps after k (their work is lost with the crash that stopped them) and a
    torn last line go, atomically, so that metrics.jsonl keeps one line per step. Whole lines that do not parse
    (bytes a crash or a bad disk left, not UTF-8 JSON: they crashed the resume with a UnicodeDecodeError) are moved
    to metrics.jsonl.unreadable and counted, never dropped silently."""
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    kept, unreadable = [], []
    for i, raw in enumerate(lines):
        try:
            if json.loads(raw.decode())["step"] <= step:
                kept.append(raw.decode() + "\n")
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            if raw.strip() and i < len(lines) - 1:  # the last one, cut short by a crash, goes as before
                unreadable.append(raw + b"\n")
    if unreadable:
        aside = path.with_name(path.name + ".unreadable")
        with open(aside, "ab") as f:
            f.write(b"".join(unreadable))
        print(f"grpo-launcher: {path}: {len(unreadable)} line(s) that are not JSON moved to {aside}", flush=True)
    write_atomic(path, "".join(kept))


def set_aside_records(run_dir: Path, dest: Optional[Path]) -> None:
    """A run starting at step 1 moves the step records of an earlier start (metrics.jsonl, the curve, the summary,
    the data log) into `dest` (its moved-aside checkpoints) or RUN_DIR/records.old-<time>: never mixed, never lost."""
    found = [run_dir / name for name in RECORDS if (run_dir / name).exists()]
    if not found:
        return
    dest = dest or run_dir / f"records.old-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.mkdir(parents=True, exist_ok=True)
    for path in found:
        os.replace(path, dest / path.name)
    print(f"grpo-launcher: the step records of an earlier start moved to {dest}", flush=True)
