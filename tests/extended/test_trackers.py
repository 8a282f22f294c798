"""Trackers beside MLflow and an MLflow store that goes away (issue 31): W&B through the real `wandb` package, offline,
read back from its own transaction logs (run-<id>.wandb); an http MLflow store (a real `mlflow server` on loopback)
killed mid-run and started again: the run finishes and the server ends up with every step."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import LAUNCH_PY, launch, share_models, wait_until
from unit.test_trackers import offline_wandb  # noqa: F401  (fixtures)

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "rollout.max_new_tokens=6", "grpo.max_val_samples=8", "grpo.val_period=1", "checkpoint.save_period=1"]


def sqlite_metrics(db: Path) -> dict[str, list[tuple[int, float]]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT key, step, value FROM metrics").fetchall()
    out: dict[str, list[tuple[int, float]]] = {}
    for key, step, value in sorted(rows):
        out.setdefault(key, []).append((step, value))
    return out


# ------------------------------------------------------------------------------------ W&B through launch.py


@pytest.mark.slow
@pytest.mark.extended  # make test's W&B run through launch.py is the http-store test below; this one is two more
def test_wandb_offline_run_matches_mlflow_and_tensorboard_across_a_stop_and_resume(tmp_path, offline_wandb):
    """`launch.py logging.wandb=true logging.tensorboard=true`, stopped after step 1 (checkpoint.must_save_by=0:
    exit 3), then the same command resumes and finishes step 2: one W&B run id (two offline-run directories, one per
    start), holding every MLflow metric of steps 1 and 2 once, same names and values; TensorBoard the same."""
    from grpo_launcher.tracking.tensorboard_log import read_scalars
    from grpo_launcher.tracking.wandb_log import RUN_ID_FILE, read_history

    share_models(tmp_path)
    args = [*SMALL, f"output_root={tmp_path}", "name=wb", "grpo.max_steps=2", "logging.wandb=true",
            "logging.tensorboard=true", "checkpoint.must_save_by=00:00:00",
            f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    r = launch(*args, cwd=tmp_path)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    run_id = (tmp_path / "wb" / "wandb" / RUN_ID_FILE).read_text().strip()
    assert f"wandb sync {tmp_path.resolve()}/wb/wandb/offline-run-*-{run_id}" in r.stdout
    r = launch(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "wandb:" not in r.stdout  # wandb's own chatter stays off our output
    runs = sorted(p.name for p in (tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in name for name in runs), runs
    wb, tb = read_history(tmp_path / "wb" / "wandb"), read_scalars(tmp_path / "wb" / "tensorboard")
    mlflow = sqlite_metrics(tmp_path / "mlflow.db")
    assert set(wb) == set(mlflow) == set(tb) and "train/reward_mean" in wb and "val/reward_mean" in wb
    for key, points in mlflow.items():
        assert [s for s, _ in wb[key]] == [s for s, _ in points] == [1, 2], key
        assert [v for _, v in wb[key]] == pytest.approx([v for _, v in points], rel=1e-6), key


# ----------------------------------------------------------------------- an http MLflow store that goes away


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_server(tmp_path: Path, port: int, log) -> subprocess.Popen:
    """A real `mlflow server` on loopback (its own process group: its workers stop with it)."""
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--artifacts-destination",
           str(tmp_path / "server-artifacts"), "--workers", "1"]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def up(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we started (start_new_session): the server and its workers
    proc.wait(timeout=60)


def metrics_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.extended  # a fault case (78 s): make test-all; make test keeps the trackers' plain runs
def test_an_http_mlflow_store_killed_mid_run_and_restarted_loses_nothing(tmp_path, offline_wandb):
    """The server is SIGKILLed after step 2 and started again once the run has warned: the run finishes (exit 0),
    says the store came back, and the server's store holds every step of metrics.jsonl, each once. The run also
    logs to W&B (logging.wandb=true, offline): the same names, steps and values as the server's store."""
    from grpo_launcher.tracking.wandb_log import read_history

    share_models(tmp_path)
    port, log = free_port(), open(tmp_path / "server.log", "ab")
    server = mlflow_server(tmp_path, port, log)
    run = None
    try:
        wait_until(lambda: up(port), 120, "mlflow server's /health")
        out = open(tmp_path / "run.log", "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}  # the defaults: 3 retries
        run = subprocess.Popen([sys.executable, str(LAUNCH_PY), *SMALL, f"output_root={tmp_path}", "name=away",
                                "grpo.max_steps=6", f"logging.tracking_uri=http://127.0.0.1:{port}",
                                "logging.wandb=true"],
                               cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        run_dir = tmp_path / "away"
        wait_until(lambda: metrics_steps(run_dir) >= 2 or run.poll() is not None, 600, "step 2")
        assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        stop(server)
        wait_until(lambda: "unreachable" in (tmp_path / "run.log").read_text() or run.poll() is not None, 300,
                   "the run's warning")
        server = mlflow_server(tmp_path, port, log)
        wait_until(lambda: up(port), 120, "the restarted mlflow server")
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if run is not None and run.poll() is None:
            run.kill()
            run.wait(timeout=60)
        stop(server)
    text = (tmp_path / "run.log").read_text()
    assert f"WARNING: MLflow store http://127.0.0.1:{port} unreachable" in text, text[-3000:]
    assert f"MLflow store http://127.0.0.1:{port} is back" in text, text[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    server_metrics = sqlite_metrics(tmp_path / "server.db")
    assert [s for s, _ in server_metrics["train/reward_mean"]] == [1, 2, 3, 4, 5, 6]
    for line in lines:
        step = line["step"]
        for key, value in line.items():
            if isinstance(value, float) and key != "step":
                assert (step, pytest.approx(value, rel=1e-6)) in server_metrics.get(key, []), (key, step)
    assert all(len({s for s, _ in v}) == len(v) for v in server_metrics.values())  # every (key, step) once
    wb = read_history(run_dir / "wandb")
    assert set(wb) == set(server_metrics)
    for key, points in server_metrics.items():
        assert [s for s, _ in wb[key]] == [s for s, _ in points], key
        assert [v for _, v in wb[key]] == pytest.approx([v for _, v in points], rel=1e-6), key


@pytest.mark.slow
@pytest.mark.extended  # a second mlflow server (~40 s here); make test has the kill-and-restart run above
def test_a_store_that_stays_away_leaves_the_metrics_pending_and_close_returns(tmp_path, monkeypatch, capsys):
    """The Tracker against a real server that is then killed: a commit sends nothing, warns once with the cause,
    keeps the metrics pending (what the next checkpoint records); a tag is a warning, not an error; close() gives up
    after CLOSE_WAIT_S with a warning instead of waiting forever."""
    from grpo_launcher.spec.schema import RunSpec
    from grpo_launcher.tracking import mlflow_tracker
    from grpo_launcher.tracking.mlflow_tracker import Tracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(mlflow_tracker, "CLOSE_WAIT_S", 1.0)
    monkeypatch.setattr(mlflow_tracker, "CLOSE_RETRY_S", 0.2)
    port, log = free_port(), open(tmp_path / "server.log", "ab")
    server = mlflow_server(tmp_path, port, log)
    try:
        wait_until(lambda: up(port), 120, "mlflow server's /health")
        t = Tracker(RunSpec(), f"http://127.0.0.1:{port}", tmp_path)
        t.log_metrics(1, {"train/reward_mean": 0.5})
        assert t.commit() == 1
    finally:
        stop(server)
    t.log_metrics(2, {"train/reward_mean": 0.6, "train/loss": 0.1})
    assert t.commit() == 0
    assert sorted(p[3] for p in t.pending()) == [2, 2]
    t.set_tag("grpo.hung", "x")
    t.close()
    err = capsys.readouterr().err
    assert f"MLflow store http://127.0.0.1:{port} unreachable (MlflowException: " in err, err
    assert err.count("(MlflowException") == 1 and err.count("2 metric value(s) (step 2) kept") == 1, err  # once
    assert f"MLflow run {t.run_id} not closed: its store stayed unreachable for 1 s; 2 metric value(s) not sent" in err
