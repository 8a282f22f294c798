"""cluster=local runs in the run dir like Slurm runs: status.json (kind "local", pid, state) and the driver's
output in RUN_DIR/logs/driver-local.log (appended per launch, also shown on the terminal), so that
`launch.py status|logs RUN` find them.

States: RUNNING while the process lives; then COMPLETED (exit 0), STOPPED (a signal; checkpoint saved where enabled),
HUNG (exit 4: a wait passed its deadline), FAILED. A RUNNING record whose pid is gone reads as FAILED ("the process died").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, TextIO

from ..exit_codes import ExitCode
from .rundir import pid_alive

LOCAL_LOG = "driver-local.log"
LOCAL = "local"


class Tee:
    """A text stream writing to the terminal stream and a log file (the file gets no terminal control codes). It keeps
    the first line that starts with 'error:' (the run's own one-line reason: status.json's message when it fails)."""

    def __init__(self, stream: TextIO, log: TextIO):
        self._stream, self._log = stream, log
        self._line, self.first_error = "", ""

    def write(self, text: str) -> int:
        if not self.first_error:
            self._line = (self._line + text)[-4000:]
            *whole, self._line = self._line.split("\n")
            self.first_error = next((line.strip() for line in whole if line.startswith("error:")), "")
        try:
            self._log.write(text)
            self._log.flush()
        except OSError:  # the log's disk is full: the terminal still gets every line (the error names the disk)
            pass
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        try:
            self._log.flush()
        except OSError:  # as in write: a full disk loses the log's copy, never the terminal's
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def state_for(rc: int) -> str:
    stopped = (ExitCode.REQUEUE, ExitCode.INTERRUPTED, ExitCode.TERMINATED)  # a signal: checkpointed, then stopped
    return "COMPLETED" if rc == 0 else "STOPPED" if rc in stopped else "HUNG" if rc == ExitCode.HUNG else "FAILED"


@contextmanager
def closing_quietly(log: TextIO) -> Iterator[TextIO]:
    """The driver log, closed at the end; a close that cannot write its last buffered lines (a full disk: the run's
    own message said so already) does not add a traceback to it."""
    try:
        yield log
    finally:
        try:
            log.close()
        except OSError:
            pass


@contextmanager
def recorded(spec, plan) -> Iterator[dict]:
    """status.json + logs/driver-local.log around a local run; `rec["rc"]` = the run's exit code."""
    from .status import write_status  # here: job.sh runs status with -m (rundir.py)

    logs = Path(plan.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / LOCAL_LOG
    rec: dict = {"rc": 1}
    with closing_quietly(open(path, "a", encoding="utf-8")) as log:
        log.write(f"==> {time.strftime('%Y-%m-%d %H:%M:%S')} launch.py (pid {os.getpid()}): run '{spec.name}'\n")
        write_status(plan.run_dir, "RUNNING", kind=LOCAL, name=spec.name, pid=os.getpid(), host=socket.gethostname(),
                     driver_log=str(path), max_steps=spec.grpo.max_steps, run_dir=str(plan.run_dir), event="started")
        out, err = sys.stdout, sys.stderr
        tee = Tee(err, log)
        sys.stdout, sys.stderr = Tee(out, log), tee
        try:
            yield rec
        except BaseException as exc:
            rec["rc"] = 130 if isinstance(exc, KeyboardInterrupt) else 1
            rec["message"] = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            sys.stdout, sys.stderr = out, err
            if rec["rc"] != 0 and not rec.get("message") and tee.first_error:
                rec["message"] = tee.first_error.removeprefix("error:").strip()[:500]
            try:
                write_status(plan.run_dir, state_for(rec["rc"]), exit_code=rec["rc"], message=rec.get("message"),
                             event="ended")
            except OSError as exc:  # a full disk: said in one line (status reads the dead pid as FAILED)
                print(f"grpo-launcher: {exc.strerror or exc}", file=sys.stderr, flush=True)




def local_state(st: dict) -> tuple[str, str]:
    """(state, note) of a local run's status.json."""
    state = st.get("state", "UNKNOWN")
    if state == "RUNNING" and st.get("host") == socket.gethostname() and isinstance(st.get("pid"), int) \
            and not pid_alive(st["pid"]):
        return "FAILED", f"the process (pid {st['pid']}) died without recording its end"
    return state, f"local run, pid {st.get('pid')} on {st.get('host')}"


def local_step(run_dir: Path, st: dict) -> Optional[str]:
    """'N/M' from RUN_DIR/metrics.jsonl (the last step logged)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    step = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
    return None if step is None else f"{step}/{st.get('max_steps', '?')}"


def describe_local(run_dir: Path, st: dict) -> dict:
    """cli.describe() for a local run: the same keys as a Slurm run's."""
    from .status import phase_line, timing_line  # here: job.sh runs status with -m (rundir.py)

    state, note = local_state(st)
    step = local_step(run_dir, st)
    return {"phase": phase_line(run_dir, st, state), "timing": timing_line(run_dir, st, state, step),
            "name": st.get("name", Path(run_dir).name), "state": state, "note": note, "job_id": LOCAL, "job_ids": [],
            "kind": LOCAL, "pid": st.get("pid"), "recorded_state": st.get("state"), "run_dir": str(run_dir),
            "restarts": st.get("restarts"), "exit_code": st.get("exit_code"),
            "message": st.get("message"), "step": step, "driver_log": st.get("driver_log"),
            "slurm_log": None}


def cancel_local(info: dict, timeout: float) -> int:
    """SIGTERM to a live local run (it saves a checkpoint and stops), then wait for its end."""
    from .status import TERMINAL  # here: job.sh runs status with -m (rundir.py)

    pid = info.get("pid")
    if info["state"] in TERMINAL or not isinstance(pid, int) or not pid_alive(pid):
        print(f"run '{info['name']}' (local) already ended: {info['state']}")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.5)
    if pid_alive(pid):
        print(f"warning: pid {pid} still running after {timeout:.0f}s", file=sys.stderr)
        return 1
    from .status import write_status  # here: job.sh runs status with -m (rundir.py)

    write_status(Path(info["run_dir"]), "CANCELLED", message=f"cancelled with launch.py cancel (SIGTERM to pid {pid})")
    print(f"stopped local run '{info['name']}' (pid {pid}, SIGTERM: it stopped after its step, with a "
          "checkpoint unless checkpoint.enabled=false)")
    return 0
