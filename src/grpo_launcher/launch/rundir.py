"""The run directory: resolved spec, sbatch script, logs, status, checkpoints — one place per run name."""

from __future__ import annotations

import os
from pathlib import Path

from ..plan import Plan
from ..spec.compose import spec_to_yaml
from ..spec.schema import RunSpec


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare(spec: RunSpec, plan: Plan) -> Path:
    (plan.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_atomic(plan.run_dir / "spec.yaml", spec_to_yaml(spec))
    return plan.run_dir


def load_spec_file(path: Path) -> RunSpec:
    """The driver's entry: a saved, resolved spec → RunSpec (typed again; no Hydra composition)."""
    from omegaconf import OmegaConf

    from ..spec.compose import _unfreeze, to_spec

    # the structured schema of a frozen dataclass is read-only: unfreeze it before merging the file in
    return to_spec(OmegaConf.merge(_unfreeze(OmegaConf.structured(RunSpec)), OmegaConf.load(path)))
