"""The tracking room's pre-flight rules (preflight/validate.py lists this module in RULE_MODULES)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from ..secrets import redact_value
from ..spec.errors import Violation
from ..preflight.registry import V, rule
from ..spec.schema import ClusterKind, RunSpec
from ..spec.mlflow_env import EXPERIMENT_ENV, SQLITE, URI_ENV, env_value
from .store import (experiment_name_limit, experiment_problem, not_sqlite_problem, scheme_problem, store_problem,
                    store_uri)


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


@rule("pure")
def mlflow_values(s: RunSpec) -> Iterator[Violation]:
    """The MLflow store's scheme and the experiment's name, which MLflow refuses only once the run opens its store
    (Ray and the workers started): the spec alone says (tracking/store.py). Whether the store is there from here is
    a probe's (tracking_store_reachable)."""
    if not s.logging.mlflow:
        return
    uri, source = store_uri(s)
    uri_keys = (URI_ENV, "logging.tracking_uri") if source == URI_ENV else ("logging.tracking_uri",)
    problem = scheme_problem(uri)
    if problem:
        fix = (f"unset {URI_ENV} (runs go to the output root's sqlite store) or set it to one of those"
               if source == URI_ENV else
               "set logging.tracking_uri to one of those (e.g. sqlite:///DIR/mlflow.db), or null for the output "
               "root's sqlite store")
        yield V("mlflow_values", uri_keys, f"the MLflow store {redact_value(uri)} (from {source}) {problem}",
                f"{fix}; or logging.mlflow=false")
    name = s.logging.experiment
    problem = experiment_problem(name, uri)
    if problem:
        from_env = env_value(EXPERIMENT_ENV) == name
        keys = (EXPERIMENT_ENV, "logging.experiment") if from_env else ("logging.experiment",)
        shown = name if len(name) <= 40 else f"{name[:37]}..."
        limit = experiment_name_limit(uri)
        yield V("mlflow_values", keys, f"the MLflow experiment name '{shown}' (from {keys[0]}) {problem}",
                f"set {EXPERIMENT_ENV} to a name of 1 to {limit} characters, or unset it (experiment 'grpo')"
                if from_env else f"set logging.experiment to a name of 1 to {limit} characters (the default: "
                "logging.experiment=grpo)")
