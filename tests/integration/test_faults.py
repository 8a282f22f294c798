"""Faults and security (issue 12), on real files, real processes and real signals.

Fast tier: checkpoint verification (truncated / missing / overwritten files, bad or missing meta.json, a step
beyond max_steps, a crafted pickle that would run code) with fallback to the newest valid checkpoint; secrets
redacted in spec.yaml / plan / MLflow params and kept in 0600 files; the per-run lock (two launches at once:
exactly one wins; a live holder is named; a dead one is taken over); disk-full messages.
Slow tier: a save killed with SIGKILL at every phase boundary, then resumed: MLflow has every step exactly once;
the real driver signalled with SIGTERM / SIGINT / SIGUSR1 after ray.init(): it checkpoints the step it was on
and exits 143 / 130 / 3, and the resumed run logs every step exactly once; the driver SIGKILLed after a step
leaves none of its processes (train/reaper.py), nor does a run's ordinary end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from grpo_launcher.checkpoint import verify_checkpoint

from helpers import ROOT, share_models, wait_until
from unit.test_faults import PY


# ------------------------------------------------------------------ kill at every phase boundary of a save

MINI_LOOP = r"""
import sys
from pathlib import Path
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.train.setup import resume_or_start

spec = load_spec(sys.argv[1:])
plan = make_plan(spec)
plan.run_dir.mkdir(parents=True, exist_ok=True)
state = resume_or_start(spec, plan)
for step in range(state.step + 1, spec.grpo.max_steps + 1):
    state.log(step, {"train/x": float(step), "train/y": 2.0 * step})
    if step % spec.checkpoint.save_period == 0 or step == spec.grpo.max_steps:
        state.save_checkpoint(step, lambda d: (d / "policy.bin").write_bytes(b"w" * 64), {"train/x": float(step)})
state.finish("FINISHED")
print("done at", state.step)
"""
PHASES = ["after:payload", "after:meta", "after:manifest", "after:fsync", "after:rename", "after:prune",
          "after:unlist", "after:strip", "after:commit"]  # unlist, strip: tests/unit/test_checkpoint.py's strip test


def mlflow_steps(uri: str, name: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("h12-faults")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, key))


@pytest.mark.slow
@pytest.mark.parametrize("phase", [p if p == "after:rename" else pytest.param(p, marks=pytest.mark.extended)
                                   for p in PHASES])  # make test: the phase whose checkpoint is in place, unfinished
def test_kill_at_every_save_phase_then_resume_logs_each_step_once(tmp_path, phase):
    name = f"h12-kill-{phase.split(':')[1]}"
    args = [f"output_root={tmp_path}", f"name={name}", "grpo.max_steps=6", "checkpoint.save_period=2", "grpo.val_period=2",
            "logging.experiment=h12-faults", "logging.progress=false"]
    env = dict(os.environ, GRPO_FAULT_AT=f"{phase}@4")
    first = subprocess.run([PY, "-c", MINI_LOOP, *args], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    env.pop("GRPO_FAULT_AT")
    second = subprocess.run([PY, "-c", MINI_LOOP, *args], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "done at 6" in second.stdout, second.stderr[-2000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for key in ("train/x", "train/y"):
        assert mlflow_steps(uri, name, key) == [1, 2, 3, 4, 5, 6], (phase, key, second.stdout)
    resumed_from = re.search(r"resuming from step_(\d+)", second.stdout)
    visible = phase not in ("after:payload", "after:meta", "after:manifest", "after:fsync")  # step 4's was in place
    assert resumed_from and int(resumed_from.group(1)) == (4 if visible else 2), second.stdout
    if visible and phase != "after:commit":
        assert "replayed" in second.stdout  # its metrics came from the checkpoint, not from a second run


# ------------------------------------------------------------------ the real driver, real signals


def run_cmd(tmp_path: Path, name: str, steps: int, *extra: str) -> list[str]:
    share_models(tmp_path)
    return [PY, "-u", str(ROOT / "launch.py"), f"output_root={tmp_path}", f"name={name}", f"grpo.max_steps={steps}",
            "checkpoint.save_period=1000", "grpo.val_period=0", "grpo.val_at_end=false", "checkpoint.metric=train/reward_mean",
            "logging.experiment=h12-faults", "logging.progress=true", *extra]


@pytest.mark.slow
@pytest.mark.extended  # make test: test_golden_run.py stops a run with SIGTERM (launch.py cancel) and resumes it
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 3)],
                         ids=["SIGTERM", "SIGINT", "SIGUSR1"])
def test_driver_signal_after_ray_init_saves_and_exits_with_its_code(tmp_path, sig, code):
    name = f"h12-sig-{sig.name.lower()}"
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(run_cmd(tmp_path, name, 40), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    try:
        m = wait_until(lambda: re.search(r"^step (\d+)/40", log.read_text(), re.M) or proc.poll() is not None,
                       900, "the first step")  # Ray start-up on a loaded 2-core machine: minutes
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(sig)  # the driver's pid only (Ray's processes are not signalled)
        rc = proc.wait(timeout=600)
        text = log.read_text()
        assert rc == code, text[-3000:]
        stopped = int(re.search(rf"stopped after step (\d+) \({sig.name}\); checkpoint saved", text).group(1))
        assert stopped >= int(m.group(1)) and stopped < 40
        ckpts = sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir())
        assert ckpts == [f"step_{stopped:06d}"], ckpts
        assert verify_checkpoint(tmp_path / name / "checkpoints" / ckpts[0]) is None
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "KILLED" and summary["step"] == stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the resumed run (fewer steps left) starts at stopped + 1, and MLflow has each step once
    total = stopped + 2
    again = subprocess.run(run_cmd(tmp_path, name, total), capture_output=True, text=True, cwd=ROOT, timeout=1200,
                           start_new_session=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from step_{stopped:06d}" in again.stdout
    steps = mlflow_steps(f"sqlite:///{tmp_path / 'mlflow.db'}", name, "train/reward_mean")
    assert steps == list(range(1, total + 1))


def descendants(pid: int) -> dict[tuple[int, float], str]:
    """{(pid, create time): command line} of pid's live descendants."""
    found = {}
    try:
        for p in psutil.Process(pid).children(recursive=True):
            try:
                found[(p.pid, p.create_time())] = " ".join(p.cmdline())
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return found


def alive(recorded) -> list[psutil.Process]:
    """The recorded (pid, create time) processes still running (a zombie has ended; a reused pid is another)."""
    procs = []
    for pid, create_time in recorded:
        try:
            p = psutil.Process(pid)
            if p.create_time() == create_time and p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except psutil.Error:
            continue
    return procs


def kill_alive(proc: subprocess.Popen, recorded) -> None:
    """What a test started, by PID: the driver, then the recorded processes still running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for p in alive(recorded):
        try:
            p.kill()
        except psutil.Error:
            continue


@pytest.mark.slow
def test_driver_killed_with_sigkill_leaves_no_ray_process(tmp_path):
    """kill -9 of the driver (the OOM killer's way): Ray's gcs_server and raylet die with it, but Ray's dashboard and
    runtime-env agents hung in their exit for ever (Ray 2.60). The reaper (train/reaper.py) ends them: none of the
    driver's processes is left within a bound (the reaper's grace, 5 s, and start-up on a loaded machine)."""
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(run_cmd(tmp_path, "h12-kill9", 200, "logging.mlflow=false"), stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    recorded: dict[tuple[int, float], str] = {}
    try:
        wait_until(lambda: re.search(r"^step \d+/200", log.read_text(), re.M) or proc.poll() is not None, 900,
                   "the first step")
        assert proc.poll() is None, log.read_text()[-3000:]
        recorded = descendants(proc.pid)
        assert any("ray::DashboardAgent" in c for c in recorded.values()), recorded  # what used to be left
        assert any("grpo_launcher.train.reaper" in c for c in recorded.values()), recorded
        proc.kill()  # the driver's pid only, as the OOM killer
        proc.wait()
        wait_until(lambda: not alive(recorded), 60, "the killed driver's processes to end")
    finally:
        kill_alive(proc, recorded)


# ------------------------------------------------------------------ a run that diverges
@pytest.mark.slow
def test_a_diverged_run_stops_failed_and_checkpoints_no_nan(tmp_path):
    """train.lr=1e12 blows the weights up in step 1's update: step 2's rollout logprobs are NaN. The run stops there
    (exit 1, the cause named, status FAILED) instead of training on and finishing 0 with a NaN model. Its end (Ray
    shut down) leaves none of its processes (Ray's, the reaper of train/workers.py start_reaper) behind."""
    name = "h12-diverged"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(run_cmd(tmp_path, name, 6, "train.lr=1e12", "logging.mlflow=false"), stdout=fo,
                                stderr=fe, cwd=ROOT, start_new_session=True)
    seen: dict[tuple[int, float], str] = {}
    try:  # every process of the run, sampled while it runs
        wait_until(lambda: seen.update(descendants(proc.pid)) or proc.poll() is not None, 900, "the run's end")
        stdout, stderr = out.read_text(), err.read_text()
        assert proc.returncode == 1, stdout[-2000:] + stderr[-3000:]
        assert any("ray::DashboardAgent" in c for c in seen.values()), seen  # Ray ran here
        assert any("grpo_launcher.train.reaper" in c for c in seen.values()), seen
        wait_until(lambda: not alive(seen), 30, "the run's processes to end")
    finally:
        kill_alive(proc, seen)
    assert "error: step 2: the rollout's logprobs are NaN" in stderr and "Traceback" not in stderr
    assert "finished at step" not in stdout and "step 3/6" not in stdout
    summary = json.loads((tmp_path / name / "status.json").read_text())
    assert summary["state"] == "FAILED", summary


# ------------------------------------------------------------------ MLflow switched off for one start, then on
TOGGLE_LOOP = MINI_LOOP.replace(
    'state.log(step, {"train/x": float(step), "train/y": 2.0 * step})',
    'state.log(step, {"train/x": float(step), "train/y": 2.0 * step})\n'
    '    append_metrics(plan.run_dir / "metrics.jsonl", step, {"train/x": float(step), "train/y": 2.0 * step})'
).replace("from grpo_launcher.train.setup import resume_or_start",
          "from grpo_launcher.train.setup import resume_or_start\nfrom grpo_launcher.train.driver import append_metrics")


@pytest.mark.extended  # 3 more starts with MLflow (CI's time); make test: the golden run's MLflow run across a resume
def test_mlflow_off_for_one_start_then_on_keeps_one_run_with_every_step(tmp_path):
    """Steps 1..3 with MLflow, 4..5 with logging.mlflow=false, 6..7 with it again: the checkpoints of the start
    without MLflow kept no run id, so the third start made a new MLflow run holding 6..7 only (4..5 in none).
    Now one run holds 1..7, the steps logged while it was off sent from metrics.jsonl."""
    name = "h12-toggle"
    base = [f"output_root={tmp_path}", f"name={name}", "checkpoint.save_period=1", "grpo.val_period=1",
            "logging.experiment=h12-faults", "logging.progress=false"]
    for steps, extra in ((3, []), (5, ["logging.mlflow=false"]), (7, [])):
        r = subprocess.run([PY, "-c", TOGGLE_LOOP, *base, f"grpo.max_steps={steps}", *extra], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and f"done at {steps}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "steps 1..5 in metrics.jsonl that MLflow run" in r.stdout, r.stdout
    assert mlflow_steps(f"sqlite:///{tmp_path / 'mlflow.db'}", name, "train/x") == [1, 2, 3, 4, 5, 6, 7]
