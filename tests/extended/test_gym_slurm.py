"""env=nemo_gym on the local Slurm cluster (scripts/local-slurm.sh): the job's driver step starts NeMo Gym's
servers on the head node over the engines' published URLs, trains through Gym's agents, and Gym is stopped
by PID when the job ends, however it ends (the driver's own stop, else launch/job.sh's stop_gym).

Needs Slurm (`bash scripts/local-slurm.sh start`) and `make gym`; skipped, saying which, without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_launcher.gym.install import find_install
from grpo_launcher.launch.status import read_status, slurm_env

from helpers import MODEL_CACHE, ROOT, job_state, wait_until  # noqa: E402
from unit.test_nemo_gym import GYM  # noqa: E402  (the tiny Gym setup: math + a tool-calling env)

PY = sys.executable
LIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED")

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.gym,
    pytest.mark.extended,  # make test: test_nemo_gym.py trains through Gym, test_slurm_run.py runs GRPO on Slurm
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="Slurm not installed: bash scripts/local-slurm.sh install"),
    pytest.mark.skipif(find_install() is None, reason="NeMo Gym's venv is not installed: run `make gym`"),
]
SLURM_GYM = ["cluster=local_slurm", "cluster.nodes=1", *GYM]


def sh(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=slurm_env())


def gym_processes(workdir: Path) -> list[int]:
    """PIDs of live processes whose working directory is the run's Gym dir (`gym env start` and its servers)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")) == workdir:
                    state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        out.append(int(proc.name))
            except OSError:
                continue
    return out


@pytest.fixture
def root(tmp_path):
    """An output root whose tiny model comes from the persistent test cache (built here once, not in the job)."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    (tmp_path / ".models").symlink_to(MODEL_CACHE)
    from grpo_launcher.gym.env import GymEnv
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.train.setup import prepare_model

    spec = load_spec([*SLURM_GYM, f"output_root={tmp_path}", "dry_run=true"])
    prepare_model(spec, make_plan(spec), GymEnv(spec.env, seed=spec.grpo.seed))
    return tmp_path


def cancel_jobs(run_dir: Path) -> None:
    """scancel every job of the run that is still alive, and wait for it to end."""
    ids = (run_dir / "job_ids").read_text().split() if (run_dir / "job_ids").exists() else []
    for job in ids:
        if job_state(job) in LIVE:
            sh(["scancel", job])
    for job in ids:
        try:
            wait_until(lambda: job_state(job) not in LIVE, 120, f"job {job} to end")
        except AssertionError:
            pass


def launch(root: Path, name: str, *extra: str) -> subprocess.Popen:
    cmd = [PY, "-u", str(ROOT / "launch.py"), *SLURM_GYM, f"output_root={root}", f"name={name}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=slurm_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"launch.py did not return within {timeout:.0f} s; output:\n{out[-3000:]}")
    return out


def test_gym_trains_in_a_slurm_job_and_is_stopped_by_pid(root):
    """python launch.py env=nemo_gym ... cluster=local_slurm: Gym on the head node, two steps, Gym gone after."""
    name = "h14-gym-slurm"
    run_dir = root / name
    proc = launch(root, name, "cluster.wait=true", "grpo.max_steps=2", "grpo.num_prompts_per_step=4",
                  "grpo.num_generations_per_prompt=4", "train.global_batch_size=16", "train.micro_batch_size=16",
                  "train.logprob_batch_size=16", "grpo.val_period=2", "logging.train_data_log=true",
                  "logging.progress=false")
    try:
        out = finish(proc, 2400)
    finally:
        cancel_jobs(run_dir)
    job = re.search(r"submitted job (\d+)", out)
    assert job, out[-3000:]
    job = job.group(1)
    driver = (run_dir / "logs" / f"driver-{job}.log").read_text()
    assert proc.returncode == 0 and f"job {job} ended: COMPLETED" in out, out[-3000:] + driver[-3000:]
    assert re.search(r"NeMo Gym ready at http://127\.0\.0\.1:\d+ on Slurm node n1 ", driver), driver[-3000:]
    assert re.search(r"NeMo Gym stopped; \d+ rollouts, 0 failed", driver), driver[-3000:]
    lines = [json.loads(x) for x in next(run_dir.rglob("train_data_step_000002.jsonl")).read_text().splitlines()]
    assert len(lines) == 16
    assert {x["agent_ref"] for x in lines} <= {"math_with_judge_simple_agent", "example_single_tool_call_simple_agent"}
    for x in lines:
        assert len(x["token_ids"]) == len(x["token_loss_mask"]) == len(x["generation_logprobs"])
        assert sum(x["token_loss_mask"]) > 0
    metrics = [json.loads(x) for x in next(run_dir.rglob("metrics.jsonl")).read_text().splitlines()]
    assert [m for m in metrics if m["step"] == 2][-1]["gym/failed_rollouts"] == 0
    assert read_status(run_dir)["state"] == "COMPLETED"
    assert not (run_dir / "gym" / "gym.pid").exists(), "Gym was stopped by PID"
    assert gym_processes(run_dir / "gym") == []


def test_cancelled_gym_job_leaves_no_gym_running(root):
    """scancel while Gym serves: the job ends and nothing of Gym's is left on the head node."""
    name = "h14-gym-slurm-cancel"
    run_dir = root / name
    proc = launch(root, name, "grpo.max_steps=500")
    try:
        out = finish(proc, 300)
        job = re.search(r"submitted job (\d+)", out)
        assert proc.returncode == 0 and job, out[-3000:]
        job = job.group(1)
        log = run_dir / "logs" / f"driver-{job}.log"
        wait_until(lambda: log.exists() and "NeMo Gym ready" in log.read_text(), 900, "NeMo Gym up in the job")
        pids = gym_processes(run_dir / "gym")
        assert pids, "Gym's processes run in the run's Gym dir"
        sh(["scancel", job]).check_returncode()
        wait_until(lambda: job_state(job) not in LIVE, 240, f"job {job} to end")
        t0 = time.monotonic()
        wait_until(lambda: not gym_processes(run_dir / "gym"), 120, "Gym's processes to be gone")
        assert time.monotonic() - t0 < 120
        assert read_status(run_dir)["state"] == "CANCELLED"
    finally:
        cancel_jobs(run_dir)
