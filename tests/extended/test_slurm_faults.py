"""Faults on the real local Slurm cluster (issue 12): every way a job can be stopped leaves status.json
agreeing with Slurm, and the next start resumes from the newest valid checkpoint with every MLflow step
exactly once; two launches of one run at once: one job, the other refused naming it.

    scancel                → CANCELLED (Slurm and status.json); resubmitting resumes; steps 1..N once
    scontrol requeue       → REQUEUED (status.json) while Slurm says PENDING; the restart resumes; once
    a node set DOWN        → Slurm requeues the job (NODE_FAIL); after the node is back it resumes; once
Waits are conditions with generous timeouts (a loaded 2-core machine); every job is scancel'ed at the end.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from grpo_launcher.launch.status import read_status
from helpers import ROOT, job_state, wait_until
from integration.test_slurm_run import (HAVE_SLURM, PY, cluster, jobs, launch_py, mlflow_steps,  # noqa: F401
                            release_requeued, root, sh, slurm_env, submit)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.extended,  # make test: test_slurm_run.py's requeue
              pytest.mark.skipif(not HAVE_SLURM, reason="Slurm not installed: bash scripts/local-slurm.sh install")]

STEPS = 16
ARGS = (f"grpo.max_steps={STEPS}", "grpo.val_period=0", "grpo.val_at_end=false",
        "checkpoint.metric=train/reward_mean", "checkpoint.save_period=4")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def driver_reached(run_dir: Path, job: str, step: int) -> bool:
    log = run_dir / "logs" / f"driver-{job}.log"
    if not log.exists():
        return False
    return any(int(m.group(1)) >= step for m in re.finditer(rf"^step (\d+)/{STEPS}", log.read_text(), re.M))


def finished(run_dir: Path, job: str, timeout: float = 900) -> None:
    state = wait_until(lambda: (s := job_state(job)) in ENDED and s, timeout, f"job {job} to end")
    slurm_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", slurm_log[-3000:]
    assert read_status(run_dir)["state"] == "COMPLETED"


def each_step_once(root: Path, run_dir: Path) -> None:
    for key in ("train/reward_mean", "train/loss"):
        steps, _ = mlflow_steps(root, run_dir, key)
        assert sorted(steps) == list(range(1, STEPS + 1)), (key, steps)


def status_json(root: Path, name: str) -> dict:
    return json.loads(launch_py("status", name, "--root", str(root), "--json").stdout)


def test_scancel_mid_run_then_resubmit_resumes_each_step_once(cluster, jobs, root):
    name = "h12-scancel"
    run_dir = root / name
    job, _, _ = submit(root, jobs, name, *ARGS)
    wait_until(lambda: driver_reached(run_dir, job, 6), 900, "the driver at step 6")
    sh(["scancel", job]).check_returncode()
    wait_until(lambda: job_state(job) == "CANCELLED", 180, "Slurm: CANCELLED")
    wait_until(lambda: read_status(run_dir).get("state") == "CANCELLED", 120, "status.json: CANCELLED")
    assert status_json(root, name)["state"] == "CANCELLED"  # status.json and Slurm agree
    wait_until(lambda: sh(["squeue", "-h", "-j", job]).stdout.strip() == "", 180, "the job's processes to be gone")
    job2, _, _ = submit(root, jobs, name, *ARGS)  # the cancelled job no longer holds the run
    finished(run_dir, job2)
    driver2 = (run_dir / "logs" / f"driver-{job2}.log").read_text()
    assert re.search(r"resuming from step_0000(0[4-9]|1\d)", driver2), driver2[-2000:]
    each_step_once(root, run_dir)


def test_scontrol_requeue_mid_run_resumes_and_status_agrees(cluster, jobs, root):
    name = "h12-requeue"
    run_dir = root / name
    job, _, _ = submit(root, jobs, name, *ARGS)
    wait_until(lambda: driver_reached(run_dir, job, 6), 900, "the driver at step 6")
    sh(["scontrol", "requeue", job]).check_returncode()
    wait_until(lambda: job_state(job) in ("PENDING", "REQUEUED", "CONFIGURING", "RUNNING")
               and read_status(run_dir).get("state") == "REQUEUED", 180, "status.json: REQUEUED")
    if job_state(job) == "PENDING":
        assert status_json(root, name)["state"] == "REQUEUED"  # not CANCELLED while Slurm says PENDING
    release_requeued(job)
    finished(run_dir, job)
    st = read_status(run_dir)
    assert st["restarts"] == 1
    driver = (run_dir / "logs" / f"driver-{job}.log").read_text()
    assert "resuming from step_" in driver
    each_step_once(root, run_dir)


def foreign_jobs(mine: list[str]) -> list[str]:
    out = sh(["squeue", "-h", "-o", "%i"]).stdout.split()
    return [j for j in out if j not in mine]


def test_node_down_requeues_and_resumes(cluster, jobs, root):
    name = "h12-node-down"
    run_dir = root / name
    job, _, _ = submit(root, jobs, name, *ARGS)
    wait_until(lambda: driver_reached(run_dir, job, 6), 900, "the driver at step 6")
    others = foreign_jobs(jobs)
    if others:
        pytest.skip(f"setting n2 down would kill jobs this test did not start: {others}")
    try:
        sh(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=h12-node-down-test"]).check_returncode()
        wait_until(lambda: job_state(job) in ("PENDING", "REQUEUED"), 240, "Slurm to requeue the job (node failure)")
    finally:
        sh(["scontrol", "update", "NodeName=n2", "State=RESUME"])
    wait_until(lambda: re.search(r"^n2 (idle|mix|alloc)", sh(["sinfo", "-N", "-h", "-o", "%N %t"]).stdout, re.M),
               180, "n2 back")
    wait_until(lambda: read_status(run_dir).get("state") in ("REQUEUED", "RUNNING", "FAILED"), 120, "status")
    assert status_json(root, name)["state"] in ("REQUEUED", "PENDING", "RUNNING")
    release_requeued(job)
    finished(run_dir, job)
    assert "resuming from step_" in (run_dir / "logs" / f"driver-{job}.log").read_text()
    each_step_once(root, run_dir)


def test_two_launches_at_once_one_job_other_refused_naming_it(cluster, jobs, root):
    name = "h12-twice"
    cmd = [PY, str(ROOT / "launch.py"), "cluster=local_slurm", f"output_root={root}", f"name={name}", *ARGS]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm_env(),
                              cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    ids = [m.group(1) for out, _ in outs if (m := re.search(r"submitted job (\d+)", out))]
    jobs.extend(ids)
    assert len(ids) == 1, outs
    (refused,) = [err for (out, err), p in zip(outs, procs) if p.returncode != 0]
    assert re.search(rf"already in use by (Slurm job {ids[0]} |a submission in progress \(launcher pid \d+\))",
                     refused), refused
    lock = json.loads((root / name / ".run.lock").read_text())
    assert lock["job_id"] == ids[0]
    again = launch_py("cluster=local_slurm", f"output_root={root}", f"name={name}", *ARGS)
    assert again.returncode == 1 and f"already in use by Slurm job {ids[0]} (" in again.stderr
    sh(["scancel", ids[0]])
    wait_until(lambda: job_state(ids[0]) in ENDED, 180, "the job to end")


def test_percent_in_output_root_job_logs_where_expected(cluster, jobs, tmp_path):
    """A `%` in the run dir: sbatch/srun would expand it (%j, %x...) and write the logs nowhere to be found."""
    root = tmp_path / "pct%j%x"
    root.mkdir()
    from helpers import MODEL_CACHE

    (root / ".models").symlink_to(MODEL_CACHE)
    job, _, _ = submit(root, jobs, "h12-pct", "grpo.max_steps=2", *ARGS[1:4])
    run_dir = root / "h12-pct"
    wait_until(lambda: job_state(job) in ENDED, 900, f"job {job} to end")
    slurm_log = run_dir / "logs" / f"slurm-{job}.out"
    assert slurm_log.exists(), sorted(str(p) for p in tmp_path.rglob("*.out"))
    assert job_state(job) == "COMPLETED", slurm_log.read_text()[-3000:]
    assert (run_dir / "logs" / f"driver-{job}.log").exists()
