"""The run directory: it can be made, its run has not finished, and its checkpoints fit this spec."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from ..checkpoint.manager import incompatibilities
from ..finished import finished_problem, newest_meta
from ..secrets import redact_value
from ..spec.mlflow_env import URI_ENV, absolute_uri, env_value
from ..spec.errors import Violation
from ..spec.schema import Resume, RunSpec
from .registry import V, rule


@rule("probe")
def output_root_writable(s: RunSpec) -> Iterator[Violation]:
    """The run directory can be made: the nearest existing part of OUTPUT_ROOT/NAME is a directory this user may
    write (nothing is created here); else the launcher would fail making RUN_DIR after the plan."""
    path = Path(s.output_root).expanduser().absolute() / s.name
    while not path.exists() and path != path.parent:
        path = path.parent
    problem = ("is not a directory" if not path.is_dir() else
               None if os.access(path, os.W_OK | os.X_OK) else "is not writable by this user")
    if problem:
        yield V("output_root_writable", "output_root", f"{path} {problem}: the run directory cannot be made there",
                "set output_root to a directory you can write (it is created if missing)")


@rule("probe")
def run_name_not_finished(s: RunSpec) -> Iterator[Violation]:
    """Re-launching a finished run's name would train nothing (and overwrite its summary): refused."""
    problem = finished_problem(s)
    if problem:
        yield V("run_name_not_finished", ("name", "checkpoint.resume", "grpo.max_steps"), *problem)


@rule("probe")
def run_name_checkpoints_compatible(s: RunSpec) -> Iterator[Violation]:
    """Resuming a run name whose newest checkpoint was written by another model, parallelism or env would be
    refused by the job after it had built a model and rewritten spec.yaml: refused here, nothing touched."""
    newest = newest_meta(Path(s.output_root).resolve() / s.name) if s.checkpoint.resume == Resume.auto else None
    if newest is None:
        return
    step, meta = newest
    diffs = incompatibilities(meta, s) if "compat" in meta or "spec" in meta else []  # the job's own check
    if diffs:
        keys = tuple(dict.fromkeys(d.split(":")[0] for d in diffs))
        yield V("run_name_checkpoints_compatible", (*keys, "checkpoint.resume"),
                f"run '{s.name}' has checkpoints (step {step}) from an incompatible spec (checkpoint → this run): "
                + "; ".join(diffs), "checkpoint.resume=fresh (moves its checkpoints aside), or a new name=...")


@rule("probe")
def run_name_keeps_its_tracking_store(s: RunSpec) -> Iterator[Violation]:
    """Resuming a run whose MLflow store came from MLFLOW_TRACKING_URI, without that variable (or with another
    store in it), moved its tracking to another store without a word: a new MLflow run there, the steps so far in
    the old one. Refused unless logging.tracking_uri names the new store (a move the user asked for)."""
    if not s.logging.mlflow or s.checkpoint.resume != Resume.auto:
        return
    newest = newest_meta(Path(s.output_root).resolve() / s.name)
    if newest is None:
        return
    old = redact_value(((newest[1].get("spec") or {}).get("logging") or {}).get("tracking_uri"))  # never shown in clear
    new = s.logging.tracking_uri
    env = env_value(URI_ENV)
    chosen = new is not None and not (env and absolute_uri(env) == new)  # logging.tracking_uri itself: a move
    if old == redact_value(new) or chosen:  # meta.json keeps it redacted (an older one: in clear)
        return
    where = f"{URI_ENV}={redact_value(env)}" if env else f"the output root's store ({URI_ENV} unset)"
    yield V("run_name_keeps_its_tracking_store", ("logging.tracking_uri", URI_ENV),
            f"run '{s.name}' logged to the MLflow store {old or 'of its output root'}; this launch would log to "
            f"{redact_value(new) if new else 'sqlite:///OUTPUT_ROOT/mlflow.db'} ({where}): its MLflow run would "
            "continue in another store", (f"set {URI_ENV}={old} (as at its start) to continue there" if old else
                                          f"unset {URI_ENV} to continue in the output root's store")
            + "; or logging.tracking_uri=NEW_STORE to move it on purpose (a new MLflow run there, its steps so far "
            "sent from metrics.jsonl)")
