"""The run directory: resolved spec, sbatch script, logs, status, checkpoints — one place per run name.

Files that can hold credentials are private: the run dir and logs/ are 0700; `spec.yaml` (redacted: secret
values are `***`) and `.secrets.json` (the real values, read back by `load_spec_file`) are 0600.

Run exclusivity: `.run.lock` (JSON: owner kind, job id, pid, host, time, run dir) is taken under an `flock` of
`.run.lock.guard` — check-and-take is atomic, so of two launches of one run name at once exactly one wins —
before anything is submitted or started, and held by the job (released when it records an end state, see
launch/status.py) or by the local process (released when it returns). A lock whose holder is gone (a Slurm
job no longer queued or running, a dead local pid) is stale and taken over; a live one refuses the launch,
naming the holder. A lock written for another run dir (a copy's, inherited from the original) holds nothing here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ..checkpoint.manager import spec_as_dict
from ..exit_codes import ExitCode
from ..plan import Plan
from ..runfiles import load_spec_file, pid_alive, write_atomic, written_elsewhere  # noqa: F401 (launch/ reads them here too)
from ..secrets import redact_text, save_secrets, secret_values
from ..spec.compose import spec_to_yaml
from ..spec.errors import ConfigError, Violation
from ..spec.schema import RunSpec

LOCK = ".run.lock"
GUARD = ".run.lock.guard"
SUBMIT_GRACE_S = 300  # a lock taken by a launcher that has not yet recorded its job id


class RunBusy(Exception):
    """The run dir is held by a live job or process (the message names it)."""


def make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def prepare(spec: RunSpec, plan: Plan) -> Path:
    """Run dir (0700), logs/ (0700), the redacted spec.yaml (0600) and the secrets beside it (0600)."""
    make_private_dir(plan.run_dir)
    make_private_dir(plan.run_dir / "logs")
    save_secrets(plan.run_dir, secret_values(spec_as_dict(spec)))
    write_atomic(plan.run_dir / "spec.yaml", redact_text(spec_to_yaml(spec)), mode=0o600)
    return plan.run_dir


# ------------------------------------------------------------------ the run lock


@contextmanager
def _guard(run_dir: Path) -> Iterator[None]:
    make_private_dir(run_dir)
    fd = os.open(run_dir / GUARD, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def read_lock(run_dir: Path) -> dict:
    """This dir's lock, or {} when there is none or it was written for another run dir: a copy of a live run carries
    the original's lock, whose pid or job holds the original, not the copy (a launch of the copy takes it over)."""
    try:
        lock = json.loads((Path(run_dir) / LOCK).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(lock, dict) or written_elsewhere(run_dir, lock.get("run_dir")):
        return {}
    return lock


def live_holder(lock: dict) -> Optional[str]:
    """A description of the lock's holder when it is still alive, else None (stale or empty)."""
    if not lock:
        return None
    job = lock.get("job_id")
    if job:
        # imported here (and below): launch/__init__.py imports this module, and `python -m grpo_launcher.launch.status`
        # (job.sh) must not find status loaded before it runs
        from .status import SLURM_ACTIVE, scheduler_job

        info = scheduler_job(str(job))
        if info is not None and info.get("JobState") in SLURM_ACTIVE:
            return f"Slurm job {job} ({info.get('JobState')})"
        if info is not None and _still_completing(str(job)):  # cancelled, its processes not yet gone
            return f"Slurm job {job} ({info.get('JobState')}, still completing)"
        return None
    pid, host = lock.get("pid"), lock.get("host")
    if isinstance(pid, int) and host == socket.gethostname() and pid_alive(pid):
        if lock.get("owner") == "slurm":  # a launcher between taking the lock and sbatch answering
            if time.time() - float(lock.get("since", 0)) < SUBMIT_GRACE_S:
                return f"a submission in progress (launcher pid {pid})"
            return None
        return f"a local run (pid {pid} on {host})"
    return None


def _still_completing(job: str) -> bool:
    from .status import slurm  # here: job.sh runs status with -m (above)

    proc = slurm(["squeue", "-h", "-j", job, "-o", "%T"])
    return proc.returncode == 0 and "COMPLETING" in proc.stdout


def unmakeable(run_dir: Path, exc: OSError) -> int:
    """The run dir could not be made (a path the pre-flight could not foresee, e.g. under /proc): a config error
    naming output_root, exit 2, nothing started."""
    print(ConfigError([Violation("output_root_writable", ("output_root",), f"the run directory {run_dir} cannot "
                                 f"be made: {exc.strerror or exc}", "set output_root to a directory you can write")])
          .render(), file=sys.stderr)
    return ExitCode.CONFIG_ERROR


def acquire_run_lock(run_dir: Path, owner: str, job_id: Optional[str] = None) -> dict:
    """Take the run's lock for `owner` ('local' | 'slurm'), or raise RunBusy naming the live holder."""
    run_dir = Path(run_dir)
    with _guard(run_dir):
        holder = live_holder(read_lock(run_dir))
        if holder is None and owner == "slurm":
            from .status import read_status, SLURM_ACTIVE, scheduler_job  # run dirs from before the lock existed

            job = read_status(run_dir).get("job_id")
            info = scheduler_job(str(job)) if job else None
            if info is not None and info.get("JobState") in SLURM_ACTIVE:
                holder = f"Slurm job {job} ({info.get('JobState')})"
        if holder is not None:
            raise RunBusy(holder)
        lock = {"owner": owner, "job_id": job_id, "pid": os.getpid(), "host": socket.gethostname(),
                "since": round(time.time(), 3), "run_dir": str(run_dir.resolve())}
        write_atomic(run_dir / LOCK, json.dumps(lock) + "\n", mode=0o600)
        return lock


def record_job(run_dir: Path, job_id: str) -> None:
    """The submitted job now holds the lock (its id is what a second launch is told)."""
    with _guard(Path(run_dir)):
        lock = read_lock(run_dir)
        lock.update(job_id=str(job_id), since=round(time.time(), 3))
        write_atomic(Path(run_dir) / LOCK, json.dumps(lock) + "\n", mode=0o600)


def release_run_lock(run_dir: Path, job_id: Optional[str] = None) -> bool:
    """Drop the lock if this holder (job id, or this pid for a local run) still has it."""
    run_dir = Path(run_dir)
    if not (run_dir / LOCK).exists():
        return False
    with _guard(run_dir):
        lock = read_lock(run_dir)
        mine = (job_id is not None and str(lock.get("job_id")) == str(job_id)) or \
            (job_id is None and not lock.get("job_id") and lock.get("pid") == os.getpid()
             and lock.get("host") == socket.gethostname())
        if mine:
            (run_dir / LOCK).unlink(missing_ok=True)
        return mine
