"""The local Ray's leftovers, ended once the driver is gone (started by train/workers.py _ray_init).

Why: a driver killed with SIGKILL (the OOM killer, kill -9) takes Ray's gcs_server and raylet with it (Ray's own
fate sharing) and the actor workers exit, but two of the raylet's children, ray::DashboardAgent and
ray::RuntimeEnvAgent, log "Raylet is dead! Exiting" and then hang in their exit for ever, reparented to pid 1
(Ray 2.60). Measured with `python launch.py grpo.max_steps=200 logging.mlflow=false`, kill -9 after step 1: both
agents still alive 15 s after the kill without this watcher (and 60 s: the test, run without it); none 15 s
after with it (tests/integration/test_faults.py test_driver_killed_with_sigkill_leaves_no_ray_process).

What: `python -m grpo_launcher.train.reaper DRIVER PID:CREATE_TIME ...` (in its own session, no output) blocks on
the driver's exit (a pidfd: no polling), gives the recorded processes GRACE_S to end by themselves, then SIGKILLs
those still alive whose create time still matches (a reused pid is never killed). It also exits as soon as every
recorded process has ended (ray.shutdown: nothing left to watch, e.g. an in-process sweep's earlier point). It
imports psutil only (not ray, not torch): ~50 ms of imports (`python -X importtime`), psutil most of it.
"""

from __future__ import annotations

import os
import select
import sys
from contextlib import suppress

import psutil

GRACE_S = 5.0  # what the recorded processes get after the driver's exit to end by themselves


def pidfd(pid: int, create_time: float | None = None) -> int | None:
    """A pidfd on pid (readable once it exits), or None: gone already, reused (create_time differs), or no pidfds."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    try:
        if create_time is None or psutil.Process(pid).create_time() == create_time:
            return fd  # checked after the open: the fd pins the process checked
    except psutil.Error:
        pass
    os.close(fd)
    return None


def wait_for_driver(driver: int, recorded: list[tuple[int, float]]) -> bool:
    """Block until the driver exits (True) or every recorded process has ended while it lives (False)."""
    fd = pidfd(driver)
    if os.getppid() != driver:  # our parent, the driver, is gone already (checked after the open: fd pins it)
        if fd is not None:
            os.close(fd)
        return True
    if fd is None:  # no pidfds (Linux < 5.3): psutil's own wait (it polls)
        with suppress(psutil.Error):
            psutil.Process(driver).wait()
        return True
    watched = [w for w in (pidfd(pid, ct) for pid, ct in recorded) if w is not None]
    try:
        while watched:
            ready, _, _ = select.select([fd, *watched], [], [])
            if fd in ready:
                return True
            for w in ready:
                os.close(w)
            watched = [w for w in watched if w not in ready]
        return False
    finally:
        for w in (fd, *watched):
            os.close(w)


def reap(recorded: list[tuple[int, float]], grace: float = GRACE_S) -> None:
    """GRACE_S for the recorded processes to end, then SIGKILL for those left whose create time still matches."""
    procs = []
    for pid, create_time in recorded:
        try:
            p = psutil.Process(pid)
            if p.create_time() == create_time:
                procs.append(p)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()  # psutil checks the create time again: a reused pid raises NoSuchProcess
        except psutil.Error:
            continue


def main(argv: list[str]) -> int:
    driver = int(argv[0])
    recorded = [(int(pid), float(ct)) for pid, ct in (a.split(":") for a in argv[1:])]
    if wait_for_driver(driver, recorded):
        reap(recorded)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
