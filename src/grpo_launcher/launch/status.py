"""Machine-readable run status: `<run_dir>/status.json`, written atomically (temp file + rename).

Written by the launcher (SUBMITTED) and by the sbatch script
(`python -m grpo_launcher.launch.status RUN_DIR STATE --job-id N [--exit-code C] [--message M] [--event E]`);
read by `launch.py status|logs|cancel`, which also ask Slurm (`scontrol`/`squeue`; there is no `sacct`
on the local cluster) and reconcile the two: the script cannot write anything once SIGKILLed. submitit's job
watcher is not used here: it reads sacct alone (JobID, State, NodeList), none of Reason, Restarts or StdOut;
instead the submitit launchers' jobs are watched through `scheduler_job` (hydra_plugins/.../submitit_points.py).

status.json keys: name, state, job_id, job_ids (every id this run dir has had), run_dir, submitted,
updated, exit_code, message, restarts (SLURM_RESTART_COUNT of the latest start), events (epoch seconds
of the latest start's phases: started, ray_ready). HUNG (driver exit 4): a wait passed its deadline; the message
is the driver's summary of it. The driver's current phase is in RUN_DIR/phase.json (deadlines.py), a file
of its own: the driver never races this one's writers; `phase_line` reads it for `launch.py status`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

from ..deadlines import read_phase
from ..tracking.metric_names import TIME_STEP_S

STATES = ("SUBMITTED", "RUNNING", "REQUEUED", "COMPLETED", "FAILED", "CANCELLED", "STOPPED", "HUNG")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "STOPPED", "HUNG")
# Slurm job states after which nothing more happens (REQUEUED/PREEMPTED may come back as PENDING)
SLURM_TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                  "DEADLINE", "REVOKED", "SPECIAL_EXIT")
SLURM_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "PREEMPTED", "RESV_DEL_HOLD")


def write_status(run_dir: Path, state: str, /, reset: bool = False, **fields: object) -> dict:
    """Merge `fields` into status.json; `reset` (a new submission) keeps only the job id history."""
    run_dir = Path(run_dir)
    current = read_status(run_dir)
    if reset:
        current = {"job_ids": current.get("job_ids", [])}
    event = fields.pop("event", None)
    if state == "HUNG" and not fields.get("message"):  # the driver's summary: which phase, which step
        fields["message"] = read_phase(run_dir).get("hung")
    if fields.get("restarts") is not None or event == "started":  # a new start (a resume, a requeue): the previous
        # start's phase times, exit code and message no longer apply
        current["events"] = {}
        current.pop("exit_code", None)
        current.pop("message", None)
    current.update({k: v for k, v in fields.items() if v is not None})
    if fields.get("job_id") is not None:
        ids = [str(i) for i in current.get("job_ids", [])]
        if str(fields["job_id"]) not in ids:
            current["job_ids"] = [*ids, str(fields["job_id"])]
    if event:
        current.setdefault("events", {})[str(event)] = round(time.time(), 3)
    current.update(state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    tmp = run_dir / f".status.json.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(current, indent=1) + "\n")
        os.replace(tmp, run_dir / "status.json")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (28, 122):  # ENOSPC, EDQUOT
            raise OSError(exc.errno, f"no space left on device writing {run_dir / 'status.json'} "
                          f"({_free_mib(run_dir)})") from exc
        raise
    return current


def _free_mib(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


def read_status(run_dir: Path) -> dict:
    path = Path(run_dir) / "status.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError:  # never expected (atomic writes), but never fatal for a reader
        return {}


def phase_line(run_dir: Path, st: dict, state: str) -> Optional[str]:
    """'update (step 12) for 3.4 s, deadline 300 s': what the driver of the current start waits for now."""
    rec = read_phase(run_dir)
    since, started = rec.get("since"), (st.get("events") or {}).get("started", 0)
    if not isinstance(since, (int, float)) or since < started or state not in ("RUNNING", "HUNG"):
        return None  # none yet, or a previous start's
    where = f"{rec.get('phase')} (step {rec.get('step')})"
    if state == "HUNG" or rec.get("hung"):
        return f"{where}: passed its deadline of {rec.get('deadline_s')} s (hung)"
    limit = rec.get("deadline_s")
    return f"{where} for {time.time() - since:.1f} s" + (f", deadline {limit:g} s" if limit else ", no deadline")


def timing_line(run_dir: Path, st: dict, state: str, step: Optional[str], queued: bool = False) -> Optional[str]:
    """'elapsed 0:05:12 (this start); eta 0:01:40 (48 steps left at 2.08 s/step, the mean of the last 10)': the
    time since the latest start (status.json's events; to its end once ended), and for a live run the steps left
    (`step` 'N/M') at the recent step time (time/step_s of RUN_DIR/metrics.jsonl's last steps). A requeued job
    back in Slurm's queue (`queued`) is not live: no running clock, no ETA."""
    events = st.get("events") or {}
    started = events.get("started")
    if not isinstance(started, (int, float)):
        return None
    live = state in ("RUNNING", "REQUEUED") and not queued
    end = time.time() if live else events.get("ended") or _epoch(st.get("updated"))
    if not isinstance(end, (int, float)) or end < started:
        return None
    def hms(seconds: float) -> str:
        return str(datetime.timedelta(seconds=round(seconds)))

    line = f"elapsed {hms(end - started)} ({'this start' if live else 'the last start, to its end'})"
    m = re.fullmatch(r"(\d+)/(\d+)", step or "")
    times = recent_step_seconds(Path(run_dir))
    if live and m and times:
        left = max(int(m.group(2)) - int(m.group(1)), 0)
        per = sum(times) / len(times)
        line += f"; eta {hms(left * per)} ({left} steps left at {per:.3g} s/step, the mean of the last {len(times)})"
    return line


def _epoch(text: object) -> Optional[float]:
    try:
        return time.mktime(time.strptime(str(text), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def recent_step_seconds(run_dir: Path, n: int = 10) -> list[float]:
    """time/step_s of the last n steps in RUN_DIR/metrics.jsonl (a resumed step: its last line)."""
    per_step: dict[int, float] = {}
    try:
        lines = (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
            per_step[int(rec["step"])] = float(rec[TIME_STEP_S])
        except (ValueError, KeyError, TypeError):
            continue
    return [per_step[k] for k in sorted(per_step)[-n:]]


# ------------------------------------------------------------------ what Slurm says


def slurm_env() -> dict[str, str]:
    """The local cluster's conf when /etc/slurm/slurm.conf is absent (scripts/local-slurm.sh writes both)."""
    env = dict(os.environ)
    if "SLURM_CONF" not in env and not Path("/etc/slurm/slurm.conf").exists():
        conf = Path(os.environ.get("GRPO_SLURM_DIR", "/tmp/grpo-slurm")) / "slurm.conf"
        if conf.exists():
            env["SLURM_CONF"] = str(conf)
    return env


def slurm(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=slurm_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(args, 127, "", str(exc))


def scheduler_job(job_id: str) -> Optional[dict[str, str]]:
    """`scontrol show job` as {key: value} (None when Slurm no longer knows the job: MinJobAge passed)."""
    proc = slurm(["scontrol", "show", "job", str(job_id)])
    if proc.returncode != 0 or "JobId=" not in proc.stdout:
        return None
    info: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        line = line.strip()
        key = line.split("=", 1)[0]
        if key in ("StdOut", "StdErr", "StdIn", "WorkDir", "Command", "Comment", "Reason"):
            info[key] = line.split("=", 1)[1] if "=" in line else ""  # these values may contain spaces
            continue
        for m in re.finditer(r"(\w[\w:/]*)=(\S*)", line):
            info.setdefault(m.group(1), m.group(2))
    return info


def jobs_named(name: str) -> list[str]:
    proc = slurm(["squeue", "-h", "-n", name, "-o", "%i"])
    return [j for j in proc.stdout.split() if j.isdigit()] if proc.returncode == 0 else []


def effective_state(status: dict, sched: Optional[dict[str, str]]) -> tuple[str, str]:
    """(state, note): status.json reconciled with Slurm's view of the job."""
    mine = status.get("state", "UNKNOWN")
    if sched is None:
        if mine in TERMINAL:
            return mine, ""
        if mine == "SUBMITTED" and not status.get("job_id"):
            return mine, ""
        return "UNKNOWN", f"Slurm no longer knows job {status.get('job_id')}; last recorded state {mine}"
    theirs = sched.get("JobState", "UNKNOWN")
    if mine in TERMINAL and theirs not in ("PENDING", "CONFIGURING"):  # the script recorded its end
        return mine, f"slurm: {theirs}"
    if theirs in ("PENDING", "CONFIGURING"):
        reason = sched.get("Reason", "")
        return ("REQUEUED" if mine == "REQUEUED" or sched.get("Restarts", "0") != "0" else "PENDING"), \
            f"slurm: {theirs} ({reason})" if reason and reason != "None" else f"slurm: {theirs}"
    if theirs in ("RUNNING", "COMPLETING"):
        return ("REQUEUED" if mine == "REQUEUED" else "RUNNING"), f"slurm: {theirs}"
    if theirs in SLURM_TERMINAL:
        if theirs == "COMPLETED" and mine not in TERMINAL:
            return "FAILED", "slurm: COMPLETED, but the script never recorded an end state"
        return ("CANCELLED" if theirs == "CANCELLED" else mine if mine in TERMINAL else "FAILED"), f"slurm: {theirs}"
    return mine, f"slurm: {theirs}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("state", choices=STATES)
    ap.add_argument("--job-id")
    ap.add_argument("--exit-code", type=int)
    ap.add_argument("--message")
    ap.add_argument("--restarts", type=int)
    ap.add_argument("--event")
    a = ap.parse_args()
    write_status(a.run_dir, a.state, job_id=a.job_id, exit_code=a.exit_code, message=a.message,
                 restarts=a.restarts, event=a.event)
    if a.state in TERMINAL and a.job_id:  # the job is done with its run dir: a new launch may take it
        from .rundir import release_run_lock  # rundir asks this module about Slurm: the cycle stays inside functions

        release_run_lock(a.run_dir, job_id=a.job_id)


if __name__ == "__main__":
    main()
