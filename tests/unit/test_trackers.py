"""Trackers beside MLflow and an MLflow store that goes away (issue 31): W&B through the real `wandb` package, offline,
read back from its own transaction logs (run-<id>.wandb); an http MLflow store (a real `mlflow server` on loopback)
killed mid-run and started again: the run finishes and the server ends up with every step."""

from __future__ import annotations


import pytest


@pytest.fixture
def offline_wandb(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


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
