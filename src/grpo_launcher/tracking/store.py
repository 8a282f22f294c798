"""Where a run's MLflow records go, checked and named: the store a spec's run opens (store_uri), whether it can
from here (store_problem, at pre-flight), the start-up line naming it and the setting that chose it (tracking_line),
and the variables a relaunch must see again (env_prefix). The spec's logging keys take MLflow's own variables at
pre-flight: spec/mlflow_env.py.
"""

from __future__ import annotations

import logging
import os
import shlex
import sqlite3
from pathlib import Path
from urllib.parse import urlsplit

from ..secrets import redact_value
from ..spec.mlflow_env import EXPERIMENT_ENV, SCHEME, SQLITE, URI_ENV, absolute_uri, env_value
from ..spec.schema import RunSpec


def tracking_line(spec: RunSpec, uri: str) -> str:
    """The start-up line: which store and experiment, and which setting chose each."""
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
    line = (f"grpo-launcher: MLflow runs go to {redact_value(uri)} (from {where}), "
            f"experiment '{exp}' (from {exp_from})")
    if store_locked(uri):
        line += ("\ngrpo-launcher: the store is locked by another process now: this run's metrics are buffered (and "
                 "in RUN_DIR/metrics.jsonl) and sent at the checkpoints once it is free")
    return line


def env_prefix(spec: RunSpec) -> list[str]:
    """`NAME=value` for each MLFLOW_* variable this spec's logging keys came from (a relaunch must see them)."""
    out = []
    uri, experiment = env_value(URI_ENV), env_value(EXPERIMENT_ENV)
    if uri and absolute_uri(uri) == spec.logging.tracking_uri:
        out.append(f"{URI_ENV}={shlex.quote(str(redact_value(uri)))}")
    if experiment and experiment == spec.logging.experiment:
        out.append(f"{EXPERIMENT_ENV}={shlex.quote(experiment)}")
    return out


# ------------------------------------------------------------------ the store opened at pre-flight
PROBE_TIMEOUT_S = 5.0  # an http store's health answer: pre-flight waits no longer


def store_uri(spec: RunSpec) -> tuple[str, str]:
    """(the store this spec's run would open, the setting that chose it: logging.tracking_uri,
    MLFLOW_TRACKING_URI, or output_root for the default store)."""
    env = env_value(URI_ENV)
    if spec.logging.tracking_uri:  # filled from the variable at pre-flight (with_mlflow_env), or set by the user
        from_env = env is not None and absolute_uri(env) == spec.logging.tracking_uri
        return spec.logging.tracking_uri, URI_ENV if from_env else "logging.tracking_uri"
    if env:
        return absolute_uri(env), URI_ENV
    return f"{SQLITE}{Path(spec.output_root).resolve() / 'mlflow.db'}", "output_root"


def _writable_problem(path: Path) -> str | None:
    """Why MLflow could not write a file store or sqlite db at `path` (its nearest existing directory), or None."""
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):  # sqlite writes its journal next to the db
        return f"{folder} is not writable (read-only)"
    return None


def _http_problem(uri: str, timeout: float) -> str | None:
    """An http(s) store answers its /health endpoint (any HTTP answer below 500 counts: auth is MLflow's concern)."""
    import urllib.error
    import urllib.request  # here: it imports http.client, email and ssl, which pre-flight needs only for http

    parts = urlsplit(uri)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    url = f"{parts.scheme}://{netloc}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code < 500 else f"answers HTTP {exc.code} at {url}"
    except urllib.error.URLError as exc:
        if "SSL" in type(exc.reason).__name__ or "CERTIFICATE" in str(exc.reason):
            return None  # it answered; TLS settings are MLflow's (MLFLOW_TRACKING_INSECURE_TLS)
        why = getattr(exc.reason, "strerror", None) or str(exc.reason)
        return f"is unreachable ({why}, asked {url})"
    except (OSError, ValueError) as exc:  # TimeoutError, a bad port
        return f"is unreachable ({type(exc).__name__}: {exc or 'no answer'} within {timeout:.0f} s, asked {url})"


SQLITE_HEADER = b"SQLite format 3\0"


def not_sqlite_problem(path: Path) -> str | None:
    """A sqlite store's file that is there but not a SQLite database (overwritten, truncated to its first bytes, a
    copy cut short): sqlite says 'file is not a database' only once MLflow opens it, after Ray started."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return None  # MLflow makes it
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if head and head != SQLITE_HEADER:
        return (f"{path} is not a SQLite database (its first bytes are {head[:8]!r}): move it aside (MLflow then "
                "makes a new one) or restore it from a backup")
    return None


def store_problem(uri: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a run could not open the MLflow store at `uri` from here, or None. Light (no mlflow import): a file or
    sqlite store must be writable, an http store must answer. A database store (postgresql://, ...) is left to
    MLflow: its host may be one only the run's nodes resolve."""
    if uri.startswith(SQLITE):
        return _writable_problem(Path(uri[len(SQLITE):])) or not_sqlite_problem(Path(uri[len(SQLITE):]))
    if uri.startswith(("http://", "https://")):
        return _http_problem(uri, timeout)
    if uri.startswith("file:"):
        return _writable_problem(Path(urlsplit(uri).path))
    if not SCHEME.match(uri):  # a plain path: MLflow's file store
        return _writable_problem(Path(uri))
    return None


def store_locked(uri: str) -> bool:
    """A sqlite store another process holds a write lock on now (the run buffers its metrics until it frees)."""
    if not uri.startswith(SQLITE) or not Path(uri[len(SQLITE):]).is_file():
        return False
    try:
        con = sqlite3.connect(uri[len(SQLITE):], timeout=0)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.rollback()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:  # OperationalError (locked), or a file that is not a database
        return "locked" in str(exc)
    return False


STORE_LOGGER = "mlflow.store.db.utils"  # logs every sqlite/SQL OperationalError with its traceback, then raises it


def _not_a_caught_db_error(record: object) -> bool:
    return "SQLAlchemy database error" not in str(getattr(record, "msg", ""))


def quiet_store_tracebacks() -> None:
    """MLflow logs a database error (a locked sqlite store: ~65 lines of traceback and SQL) before it raises it as
    an MlflowException, which the tracker reports in one line (its buffer's warning): drop that log record."""
    logger = logging.getLogger(STORE_LOGGER)
    if _not_a_caught_db_error not in logger.filters:
        logger.addFilter(_not_a_caught_db_error)
