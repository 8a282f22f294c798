"""Run-dir files that the launcher, the driver and the trackers share: atomic writes, the saved spec, pids, the run
dir's own MLflow run, and which run dir a file was written for (a copy carries the original's).

launch/rundir.py builds the run dir (private directories, the redacted spec.yaml, the run lock) and re-exports
these; train/, tracking/ and gym/ import them from here, so that nothing below the launcher imports launch/.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from .secrets import load_secrets
from .spec.compose import _composition_violation, _unfreeze, to_spec
from .spec.errors import ConfigError, Violation
from .spec.schema import RunSpec


def write_atomic(path: Path, text: str, mode: Optional[int] = None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if mode is not None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        else:
            tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(exc.errno, no_space_message(path)) from exc
        raise


def append_line(path: Path, line: str) -> None:
    """Append one line whole, or not at all: one write to an O_APPEND file; a short or failed write (a full disk) is
    cut back to where the file ended, so a reader never meets a torn last line (metrics.jsonl)."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):  # a short write: the disk filled part-way
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            os.ftruncate(fd, end)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(exc.errno, no_space_message(path)) from None
            raise
    finally:
        os.close(fd)


def no_space_message(path: Path) -> str:
    return f"no space left on device writing {path} ({free_space(Path(path).parent)})"


def free_space(folder: Path) -> str:
    """'N MiB free' on the filesystem of `folder` (or of its nearest existing parent)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


def load_spec_file(path: Path) -> RunSpec:
    """The driver's entry: a saved, resolved spec (+ the run dir's secrets) → RunSpec (typed again). A value the
    schema refuses (spec.yaml edited by hand, cut short) is a ConfigError naming the key and the file."""
    try:
        # the structured schema of a frozen dataclass is read-only: unfreeze it before merging the file in
        cfg = OmegaConf.merge(_unfreeze(OmegaConf.structured(RunSpec)), OmegaConf.load(path))
        for key, value in load_secrets(Path(path).parent).items():
            OmegaConf.update(cfg, key, value, merge=False)
        return to_spec(cfg)
    except ConfigError as err:
        raise ConfigError([in_file(v, path) for v in err.violations]) from None
    except Exception as exc:  # noqa: BLE001  (OmegaConf's type and YAML errors name the key in their own way)
        raise ConfigError([in_file(_composition_violation(exc), path)]) from None


def in_file(v: Violation, path: Path) -> Violation:
    """A violation of a saved spec: the file named in its message and fix."""
    path = Path(path)
    keys = tuple(path.name if k == "<config>" else k for k in v.keys)
    return Violation("spec_file", keys, f"{path}: {v.message}", f"restore {path.name} as the launch wrote it, or "
                     "launch the config again")


def pid_alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie (one that exited and its parent has not collected yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (or it just went): kill(0) said it exists
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def written_elsewhere(run_dir: Path, recorded: object) -> Optional[str]:
    """The run dir a run-dir file names (`recorded`, its "run_dir") when that is not `run_dir`, else None. A copied or
    moved run dir carries the original's status.json, .run.lock and MLflow run record: their pids, jobs and runs are
    the original's, not this dir's. A file that names no run dir (written before they recorded one) is taken as here."""
    if not recorded:
        return None
    return None if Path(str(recorded)).resolve() == Path(run_dir).resolve() else str(recorded)


# RUN_DIR's own MLflow run, written each time a start or resume opens one. A checkpoint's meta.json names the run too,
# but a copy that has not yet saved a checkpoint inherits the original's: without this record every launch of such a
# copy (one that crashed, or failed at start-up) started yet another run and left the last one RUNNING.
MLFLOW_RUN = "mlflow_run.json"


def record_mlflow_run(run_dir: Path, run_id: str, name: str) -> None:
    record = {"run_id": run_id, "run_dir": str(Path(run_dir).resolve()), "name": name}
    write_atomic(Path(run_dir) / MLFLOW_RUN, json.dumps(record) + "\n")


def own_mlflow_run(run_dir: Path, name: str) -> Optional[str]:
    """The MLflow run id recorded by this run dir for run `name`; None when there is no readable record or it was
    written for another dir or name (a copy's, inherited from the original)."""
    try:
        record = json.loads((Path(run_dir) / MLFLOW_RUN).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("name") != name or not record.get("run_dir"):
        return None
    if written_elsewhere(run_dir, record["run_dir"]):
        return None
    return str(record.get("run_id") or "") or None
