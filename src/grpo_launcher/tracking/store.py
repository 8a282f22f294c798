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
    sqlite store must be writable, an http store must answer, a file store must be allowed (MLFLOW_ALLOW_FILE_STORE).
    A database store (postgresql://, ...) is left to MLflow: its host may be one only the run's nodes resolve. A
    scheme no MLflow store opens (bogus://) is scheme_problem's, a pure rule's (tracking/rules.py mlflow_values):
    a dry run and a Slurm plan are refused for it too."""
    if uri.startswith(SQLITE):
        return _writable_problem(Path(uri[len(SQLITE):])) or not_sqlite_problem(Path(uri[len(SQLITE):]))
    if uri.startswith(("http://", "https://")):
        return _http_problem(uri, timeout)
    if uri.startswith("file:"):
        return _writable_problem(Path(urlsplit(uri).path)) or file_store_problem(uri)
    if not SCHEME.match(uri):  # a plain path: MLflow's file store
        return _writable_problem(Path(uri)) or file_store_problem(uri)
    return None


FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3's file store (a plain path, file:) opens only with it true


def file_store_problem(uri: str) -> str | None:
    """A file store (a plain path or file:) while MLflow refuses it: its FileStore raises unless
    MLFLOW_ALLOW_FILE_STORE is true or 1 (any other value: a ValueError), after Ray and the workers started."""
    value = os.environ.get(FILE_STORE_ENV)
    if value is not None and value.lower() in ("true", "1"):
        return None
    path = Path(urlsplit(uri).path if uri.startswith("file:") else uri)
    now = "unset" if value is None else f"it is {value!r}"
    return (f"is a file store, which MLflow opens only with {FILE_STORE_ENV}=true ({now}): use "
            f"sqlite:///{path.with_name(path.name + '.db')} instead (MLflow's advice; `mlflow migrate-filestore` moves old runs "
            f"into it), or export {FILE_STORE_ENV}=true")


# ------------------------------------------------------------------ what MLflow opens: the store's scheme, the
# experiment's name (pure: the spec alone says; tracking/rules.py mlflow_values refuses them, a dry run too)
# The schemes MLflow 3.17's tracking and model-registry store registries both hold (an MlflowClient needs both:
# bogus:// fails as UnsupportedModelRegistryStoreURIException); a plain path is the file store's ''. Any other
# scheme is looked up in MLflow's registries themselves (a plugin's, by entry point), importing mlflow only then.
MLFLOW_SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql",
                  "databricks", "databricks-uc", "uc")
DB_ENGINES = ("postgresql", "mysql", "sqlite", "mssql")  # SQLAlchemy's dialects: postgresql+psycopg2:// is postgresql
WHOLE_URIS = ("databricks", "databricks-uc", "uc")  # a tracking URI that is a scheme alone (MLflow's get_store)
MAX_EXPERIMENT_NAME = 500  # mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH
MAX_SQL_EXPERIMENT_NAME = 256  # the experiments table's name column, String(256): a server database refuses more


def uri_scheme(uri: str) -> str:
    """The scheme MLflow picks a store by (mlflow.utils.uri.get_uri_scheme): '' for a plain path, a database URI's
    dialect without its driver (postgresql+psycopg2 → postgresql)."""
    if uri in WHOLE_URIS:
        return uri
    if not SCHEME.match(uri):
        return ""
    scheme = uri.split(":", 1)[0].lower()
    if len(scheme) == 1:  # a Windows drive letter: a path
        return ""
    return scheme.split("+", 1)[0] if scheme.startswith(DB_ENGINES) else scheme


def mlflow_schemes() -> list[str]:
    """The schemes MLflow's registries hold here: the built-in ones and every installed plugin's (imports mlflow)."""
    try:
        from mlflow.tracking._model_registry.utils import _get_store_registry
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except Exception:  # noqa: BLE001 -- an mlflow that moved its registries: the built-in schemes
        return list(MLFLOW_SCHEMES)
    tracking, registry = _tracking_store_registry._registry, _get_store_registry()._registry
    return sorted(s for s in tracking if s and s in registry)


def _schemes_text(schemes: list[str]) -> str:
    said = {"file": f"a directory path or file:///DIR (the file store, with {FILE_STORE_ENV}=true)", "sqlite": "sqlite:///PATH.db",
            "http": "http(s)://HOST:PORT (an MLflow server)",
            "postgresql": "postgresql://, mysql://, mssql:// (SQLAlchemy databases)",
            "databricks": "databricks, databricks-uc, uc (Databricks, Unity Catalog)"}
    same = {"https": "http", "mysql": "postgresql", "mssql": "postgresql", "databricks-uc": "databricks",
            "uc": "databricks"}
    ordered = [s for s in MLFLOW_SCHEMES if s in schemes] + [s for s in schemes if s not in MLFLOW_SCHEMES]
    parts = dict.fromkeys(said.get(same.get(s, s), f"{s}:// (a plugin's)") for s in ordered)
    return ", ".join(parts)


def scheme_problem(uri: str) -> str | None:
    """Why no MLflow store here opens `uri` (a scheme neither MLflow nor an installed plugin registers), or None."""
    scheme = uri_scheme(uri)
    if scheme in ("", *MLFLOW_SCHEMES):
        return None
    known = mlflow_schemes()
    if scheme in known:
        return None
    return f"has the scheme '{scheme}:', which no MLflow store opens; MLflow here opens {_schemes_text(known)}"


def experiment_name_limit(uri: str) -> int:
    """The longest experiment name the store at `uri` takes."""
    return MAX_SQL_EXPERIMENT_NAME if uri_scheme(uri) in ("postgresql", "mysql", "mssql") else MAX_EXPERIMENT_NAME


def experiment_problem(name: str, uri: str) -> str | None:
    """Why MLflow would refuse `name` as the experiment of a run whose store is `uri`, or None (MLflow's own check,
    mlflow.utils.validation._validate_experiment_name, and a database server's column)."""
    if not name:
        return "is empty: MLflow refuses an experiment without a name ('Invalid experiment name')"
    limit = experiment_name_limit(uri)
    if len(name) > limit:
        where = "MLflow" if limit == MAX_EXPERIMENT_NAME else f"the {uri_scheme(uri)} store's experiments table"
        return f"is {len(name)} characters long: {where} takes at most {limit}"
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
