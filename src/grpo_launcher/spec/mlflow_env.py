"""MLflow's own environment variables in the spec: the logging keys left at their defaults take them, else the
output root's sqlite store.

    logging.tracking_uri  set (command line or a config file)       → that store
                          null (the default)                        → $MLFLOW_TRACKING_URI, else
                                                                      sqlite:///OUTPUT_ROOT/mlflow.db
    logging.experiment    on the command line, or a config file's value other than 'grpo'   → that experiment
                          else                                      → $MLFLOW_EXPERIMENT_NAME, else 'grpo'

Resolved once, at pre-flight (spec/resolve.py), into the spec: spec.yaml (so a Slurm job, a resume's record and
`launch.py rerun`) holds the store the run used. A relative path in the variable (sqlite:///X.db, ./mlruns) is made
absolute there, as output_root is for a Slurm job. tracking/store.py opens, checks and names the store.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Iterable

from .schema import LoggingSpec, RunSpec

URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
SQLITE = "sqlite:///"


def absolute_uri(uri: str) -> str:
    """sqlite:///relative.db and plain relative paths made absolute (from the cwd); any other URI unchanged."""
    if uri.startswith(SQLITE) and not uri[len(SQLITE):].startswith("/"):
        return SQLITE + str(Path(uri[len(SQLITE):]).resolve())
    if SCHEME.match(uri):
        return uri
    return str(Path(uri).expanduser().resolve())


def env_value(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def with_mlflow_env(spec: RunSpec, cli_keys: Iterable[str] = ()) -> RunSpec:
    """The spec with MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME filled into the logging keys left at their
    defaults (the module's table); keys given on the command line or in a config file win."""
    log = spec.logging
    uri, experiment = env_value(URI_ENV), env_value(EXPERIMENT_ENV)
    new_uri = absolute_uri(uri) if log.tracking_uri is None and uri else log.tracking_uri
    explicit = "logging.experiment" in cli_keys or log.experiment != LoggingSpec.experiment
    new_experiment = experiment if experiment and not explicit else log.experiment
    if (new_uri, new_experiment) == (log.tracking_uri, log.experiment):
        return spec
    return dataclasses.replace(spec, logging=dataclasses.replace(log, tracking_uri=new_uri, experiment=new_experiment))
