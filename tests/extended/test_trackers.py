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

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "rollout.max_new_tokens=6", "grpo.max_val_samples=8", "grpo.val_period=1", "checkpoint.save_period=1"]


@pytest.fixture
def offline_wandb(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def sqlite_metrics(db: Path) -> dict[str, list[tuple[int, float]]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT key, step, value FROM metrics").fetchall()
    out: dict[str, list[tuple[int, float]]] = {}
    for key, step, value in sorted(rows):
        out.setdefault(key, []).append((step, value))
    return out


# ------------------------------------------------------------------------------------------------- W&B (unit)


def test_wandb_log_buffers_until_commit_and_a_reopened_run_never_logs_a_step_twice(tmp_path, offline_wandb):
    """Steps 1..3 committed, 4 left uncommitted (a crash); the reopened log (a resume from step 2's checkpoint)
    logs 3..5 again: the same run id, every step once, the committed values kept, read back from wandb's files."""
    from grpo_launcher.spec.schema import RunSpec
    from grpo_launcher.tracking.wandb_log import WANDB_DIR, WandbLog, read_history

    w = WandbLog(RunSpec(), tmp_path)
    for step in (1, 2, 3):
        w.log_metrics(step, {"train/reward_mean": step / 10, "val/reward_mean": step / 20}, 1000.0 + step)
    assert w.commit() == 6
    w.log_metrics(4, {"train/reward_mean": 0.4}, 1004.0)
    assert w.pending() == [["train/reward_mean", 0.4, 1004000, 4]]
    w.discard()
    w.close("FAILED")
    first_id = w.run.id
    w = WandbLog(RunSpec(), tmp_path)
    for step in (3, 4, 5):
        w.log_metrics(step, {"train/reward_mean": step / 10 + 1}, 2000.0 + step)
    assert w.replay([["train/reward_mean", 9.0, 0, 2]]) == 2  # known (2) skipped; 3 known, 4 and 5 sent
    w.close()
    assert w.run.id == first_id
    runs = sorted((tmp_path / WANDB_DIR).glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(first_id) or p.name.endswith(f"{first_id}-1") for p in runs)
    got = read_history(tmp_path / WANDB_DIR)
    assert got["train/reward_mean"] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 1.4), (5, 1.5)]
    assert got["val/reward_mean"] == [(1, 0.05), (2, 0.1), (3, 0.15)]


def test_wandb_mode_is_offline_unless_the_environment_says_otherwise(offline_wandb):
    from grpo_launcher.tracking.wandb_log import wandb_mode

    assert wandb_mode() == "offline"
    offline_wandb.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None  # wandb reads WANDB_MODE itself
    offline_wandb.delenv("WANDB_MODE")
    offline_wandb.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() is None  # a key: wandb's default (online)


def test_a_project_name_wandb_refuses_is_a_config_error(launch_here, tmp_path, offline_wandb):
    r = launch_here(tmp_path, "logging.wandb=true", "logging.experiment=team/rl", "dry_run=true")
    assert r.returncode == 2
    assert "  - logging.wandb, logging.experiment: W&B refuses the project from logging.experiment" in r.stderr
    offline_wandb.setenv("WANDB_PROJECT", "a#b")
    r = launch_here(tmp_path, "logging.wandb=true", "dry_run=true")
    assert r.returncode == 2 and "  - logging.wandb, WANDB_PROJECT: W&B refuses the project" in r.stderr


def test_a_missing_wandb_package_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
    import importlib.util

    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.spec.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        load_spec(["logging.wandb=true", f"output_root={tmp_path}"])
    found = [v for v in info.value.violations if v.rule == "trackers_installed"]
    assert found and found[0].keys == ("logging.wandb",) and "`wandb` package is not installed" in found[0].message


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
