"""A run name that already has checkpoints: refused when it is finished (nothing to do), continued when
grpo.max_steps grew. Checked at pre-flight (rule `run_name_not_finished`), before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from .spec.schema import Resume, RunSpec

STEP_DIR = re.compile(r"step_(\d+)")


def last_checkpoint_step(run_dir: Path) -> Optional[int]:
    """The step of the newest complete checkpoint (step_* holding meta.json), or None."""
    ckpt = Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return None
    steps = [int(m.group(1)) for p in ckpt.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and (p / "meta.json").is_file()]
    return max(steps) if steps else None


def newest_meta(run_dir: Path) -> Optional[tuple[int, dict]]:
    """(step, meta.json) of the newest complete checkpoint, or None (none, or its meta.json unreadable)."""
    step = last_checkpoint_step(run_dir)
    if step is None:
        return None
    try:
        return step, json.loads((Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "meta.json").read_text())
    except (OSError, ValueError):  # unreadable: the job's resume verifies it and falls back to an older one
        return None


def summary_finished_step(run_dir: Path) -> Optional[int]:
    """The step RUN_DIR/summary.json says the run FINISHED at (a run that wrote no checkpoint, or none of its last
    steps: checkpoint.enabled=false), else None."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    step = summary.get("step") if isinstance(summary, dict) and summary.get("status") == "FINISHED" else None
    return step if isinstance(step, int) else None


def finished_problem(spec: RunSpec) -> Optional[tuple[str, str]]:
    """(message, fix) when resuming this run name would have nothing to train, else None (a probe:
    preflight/run_dir.py run_name_not_finished, which a dry run skips). A run that finished past its last
    checkpoint (checkpoint.enabled=false) counts by its summary: launched again, it would train those steps again."""
    if spec.checkpoint.resume != Resume.auto:
        return None
    run_dir = Path(spec.output_root).resolve() / spec.name
    saved, done = last_checkpoint_step(run_dir), summary_finished_step(run_dir)
    if done is not None and done >= spec.grpo.max_steps and (saved is None or saved < done):
        where = f"its last checkpoint is step {saved}" if saved is not None else "it wrote no checkpoint"
        return (f"run '{spec.name}' already finished (step {done}) under {run_dir} (grpo.max_steps="
                f"{spec.grpo.max_steps}); {where} (checkpoint.enabled=false), so a launch would train steps "
                f"{(saved or 0) + 1}..{done} again",
                "use checkpoint.resume=fresh to train it again from step 1 (its records moved aside) or a new name "
                "(name=...)")
    if saved is None or saved < spec.grpo.max_steps:
        return None  # nothing yet, or grpo.max_steps grew: the run continues from its last checkpoint
    stopped = done is None or done < saved  # stopped at step 99 of 400, launched with max_steps=50: not finished
    what = f"has checkpoints up to step {saved}" if stopped else f"already finished (step {saved})"
    return (f"run '{spec.name}' {what} under {run_dir} (grpo.max_steps={spec.grpo.max_steps}): nothing is left "
            "to train",
            f"use checkpoint.resume=fresh or a new name (name=...); or raise grpo.max_steps above {saved} to extend it")
