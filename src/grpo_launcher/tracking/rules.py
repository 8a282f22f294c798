"""The tracking room's pre-flight rule (preflight/validate.py lists this module in RULE_MODULES)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from ..secrets import redact_value
from ..spec.errors import Violation
from ..preflight.registry import V, rule
from ..spec.schema import ClusterKind, RunSpec
from ..spec.mlflow_env import SQLITE, URI_ENV
from .store import not_sqlite_problem, store_problem, store_uri


@rule("probe")
def tracking_store_reachable(s: RunSpec) -> Iterator[Violation]:
    """The MLflow store a local run opens is there before anything starts (tracking/store.py store_problem): a
    read-only directory or a server nobody answers for would fail the run after Ray and its workers had started.
    The default store's directory (output_root) is output_root_writable's; a Slurm job opens its store from the
    cluster's nodes, not from here."""
    if not s.logging.mlflow or s.cluster.kind != ClusterKind.local:
        return
    uri, source = store_uri(s)
    db = Path(uri.removeprefix(SQLITE))
    if source == "output_root":  # its directory is output_root_writable's; the db file itself is checked here
        problem = f"{db} is not writable" if db.exists() and not os.access(db, os.W_OK) else not_sqlite_problem(db)
    else:
        problem = store_problem(uri)
    if problem:
        keys = {"logging.tracking_uri": ("logging.tracking_uri",), URI_ENV: (URI_ENV, "logging.tracking_uri"),
                "output_root": ("output_root", "logging.tracking_uri")}[source]
        yield V("tracking_store_reachable", keys, f"the MLflow store {redact_value(uri)} (from {source}) {problem}",
                f"start the store or make it writable, point {source} at one that is, or set logging.mlflow=false")
