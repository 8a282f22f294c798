"""hydra/launcher=submitit_slurm|submitit_local (hydra-submitit-launcher's convention): every point checked first,
each point one submitit job running the run on its node, its run dir output_root/name as for any run.

    no marker         : the refusals (multi-node or multi-task points, cluster=slurm inside a point, no -m), a dry run
    slurm             : the one real end-to-end run: a 2-point submitit_slurm sweep of the tiny CPU run finishes
    slurm+slow+ext.   : a point's job scancel'ed: the sweep ends (exit 1, the job named), it does not wait forever;
                        Ctrl-C stops the waiting (exit 130) and names the jobs, which go on
    slow+extended     : submitit_local, one point: the run ran in the job's own process
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_launcher.launch.status import read_status
from helpers import LAUNCH_PY, job_state, launch, share_models, tiny_model, wait_until
from integration.test_sweeps import runs_of
from integration.test_slurm_run import HAVE_SLURM, cluster, jobs, sh  # noqa: F401  (module fixtures)

SHORT = ["grpo.max_steps=1", "grpo.val_period=1", "checkpoint.save_period=1"]


# ------------------------------------------------------------------ for real


def run_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.name.startswith("tiny-grpo"))


def submitit_jobs(root: Path) -> list[str]:
    """The points' job ids: a Slurm array's tasks (JOB_I; JOB holds the submission), a local job's process id."""
    names = sorted(d.name for d in root.glob("multirun/*/.submitit/*") if re.fullmatch(r"\d+(_\d+)?", d.name))
    return [n for n in names if "_" in n] or names


@pytest.mark.slurm
@pytest.mark.skipif(not HAVE_SLURM, reason="Slurm not installed: bash scripts/local-slurm.sh install")
def test_2_point_submitit_slurm_sweep_runs_each_point_in_its_job(cluster, jobs, tmp_path):  # noqa: F811
    share_models(tmp_path)
    tiny_model()  # built once here, not inside the jobs
    try:
        p = launch("-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "train.lr=1e-4,3e-4",
                   f"output_root={tmp_path}", *SHORT, timeout=600)
    finally:
        jobs.extend(submitit_jobs(tmp_path))  # scancel'ed at the module's end if still alive
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "Submitit 'slurm' sweep output dir" in out and "Bypassing sacct" not in out and "Traceback" not in out
    dirs = run_dirs(tmp_path)
    assert [d.name for d in dirs] == ["tiny-grpo_train.lr=0.0001", "tiny-grpo_train.lr=0.0003"]
    for d in dirs:
        steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps and max(steps) == 1, steps
        assert '"status": "FINISHED"' in (d / "summary.json").read_text()
        assert read_status(d)["state"] == "COMPLETED"
        assert re.search(rf"^  {re.escape(d.name)}\s+COMPLETED", p.stdout, re.M), p.stdout[-2000:]
    runs = runs_of(tmp_path)  # the sweep's MLflow parent run, made here; the jobs' runs are its children
    (parent,) = [r for r in runs if r.info.run_name.startswith("sweep-")]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert len(jobs) == 2  # array tasks, each ran its run: the job's own log names its run
    for job in jobs:
        assert re.search(r"JobName=tiny-grpo$", sh(["scontrol", "show", "job", job]).stdout, re.M)  # the runs' name
        (log,) = tmp_path.glob(f"multirun/*/.submitit/{job}/{job}_0_log.out")
        assert re.search(r"grpo-launcher: run 'tiny-grpo_train\.lr=0\.000[13]' \(local\)", log.read_text())


def start_long_point(tmp_path) -> subprocess.Popen:
    """A one-point submitit_slurm sweep of a 500-step run (long enough to act on while its job runs)."""
    share_models(tmp_path)
    tiny_model()
    return subprocess.Popen([sys.executable, str(LAUNCH_PY), "-m", "hydra/launcher=submitit_slurm",
                             "grpo.max_steps=500", f"output_root={tmp_path}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def point_job(tmp_path, cancel_after: list) -> str:
    (job,) = wait_until(lambda: submitit_jobs(tmp_path), 120, "the point's job submitted")
    cancel_after.append(job)  # the `jobs` fixture's list: what is left is cancelled
    return job


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(not HAVE_SLURM, reason="Slurm not installed: bash scripts/local-slurm.sh install")
def test_a_cancelled_point_job_ends_the_sweep_naming_it(cluster, jobs, tmp_path):  # noqa: F811
    proc = start_long_point(tmp_path)
    try:
        job = point_job(tmp_path, jobs)
        wait_until(lambda: [d for d in run_dirs(tmp_path) if read_status(d).get("state") == "RUNNING"], 300,
                   "the run started in its job")
        assert sh(["scancel", job]).returncode == 0
        out, _ = proc.communicate(timeout=180)  # submitit's own watcher asks sacct, which this cluster lacks
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert proc.returncode == 1, out[-3000:]
    assert f"error: a sweep point's job failed or ended without a result: Job {job}" in out and "CANCELLED" in out
    assert "Traceback" not in out


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(not HAVE_SLURM, reason="Slurm not installed: bash scripts/local-slurm.sh install")
def test_ctrl_c_stops_the_waiting_and_names_the_jobs_that_go_on(cluster, jobs, tmp_path):  # noqa: F811
    proc = start_long_point(tmp_path)
    try:
        job = point_job(tmp_path, jobs)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert proc.returncode == 130 and f"to stop them: scancel {job.partition('_')[0]}" in out, out[-2000:]
    assert "Traceback" not in out and job_state(job) in ("PENDING", "RUNNING")  # the job goes on (module end: scancel)


@pytest.mark.slow
@pytest.mark.extended
def test_submitit_local_point_runs_in_its_own_process(tmp_path):
    p = launch("-m", "hydra/launcher=submitit_local", "grpo.seed=3", f"output_root={share_models(tmp_path)}", *SHORT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    (job,) = submitit_jobs(tmp_path)  # a local job's id is its process's id
    (d,) = run_dirs(tmp_path)
    assert d.name == "tiny-grpo" and (d / "metrics.jsonl").exists() and read_status(d)["state"] == "COMPLETED"
    (log,) = tmp_path.glob(f"multirun/*/.submitit/{job}/{job}_0_log.out")  # the run ran in the job's process
    assert "grpo-launcher: run 'tiny-grpo' (local)" in log.read_text()
