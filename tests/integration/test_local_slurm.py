"""Tests against the real local two-node Slurm cluster (nodes n1, n2 on this host).

Bring the cluster up first:  bash scripts/local-slurm.sh install && bash scripts/local-slurm.sh start
Skipped only when Slurm is not installed (no `sinfo` on PATH); if it is installed but the cluster is
down, the tests fail and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from grpo_launcher.launch.status import slurm_env

from helpers import job_state

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("sinfo") is None,
        reason="Slurm not installed (no sinfo on PATH): bash scripts/local-slurm.sh install",
    ),
]

NODES = ("n1", "n2")
START_HINT = "run `bash scripts/local-slurm.sh start`"
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED",
}





def _run(args: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=slurm_env())
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{args} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return proc


@pytest.fixture(scope="module")
def cluster() -> None:
    """Fail (not skip) when Slurm is installed but the local cluster is not up."""
    try:
        proc = _run(["sinfo", "-N", "-h", "-o", "%N %t"], timeout=20, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"sinfo timed out: local Slurm cluster not responding; {START_HINT}")
    if proc.returncode != 0:
        pytest.fail(
            f"sinfo failed (rc={proc.returncode}): {proc.stderr.strip()}\n"
            f"local Slurm cluster is down; {START_HINT}"
        )
    states = dict(line.split()[:2] for line in proc.stdout.splitlines() if line.strip())
    bad = {n: states.get(n, "missing") for n in NODES
           if states.get(n, "missing").rstrip("*~#!%$@^-") not in ("idle", "mix", "alloc")}
    if bad:
        pytest.fail(f"Slurm nodes not up: {bad} (sinfo: {states}); {START_HINT}")


def _sbatch(args: list[str]) -> str:
    out = _run(["sbatch", "--parsable", *args]).stdout.strip()
    job_id = out.split(";")[0]
    assert job_id.isdigit(), f"unexpected sbatch output: {out!r}"
    return job_id


def _wait_state(job_id: str, wanted: set[str], timeout: float, poll: float = 0.5) -> str:
    """Poll until the job reaches one of `wanted` (or any terminal state); return it."""
    deadline = time.monotonic() + timeout
    state = job_state(job_id)
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in wanted or state in TERMINAL_STATES:
            return state
        time.sleep(poll)
    queue = _run(["squeue", "-j", job_id, "-h", "-o", "%i %T %R"], check=False).stdout.strip()
    detail = _run(["scontrol", "show", "job", job_id], check=False).stdout
    raise AssertionError(
        f"job {job_id} not in {sorted(wanted)} after {timeout:.0f}s: state={state}, "
        f"squeue: {queue or '(not listed)'}\n{detail}"
    )


def _cancel_quietly(job_id: str) -> None:
    try:
        _run(["scancel", job_id], check=False)
    except Exception:
        pass


def test_two_node_job_runs_on_n1_and_n2(cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "nodes.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "srun bash -c 'echo \"node=$SLURMD_NODENAME task=$SLURM_PROCID\"'\n"
    )
    job_id = _sbatch([
        "--job-name=grpo-test-2node", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
        "--time=5", f"--chdir={tmp_path}", f"--output={out}", str(script),
    ])
    try:
        state = _wait_state(job_id, {"COMPLETED"}, timeout=120)
    finally:
        if job_state(job_id) not in TERMINAL_STATES:
            _cancel_quietly(job_id)
    text = out.read_text() if out.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {job_id} ended {state}; output:\n{text}"
    nodes = sorted(re.findall(r"node=(\S+)", text))
    assert nodes == ["n1", "n2"], f"expected one step task on each of n1, n2; output:\n{text}"


@pytest.mark.extended  # make test: test_slurm_run.py cancels a real GRPO job
def test_scancel_ends_running_job(cluster: None, tmp_path: Path) -> None:
    job_id = _sbatch([
        "--job-name=grpo-test-cancel", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
        "--time=15", f"--chdir={tmp_path}", f"--output={tmp_path / 'sleep.out'}",
        "--wrap", "sleep 600",
    ])
    try:
        state = _wait_state(job_id, {"RUNNING"}, timeout=60)
        assert state == "RUNNING", f"job {job_id} ended {state} before it could be cancelled"
        _run(["scancel", job_id])
        state = _wait_state(job_id, {"CANCELLED"}, timeout=60)
        assert state == "CANCELLED", f"job {job_id} ended {state}, expected CANCELLED"
        assert _run(["squeue", "-h", "-j", job_id, "-t", "RUNNING"], check=False).stdout.strip() == ""
    finally:
        if job_state(job_id) not in TERMINAL_STATES:
            _cancel_quietly(job_id)
