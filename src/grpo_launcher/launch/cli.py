"""`python launch.py status|logs|cancel RUN`: runs submitted with cluster=slurm, by run name or job id.

    python launch.py status [RUN] [--json]     state (status.json reconciled with scontrol/squeue), step, logs
                                               (no RUN: every run under the output root)
    python launch.py logs RUN [-f] [--slurm | --node NODE | --placement] [-n LINES]
                                               the driver log (every start of the job, appended); -f follows
                                               it until the job ends (requeues included)
    python launch.py cancel RUN                scancel the job, wait until it stopped, record CANCELLED

RUN is a run name, a Slurm job id, or a run directory. Run dirs are looked up under --root DIR
(default: $GRPO_OUTPUT_ROOT, else ./outputs); a job id or the name of a queued job is also resolved
through Slurm (its StdOut path lies in the run dir), so these work from any directory while Slurm
still knows the job. Exit codes (ExitCode): 0 ok, 1 not found / Slurm error, 2 usage.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from ..exit_codes import ExitCode
from ..runfiles import written_elsewhere
from .local_status import cancel_local, describe_local, local_state, local_step
from .status import (
    TERMINAL,
    effective_state,
    jobs_named,
    phase_line,
    read_status,
    scheduler_job,
    slurm,
    timing_line,
    write_status,
)

STEP_LINE = re.compile(r"^step (\d+)/(\d+)\b")


class NotFound(Exception):
    pass


Subcommand = Callable[[list[str]], int]


def quiet_on_closed_pipe(command: Subcommand) -> Subcommand:
    """A subcommand whose reader went away (`launch.py status | head -1`, a pager quit early) ends quietly, exit 0:
    no BrokenPipeError traceback, and no 'Exception ignored' at exit (stdout is pointed at /dev/null first, so
    Python's last flush of it writes nowhere), as `yes | head -1` stops."""
    @functools.wraps(command)
    def run(args: list[str]) -> int:
        try:
            code = command(args)
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
            return code
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, sys.stdout.fileno())
                finally:
                    os.close(devnull)
            except (OSError, ValueError):  # a stdout with no file descriptor (a test's capture)
                pass
            return ExitCode.OK
    return run


def default_root() -> Path:
    return Path(os.environ.get("GRPO_OUTPUT_ROOT", "outputs"))


def run_dir_of_job(job_id: str, root: Path) -> Optional[Path]:
    info = scheduler_job(job_id)
    if info and info.get("StdOut"):
        candidate = Path(info["StdOut"]).parent.parent  # <run_dir>/logs/slurm-<job>.out
        if (candidate / "status.json").exists():
            return candidate
    for status_file in sorted(root.glob("*/status.json")):
        st = read_status(status_file.parent)
        if job_id == str(st.get("job_id")) or job_id in [str(j) for j in st.get("job_ids", [])]:
            return status_file.parent
    return None


def resolve(target: str, root: Path) -> Path:
    path = Path(target)
    if (path / "status.json").exists():
        return path.resolve()
    if target.isdigit():
        found = run_dir_of_job(target, root)
        if found:
            return found
    if (root / target / "status.json").exists():
        return (root / target).resolve()
    for job in jobs_named(target):  # a queued/running job with that name, submitted from elsewhere
        found = run_dir_of_job(job, root)
        if found:
            return found
    raise NotFound(f"no run '{target}': not a run dir, not under {root.resolve()} (use --root), "
                   "and Slurm knows no job with that id or name")


def last_step(driver_log: Path) -> Optional[str]:
    if not driver_log.exists():
        return None
    step = None
    with open(driver_log, errors="replace") as f:
        for line in f:
            m = STEP_LINE.match(line)
            if m:
                step = f"{m.group(1)}/{m.group(2)}"
    return step


def written_for(run_dir: Path, st: dict) -> Optional[str]:
    """Where this status.json was written, when not here: a run dir copied or moved keeps the original's job id and
    pid, which are not this dir's to report on or cancel (None: it is this dir's own)."""
    recorded = st.get("run_dir")
    if recorded:
        return written_elsewhere(run_dir, recorded)
    name = st.get("name")  # a status.json from before run_dir was recorded for local runs
    return f"run '{name}'" if name and name != Path(run_dir).name else None


def describe_copy(run_dir: Path, st: dict, origin: str) -> dict:
    """A copied run dir: its files as they are, no job or process (those are the original's)."""
    recorded = st.get("state", "UNKNOWN")
    state = recorded if recorded in TERMINAL else "STOPPED"
    return {"name": run_dir.name, "state": state, "job_id": None, "job_ids": [], "kind": st.get("kind"), "pid": None,
            "note": f"a copy of {origin}: its job or process is that run's; a launch with this name resumes the copy "
                    "as a run of its own", "copy_of": origin, "recorded_state": recorded, "run_dir": str(run_dir),
            "restarts": None, "exit_code": st.get("exit_code"), "message": st.get("message"),
            "step": local_step(run_dir, st), "driver_log": None, "slurm_log": None, "phase": None, "timing": None}


def describe(run_dir: Path) -> dict:
    st = read_status(run_dir)
    origin = written_for(run_dir, st)
    if origin is not None:
        return describe_copy(run_dir, st, origin)
    if st.get("kind") == "local":  # cluster=local runs (launch/local_status.py)
        return describe_local(run_dir, st)
    job = str(st.get("job_id", "")) or None
    sched = scheduler_job(job) if job else None
    state, note = effective_state(st, sched)
    logs = run_dir / "logs"
    out = {"name": st.get("name", run_dir.name), "state": state, "note": note, "job_id": job,
           "job_ids": st.get("job_ids", []), "recorded_state": st.get("state"), "run_dir": str(run_dir),
           "restarts": st.get("restarts"), "exit_code": st.get("exit_code"), "message": st.get("message"),
           "step": last_step(logs / f"driver-{job}.log") if job else None,
           "driver_log": str(logs / f"driver-{job}.log") if job else None,
           "slurm_log": str(logs / f"slurm-{job}.out") if job else None, "phase": phase_line(run_dir, st, state)}
    queued = (sched or {}).get("JobState", "") in ("PENDING", "CONFIGURING")
    out["timing"] = timing_line(run_dir, st, state, out["step"], queued=queued)
    if sched:
        out["slurm"] = {k: sched.get(k) for k in ("JobState", "Reason", "NodeList", "RunTime", "TimeLimit",
                                                    "Restarts", "ExitCode") if sched.get(k) is not None}
    return out


def parse(args: list[str], prog: str, need_run: bool = True,
          extra: Optional[Callable[[argparse.ArgumentParser], object]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"launch.py {prog}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs=None if need_run else "?", help="run name, Slurm job id, or run dir")
    ap.add_argument("--root", type=Path, default=default_root(), help="where run dirs live (default ./outputs)")
    if extra:
        extra(ap)
    return ap.parse_args(args)


# ------------------------------------------------------------------ status


def status(args: list[str]) -> int:
    a = parse(args, "status", need_run=False, extra=lambda ap: ap.add_argument("--json", action="store_true"))
    if a.run is None:
        return list_runs(a.root, a.json)
    try:
        info = describe(resolve(a.run, a.root))
    except NotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    if a.json:
        print(json.dumps(info, indent=1))
        return ExitCode.OK
    s = info.get("slurm", {})
    rows = [("run", info["name"]),
            ("state", info["state"] + (f"  ({info['note']})" if info["note"] else "")),
            ("job", None if info.get("copy_of") else "local" if info.get("kind") == "local"  # no Slurm job: no start
             else f"{info['job_id']}  (start #{info['restarts'] or 0}; job ids {', '.join(info['job_ids'])})")]
    if s:
        rows.append(("slurm", f"{s.get('JobState')} on {s.get('NodeList')}  run time {s.get('RunTime')} / "
                              f"{s.get('TimeLimit')}  restarts {s.get('Restarts')}  reason {s.get('Reason')}"))
    if info["step"]:
        where = "the last step in metrics.jsonl" if info.get("kind") == "local" else "last step line of the driver log"
        rows.append(("step", f"{info['step']}  ({where})"))
    if info.get("timing"):
        rows.append(("time", info["timing"]))
    if info.get("phase"):
        rows.append(("phase", info["phase"]))
    if info["exit_code"] is not None:
        rows.append(("exit code", str(info["exit_code"])))
    if info["message"]:
        rows.append(("message", info["message"]))
    rows += [("run dir", info["run_dir"]), ("driver log", info["driver_log"]), ("slurm log", info["slurm_log"])]
    for key, value in rows:
        if value is not None:  # a local run has no Slurm log ('slurm log None' was printed)
            print(f"{key:11s}{value}")
    return ExitCode.OK


def list_runs(root: Path, as_json: bool) -> int:
    runs = [describe(p.parent) for p in sorted(root.glob("*/status.json"))]
    if as_json:
        print(json.dumps(runs, indent=1))
        return ExitCode.OK
    if not runs:
        print(f"no runs with a status.json under {root.resolve()}")
        return ExitCode.OK
    for r in runs:
        print(f"{r['name']:40s} {r['state']:10s} job {r['job_id'] or '-':8s} step {r['step'] or '-'}")
    return ExitCode.OK


# ------------------------------------------------------------------ logs


class Tail:
    """Incremental reader of a growing file: whole lines only, from the start."""

    def __init__(self, path: Path):
        self.path, self.pos, self.buf = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return []
        self.buf += chunk
        *whole, self.buf = self.buf.split("\n")
        return whole

    def rest(self) -> list[str]:
        out = self.lines()
        if self.buf:
            out, self.buf = [*out, self.buf], ""
        return out


def ended(run_dir: Path) -> tuple[bool, dict]:
    st = read_status(run_dir)
    if st.get("state") in TERMINAL:
        return True, st
    if st.get("kind") == "local":
        return local_state(st)[0] in TERMINAL, st
    job = st.get("job_id")
    state, _ = effective_state(st, scheduler_job(str(job)) if job else None)
    return state in (*TERMINAL, "UNKNOWN"), st


def follow(run_dir: Path, tails: list[tuple[str, Tail]], on_line: Optional[Callable[[str, str], None]] = None,
           poll: float = 0.25) -> dict:
    """Print new lines of `tails` until the run ended (then drain); return the final status.json."""
    next_check = 0.0
    while True:
        for prefix, t in tails:
            for line in t.lines():
                print(prefix + line, flush=True)
                if on_line:
                    on_line(prefix, line)
        if time.monotonic() >= next_check:
            done, st = ended(run_dir)
            next_check = time.monotonic() + 1.0
            if done:
                time.sleep(0.5)  # the last lines may still be on their way to the file
                for prefix, t in tails:
                    for line in t.rest():
                        print(prefix + line, flush=True)
                return read_status(run_dir) or st
        time.sleep(poll)


def line_count(text: str) -> int:
    """`logs -n N`: N ≥ 0 (argparse names the option and the value otherwise; -5 skipped the first 5 lines)."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {n}")
    return n


def logs(args: list[str]) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
        ap.add_argument("-n", "--lines", type=line_count, default=0, help="only the last N lines (without -f)")
        which = ap.add_mutually_exclusive_group()
        which.add_argument("--slurm", action="store_true", help="the batch script's log (Ray bring-up, errors)")
        which.add_argument("--node", help="the Ray log of one node (e.g. n2)")
        which.add_argument("--placement", action="store_true", help="where each actor ran (JSON)")

    a = parse(args, "logs", extra=extra)
    try:
        run_dir = resolve(a.run, a.root)
    except NotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    st = read_status(run_dir)
    job = "local" if st.get("kind") == "local" else st.get("job_id")
    if not job:
        print(f"error: {run_dir} has no job id in status.json (was it submitted?)", file=sys.stderr)
        return ExitCode.FAILED
    d = run_dir / "logs"
    path = (d / f"slurm-{job}.out" if a.slurm else d / f"ray-{job}-{a.node}.log" if a.node
            else d / f"placement-{job}.json" if a.placement else d / f"driver-{job}.log")
    if a.follow:
        print(f"==> {path} (following until job {job} ends; Ctrl-C stops following, not the job)", file=sys.stderr)
        try:
            follow(run_dir, [("", Tail(path))])
        except KeyboardInterrupt:
            return ExitCode.INTERRUPTED
        return ExitCode.OK
    if not path.exists():
        print(f"{path}: not written yet (job {job}: {describe(run_dir)['state']})", file=sys.stderr)
        return ExitCode.FAILED
    text = path.read_text(errors="replace")
    if a.lines:
        text = "\n".join(text.splitlines()[-a.lines:]) + "\n"
    sys.stdout.write(text)
    return ExitCode.OK


# ------------------------------------------------------------------ cancel


def cancel(args: list[str]) -> int:
    a = parse(args, "cancel", extra=lambda ap: ap.add_argument("--timeout", type=float, default=120))
    try:
        run_dir = resolve(a.run, a.root)
    except NotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    info = describe(run_dir)
    if info.get("copy_of"):
        print(f"run dir {run_dir} is {info['note'].split(':')[0]}: nothing of its own runs (state {info['state']})")
        return ExitCode.OK
    if info.get("kind") == "local":
        return cancel_local(info, a.timeout)
    job = info["job_id"]
    if not job or info["state"] in TERMINAL:
        print(f"run '{info['name']}' (job {job}) already ended: {info['state']}")
        return ExitCode.OK
    proc = slurm(["scancel", job])
    if proc.returncode != 0:
        print(f"error: scancel {job} failed: {proc.stderr.strip()}", file=sys.stderr)
        return ExitCode.FAILED
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        sched = scheduler_job(job)
        if sched is None or sched.get("JobState") not in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING",
                                                         "REQUEUED", "SIGNALING"):
            break
        time.sleep(0.5)
    else:
        print(f"warning: job {job} still not ended after {a.timeout:.0f}s", file=sys.stderr)
    if read_status(run_dir).get("state") != "CANCELLED":
        write_status(run_dir, "CANCELLED", message=f"cancelled with launch.py cancel (scancel {job})")
    print(f"cancelled job {job} (run '{info['name']}'); state {describe(run_dir)['state']}")
    return ExitCode.OK


# ------------------------------------------------------------------ cluster.wait=true


def wait_for_job(run_dir: Path, job_id: str, t_command: float) -> int:
    """Stream the job's script log and driver log until it ends; return its result as an exit code.
    Prints the time from the command to the first training step when that step's line appears."""
    logs = run_dir / "logs"
    first_step: list[float] = []

    def on_line(prefix: str, line: str) -> None:
        if prefix and not first_step and STEP_LINE.match(line):
            first_step.append(time.time())
            ev = read_status(run_dir).get("events", {})
            parts = [f"{name} +{ev[name] - t_command:.1f}s" for name in ("started", "ray_ready") if name in ev]
            print(f"grpo-launcher: first training step {first_step[0] - t_command:.1f}s after the command"
                  + (f" (job started / Ray ready at: {', '.join(parts)})" if parts else ""), flush=True)

    print(f"waiting for job {job_id} (Ctrl-C stops waiting, not the job)", flush=True)
    try:
        st = follow(run_dir, [("", Tail(logs / f"slurm-{job_id}.out")), ("[driver] ", Tail(logs / f"driver-{job_id}.log"))],
                    on_line=on_line)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {job_id} keeps running: python launch.py cancel {job_id}", file=sys.stderr)
        return ExitCode.INTERRUPTED
    state, _ = effective_state(st, scheduler_job(job_id))
    print(f"job {job_id} ended: {state}" + (f" — {st['message']}" if st.get("message") else ""), flush=True)
    if state == "COMPLETED":
        return ExitCode.OK
    return int(st.get("exit_code") or ExitCode.FAILED) if state != "CANCELLED" else ExitCode.INTERRUPTED
