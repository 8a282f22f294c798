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


def finished_problem(spec: RunSpec) -> Optional[tuple[str, str]]:
    """(message, fix) when resuming this run name would have nothing to train, else None (a probe:
    preflight/run_dir.py run_name_not_finished, which a dry run skips)."""
    if spec.checkpoint.resume != Resume.auto:
        return None
    step = last_checkpoint_step(Path(spec.output_root).resolve() / spec.name)
    if step is None or step < spec.grpo.max_steps:
        return None  # nothing yet, or grpo.max_steps grew: the run continues from its last checkpoint
    return (f"run '{spec.name}' already finished (step {step}) under {Path(spec.output_root).resolve() / spec.name}"
            f" (grpo.max_steps={spec.grpo.max_steps})",
            f"use checkpoint.resume=fresh or a new name (name=...); or raise grpo.max_steps above {step} to extend it")
