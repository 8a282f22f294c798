"""The run's name (a directory and a job name), the paths a local run reads, and the model's weight files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from ..envs.dataset import FORMATS
from ..spec.errors import Violation
from ..spec.schema import ClusterKind, RunSpec, validation_on
from .registry import V, rule
from .safetensors_check import weights_problems

SAFE_NAME = re.compile(r"[A-Za-z0-9_.+=,@-]+")
MAX_NAME = 200  # a directory name (255 bytes) with room for the sweep suffixes
# what output_root holds beside the run dirs: the default MLflow store and its artifacts (tracking/store.py), the
# sweeps' folder (conf/config.yaml hydra.sweep.dir) and the Optuna sweeper's default storage
OUTPUT_ROOT_ENTRIES = ("mlflow.db", "mlartifacts", "multirun", "optuna.db")


@rule("pure")
def safe_names(s: RunSpec) -> Iterator[Violation]:
    if not SAFE_NAME.fullmatch(s.name):
        yield V("safe_names", "name", f"run name {s.name!r} becomes a directory and a job name",
                "use letters, digits and . _ - = + , @ only")
    elif s.name.startswith("."):
        yield V("safe_names", "name", f"run name {s.name[:40]!r}{'...' if len(s.name) > 40 else ''} must not start "
                f"with '.' (output_root/{s.name[:8]} would leave or hide in output_root)", "use a name like my-run_1")
    elif s.name in OUTPUT_ROOT_ENTRIES:
        yield V("safe_names", "name", f"run name {s.name!r} is the name of output_root's own {s.name} (the run dir "
                f"would be it: {', '.join(OUTPUT_ROOT_ENTRIES)} are taken)", "use a name like my-run_1")
    elif len(s.name) > MAX_NAME:
        yield V("safe_names", "name", f"run name {s.name[:40]!r}... has {len(s.name)} characters, more than "
                f"{MAX_NAME} (a directory and a job name)", "use a shorter name, like my-run_1")


@rule("probe")
def local_paths_exist(s: RunSpec) -> Iterator[Violation]:
    """Paths a local run reads must exist here (a Slurm job's paths live on the cluster's filesystem)."""
    if s.cluster.kind != ClusterKind.local:
        return
    if s.model.path and not Path(s.model.path).is_dir():
        yield V("local_paths_exist", "model.path", f"no model directory at {s.model.path}",
                "point model.path at an HF checkpoint directory (or null for the tiny model)")
    for key in ("train_path", "val_path") if validation_on(s.grpo) else ("train_path",):  # val: read if validating
        path = getattr(s.env, key)
        if path and not Path(path).exists():
            yield V("local_paths_exist", f"env.{key}", f"no file at {path}",
                    f"point env.{key} at a data file ({', '.join(FORMATS)}, each also .gz; .parquet) "
                    "or a saved datasets directory")


@rule("pure")
def model_weights_readable(s: RunSpec) -> Iterator[Violation]:
    """model.path's *.safetensors headers against their files' sizes (preflight/safetensors_check.py)."""
    yield from weights_problems(s)
