"""Where a run's MLflow records go: the spec's logging keys, else MLflow's own environment variables, else the
output root's sqlite store.

    logging.tracking_uri  set (command line or a config file)       → that store
                          null (the default)                        → $MLFLOW_TRACKING_URI, else
                                                                      sqlite:///OUTPUT_ROOT/mlflow.db
    logging.experiment    on the command line, or a config file's value other than 'grpo'   → that experiment
                          else                                      → $MLFLOW_EXPERIMENT_NAME, else 'grpo'

Resolved once, at pre-flight, into the spec: spec.yaml (so a Slurm job, a resume's record and `launch.py rerun`)
holds the store the run used. A relative path in the variable (sqlite:///X.db, ./mlruns) is made absolute there,
as output_root is for a Slurm job.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Iterable

from ..spec.schema import LoggingSpec, RunSpec

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


def tracking_line(spec: RunSpec, uri: str) -> str:
    """The start-up line: which store and experiment, and which setting chose each."""
    from ..secrets import redact_value

    env_uri, env_exp = env_value(URI_ENV), env_value(EXPERIMENT_ENV)
    if spec.logging.tracking_uri is None:
        where = f"the output root's store ({URI_ENV} unset)"
    elif env_uri and absolute_uri(env_uri) == spec.logging.tracking_uri:
        where = URI_ENV
    else:
        where = "logging.tracking_uri" + (f"; {URI_ENV} not used" if env_uri else "")
    exp = spec.logging.experiment
    exp_from = (EXPERIMENT_ENV if env_exp == exp else "logging.experiment"
                + (f"; {EXPERIMENT_ENV} not used" if env_exp else ""))
    return (f"grpo-launcher: MLflow runs go to {redact_value(uri)} (from {where}), "
            f"experiment '{exp}' (from {exp_from})")


def env_prefix(spec: RunSpec) -> list[str]:
    """`NAME=value` for each MLFLOW_* variable this spec's logging keys came from (a relaunch must see them)."""
    import shlex

    from ..secrets import redact_value

    out = []
    uri, experiment = env_value(URI_ENV), env_value(EXPERIMENT_ENV)
    if uri and absolute_uri(uri) == spec.logging.tracking_uri:
        out.append(f"{URI_ENV}={shlex.quote(str(redact_value(uri)))}")
    if experiment and experiment == spec.logging.experiment:
        out.append(f"{EXPERIMENT_ENV}={shlex.quote(experiment)}")
    return out
