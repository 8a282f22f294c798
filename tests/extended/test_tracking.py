"""Tracker against a real sqlite MLflow store in tmp_path; the train-data log on real files."""

from __future__ import annotations


import pytest


@pytest.mark.slow
@pytest.mark.extended  # make test keeps the unit test above on real event files; this one is two more Ray runs
def test_tensorboard_event_files_match_mlflow_across_a_stop_and_resume(tmp_path):
    """`launch.py logging.tensorboard=true`, stopped after step 1 (checkpoint.must_save_by=0: exit 3), then the same
    command resumes and finishes step 2: the event files hold every MLflow metric of steps 1 and 2 once, same names,
    same values."""
    import sqlite3

    from helpers import launch, share_models
    from grpo_launcher.tracking.tensorboard_log import read_scalars

    share_models(tmp_path)
    args = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
            "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
            "rollout.max_new_tokens=6", "grpo.max_val_samples=8", "grpo.val_period=1", "checkpoint.save_period=1",
            f"output_root={tmp_path}", "name=tb", "grpo.max_steps=2", "logging.tensorboard=true",
            "checkpoint.must_save_by=00:00:00", f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    r = launch(*args, cwd=tmp_path)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"tensorboard --logdir {tmp_path.resolve()}/tb/tensorboard" in r.stdout
    r = launch(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tb = read_scalars(tmp_path / "tb" / "tensorboard")
    assert len(list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per start
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        rows = db.execute("SELECT key, step, value FROM metrics").fetchall()
    mlflow: dict[str, list[tuple[int, float]]] = {}
    for key, step, value in sorted(rows):
        mlflow.setdefault(key, []).append((step, value))
    assert set(tb) == set(mlflow) and "train/reward_mean" in tb and "val/reward_mean" in tb
    for key, points in mlflow.items():
        assert [s for s, _ in tb[key]] == [s for s, _ in points] == [1, 2], key
        assert [v for _, v in tb[key]] == pytest.approx([v for _, v in points], rel=1e-6), key
