"""Before the loop: the model directory, and where the run starts (fresh, or from its last checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..plan import Plan
from ..spec.schema import Resume, RunSpec
from .loop_state import LoopState


def prepare_model(spec: RunSpec, plan: Plan, env) -> Path:
    """The HF directory the workers load: model.path, or the tiny model built (and cached) here."""
    if spec.model.path:
        return Path(spec.model.path)
    from ..models.tiny import ensure_tiny_model

    cache = Path(spec.output_root).resolve() / ".models"
    cache.mkdir(parents=True, exist_ok=True)
    env_name = getattr(spec.env.name, "value", spec.env.name)  # an enum, or a user class "module:Class"
    return ensure_tiny_model(spec.model, env, str(env_name).replace(":", "-").replace("/", "-"), cache,
                             seed=spec.grpo.seed)


def resume_or_start(spec: RunSpec, plan: Plan) -> LoopState | None:
    """Resume from the latest complete checkpoint (refusing an incompatible one), or start fresh."""
    from ..checkpoint import CheckpointManager, IncompatibleCheckpoint

    ckpt = CheckpointManager(plan.checkpoint_dir, spec)
    if spec.checkpoint.resume == Resume.fresh:
        moved = ckpt.start_fresh()
        if moved:
            print(f"grpo-launcher: starting fresh; previous checkpoints moved to {moved}", flush=True)
        return LoopState.start(spec, plan, ckpt)
    from ..checkpoint import CheckpointRefused

    try:  # the newest checkpoint that verifies against its manifest (an invalid one is named and moved aside)
        latest = ckpt.resume_point(spec.grpo.max_steps)
    except CheckpointRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if latest is None:
        return LoopState.start(spec, plan, ckpt)
    try:
        ckpt.check_compatible(latest)
    except IncompatibleCheckpoint as exc:
        print(f"error: cannot resume from {latest}:\n{exc}", file=sys.stderr)
        return None
    return LoopState.resume(spec, plan, ckpt, latest)
