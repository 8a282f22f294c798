"""A second hostile tester's faults through `python launch.py`, each real (tests/unit/test_faults_hostile.py holds
the quick cases): the checkpoint dir remounted read-only mid-run (a real EROFS in the save), then the resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from helpers import LAUNCH_PY, share_models, tiny_model, wait_until
from mlflow.tracking import MlflowClient
from unit.test_faults_at_start import ROOT_ONLY

from grpo_launcher.spec.schema import RunSpec
from grpo_launcher.tracking import Tracker


@ROOT_ONLY
@pytest.mark.slow
@pytest.mark.extended
def test_a_checkpoint_dir_made_read_only_mid_run_ends_in_one_message_then_resumes(tmp_path):
    """After step_000010 is saved the checkpoint dir is bind-mounted read-only: the save of step 20 fails with
    EROFS. Before: rc 1 and a 25-line traceback ending in the OSError. Now one message naming the file, the last
    checkpoint and the fix; metrics.jsonl whole lines; the MLflow run FAILED; the resume (writable again) ends
    with every step in MLflow once."""
    share_models(tmp_path)
    run = tmp_path / "ro"
    args = [sys.executable, str(LAUNCH_PY), f"output_root={tmp_path}", "name=ro", "grpo.max_steps=30",
            "logging.progress=false"]
    ckpts = run / "checkpoints"
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mounted = False
    try:
        metrics = run / "metrics.jsonl"
        wait_until(lambda: metrics.is_file() and metrics.read_bytes().count(b"\n") >= 12 or proc.poll() is not None,
                   600, "step 12 in metrics.jsonl", poll=0.05)
        assert proc.poll() is None, proc.communicate()
        subprocess.run(["mount", "--bind", str(ckpts), str(ckpts)], check=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ckpts)], check=True)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted:
            subprocess.run(["umount", str(ckpts)], check=True)
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"grpo-launcher: Read-only file system: {ckpts}/.tmp-step_000020-" in err, err[-3000:]
    assert f"last checkpoint: {ckpts}/step_000010" in err and "marked FAILED" in err and "make it writable" in err
    assert all(json.loads(line) for line in metrics.read_text().splitlines())
    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "resuming from step_000010" in again.stdout, again.stderr[-3000:]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (r,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert r.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "train/reward_mean")) == list(range(1, 31))


@pytest.mark.slow
@pytest.mark.extended
def test_a_model_dir_deleted_after_the_launch_is_named(tmp_path):
    """model.path deleted once the plan is printed (before the workers load it): the run ends naming the model dir
    and the fix. Before: 'policy rank 0 died ... OSError: Repo id must be in the form ...' (transformers' hub error)."""


    model = tmp_path / "model"
    shutil.copytree(tiny_model(), model)
    args = [sys.executable, str(LAUNCH_PY), f"output_root={tmp_path}", f"model.path={model}", "grpo.max_steps=2",
            "logging.progress=false"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the plan's last lines come before the workers start
            if line.startswith("run dir"):
                shutil.rmtree(model)
                break
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and not model.exists(), out[-2000:] + err[-3000:]
    assert f"grpo-launcher: the model dir {model} is gone (no config.json)" in err, err[-3000:]
    assert "restore it (model.path), then launch the same command again" in err


@pytest.mark.slow
@pytest.mark.extended
def test_a_sigterm_while_ray_starts_is_a_stop_not_exit_15_or_a_hang(tmp_path):
    """SIGTERM to the launcher while ray.init runs (its session dir made, ray.init not returned) met Ray's own
    handler (sys.exit(15)): the run ended with exit 15, no message, status.json FAILED 'SystemExit: 15'; or, raised
    in a finalizer holding logging's lock, it was swallowed and the driver waited for ever (imports.join()). Now the
    driver's stop, as after ray.init: step 1, its checkpoint, exit 143, status STOPPED, Ray's processes gone."""


    share_models(tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's AF_UNIX socket paths
    args = [sys.executable, str(LAUNCH_PY), f"output_root={tmp_path}", "grpo.max_steps=2", "logging.progress=false"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RAY_TMPDIR=str(ray_tmp)), start_new_session=True)
    try:
        wait_until(lambda: (ray_tmp / "ray" / "session_latest").exists() or proc.poll() is not None, 300,
                   "Ray's session dir", poll=0.02)
        proc.send_signal(signal.SIGTERM)  # the launcher only
        out, err = proc.communicate(timeout=600)
    finally:
        left = [p for p in psutil.process_iter() if p.pid != proc.pid and _sid(p.pid) == proc.pid]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 143, (proc.returncode, out[-2000:], err[-6000:])
    assert "grpo-launcher: stopped after step 1 (SIGTERM); checkpoint saved" in out, out[-3000:] + err[-3000:]
    assert json.loads((tmp_path / "tiny-grpo" / "status.json").read_text())["state"] == "STOPPED"
    try:
        wait_until(lambda: not any(p.is_running() for p in left), 120, "Ray's processes to end")
    finally:
        for p in left:  # by PID, should the wait have failed
            if p.is_running():
                p.kill()


def _sid(pid: int) -> int:

    try:
        return os.getsid(pid)
    except OSError:
        return -1


@pytest.mark.slow
@pytest.mark.extended
def test_a_frozen_http_store_holds_a_commit_minutes_not_a_quarter_hour(tmp_path):
    """A live `mlflow server`, then frozen (SIGSTOP: it accepts connections and never answers, as an overloaded or
    stuck server does): a checkpoint's commit waited MLflow's 120 s read timeout × 4 tries (~8 min per checkpoint,
    no message). Now 30 s a try (MLFLOW_HTTP_REQUEST_TIMEOUT unless the user set it): ~2 min, then the buffer's
    warning naming the read timeout; the value is kept for the next commit."""


    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 's.db'}",
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                               "--artifacts-destination", str(tmp_path / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              cwd=tmp_path)
    env_before = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT")
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    return True
            except OSError:
                return server.poll() is not None

        wait_until(healthy, 180, "mlflow server's /health")
        assert server.poll() is None
        tracker = Tracker(RunSpec(), f"http://127.0.0.1:{port}", tmp_path)
        tracker.log_metrics(1, {"train/x": 1.0})
        assert tracker.commit() == 1
        os.killpg(server.pid, signal.SIGSTOP)  # the server's own session: it and its workers
        tracker.log_metrics(2, {"train/x": 2.0})
        t0 = time.monotonic()
        assert tracker.commit() == 0 and tracker.pending()
        took = time.monotonic() - t0
        assert took < 200, took  # 4 tries × 30 s + backoff; was ~8 min
        tracker.discard()  # an abort (a second Ctrl-C during this commit): the run's end does not wait again
        t0 = time.monotonic()
        tracker.close("FAILED")
        assert time.monotonic() - t0 < 5  # was: set_terminated's own 4 tries, then CLOSE_WAIT_S
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        if env_before is None:
            os.environ.pop("MLFLOW_HTTP_REQUEST_TIMEOUT", None)
