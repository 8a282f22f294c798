"""Tracker against a real sqlite MLflow store in tmp_path; the train-data log on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_launcher.checkpoint.manager import spec_as_dict
from grpo_launcher.spec.schema import LoggingSpec, RunSpec
from grpo_launcher.tracking import FIELDS, TrainDataLog
from grpo_launcher.tracking.mlflow_tracker import Tracker, flat_params, git_commit


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def spec(name: str = "run-a") -> RunSpec:
    return RunSpec(name=name, logging=LoggingSpec(experiment="exp-test"))


def test_new_run_logs_params_tags_and_spec(tmp_path, uri):
    s = spec()
    t = Tracker(s, uri, tmp_path / "run")
    run = t.client.get_run(t.run_id)
    assert run.info.run_name == "run-a" and run.info.status == "RUNNING"
    assert run.data.params["train.lr"] == str(s.train.lr)
    assert run.data.params["train.backend"] == "torch"  # enum as its value
    assert run.data.params["env.gym_config_paths"] == "[]"  # list as a string
    assert run.data.params["rollout.max_new_tokens"] == str(s.rollout.max_new_tokens)  # '..._tokens' is not a secret
    assert run.data.tags.get("mlflow.source.git.commit") == git_commit()
    assert [a.path for a in t.client.list_artifacts(t.run_id)] == ["spec.yaml"]
    assert run.info.artifact_uri.startswith(tmp_path.as_uri())  # not ./mlruns in the cwd
    assert "train/reward_mean" in run.data.tags["mlflow.note.content"]  # the run page says what to read first
    t.close()
    assert t.client.get_run(t.run_id).info.status == "FINISHED"


def test_experiment_opens_in_the_training_view(tmp_path, uri):
    t = Tracker(spec(), uri, tmp_path / "run")  # a new experiment: tagged at creation
    assert t.client.get_experiment(t.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    t.close()
    import mlflow

    old = mlflow.MlflowClient(uri).create_experiment("made-by-hand")  # an untagged experiment gets the tag
    t2 = Tracker(RunSpec(name="run-b", logging=LoggingSpec(experiment="made-by-hand")), uri, tmp_path / "run-b")
    assert t2.client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    t2.close()


def test_flatten_redacts_secret_keys():
    flat = flat_params({"a": {"hf_token": "abc", "api_key": "x", "db_password": "p", "key": "k",
                              "client_secret": "s", "max_new_tokens": 16, "names": ["A", "B"]}})
    assert flat["a.hf_token"] == flat["a.api_key"] == flat["a.db_password"] == "***"
    assert flat["a.key"] == flat["a.client_secret"] == "***"
    assert flat["a.max_new_tokens"] == "16" and flat["a.names"] == '["A", "B"]'
    assert "***" not in flat_params(spec_as_dict(RunSpec())).values()  # no schema key looks secret, unset ones shown
    assert flat_params({"rollout": {"http_api_key": None}})["rollout.http_api_key"] == "None"
    flat = flat_params({"logging": {"tracking_uri": "postgresql://ml:hunter2@db:5432/mlflow?token=abc&x=1"}})
    assert flat["logging.tracking_uri"] == "postgresql://ml:***@db:5432/mlflow?token=***&x=1"


def test_metrics_buffered_until_commit(tmp_path, uri):
    t = Tracker(spec(), uri, tmp_path / "run")
    t.log_metrics(1, {"train/loss": 1.0, "train/reward_mean": 0.1})
    t.log_metrics(2, {"train/loss": 0.5})
    assert t.metric_history("train/loss") == []
    assert t.commit() == 3
    assert t.metric_history("train/loss") == [(1, 1.0), (2, 0.5)]
    t.close()


def test_unbuffered_and_chunked(tmp_path, uri):
    t = Tracker(spec(), uri, tmp_path / "run", buffer_until_commit=False)
    t.log_metrics(0, {"x": 3.0})
    assert t.metric_history("x") == [(0, 3.0)]
    t.buffer_until_commit = True
    for step in range(1200, 0, -1):  # > one log_batch worth, logged out of order
        t.log_metrics(step, {"y": float(step)})
    t.commit()
    hist = t.metric_history("y")
    assert len(hist) == 1200 and hist[0] == (1, 1.0) and hist[-1] == (1200, 1200.0)
    t.close()


def test_resume_appends_to_same_run_without_gap_or_repeat(tmp_path, uri):
    first = Tracker(spec(), uri, tmp_path / "run")
    for step in (1, 2):
        first.log_metrics(step, {"train/loss": float(step)})
    first.commit()  # checkpoint at step 2
    first.log_metrics(3, {"train/loss": 99.0})  # step 3 never checkpointed: crash
    first.discard()
    first.close("FAILED")
    resumed = Tracker(spec(), uri, tmp_path / "run", run_id=first.run_id)
    assert resumed.run_id == first.run_id
    assert resumed.client.get_run(first.run_id).info.status == "RUNNING"
    for step in (3, 4):
        resumed.log_metrics(step, {"train/loss": float(step)})
    resumed.close()
    assert resumed.metric_history("train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert resumed.client.get_run(first.run_id).info.status == "FINISHED"


def test_parent_run_tag_and_artifact_and_tag(tmp_path, uri):
    parent = Tracker(spec("sweep"), uri, tmp_path / "sweep")
    child = Tracker(spec("trial-0"), uri, tmp_path / "trial", parent_run_id=parent.run_id)
    (tmp_path / "notes.txt").write_text("hi")
    child.log_artifact(tmp_path / "notes.txt")
    child.set_tag("grpo.status", "ok")
    run = child.client.get_run(child.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id and run.data.tags["grpo.status"] == "ok"
    assert {a.path for a in child.client.list_artifacts(child.run_id)} == {"spec.yaml", "notes.txt"}
    with pytest.raises(ValueError):
        child.close("DONE")
    child.close("KILLED")
    parent.close()
    assert child.client.get_run(child.run_id).info.status == "KILLED"


def record(step: int, **overrides) -> dict:
    rec = {f: None for f in FIELDS}
    rec.update(step=step, agent_ref="toy", content="1+1=2", rewards=1.0, token_ids=torch.tensor([5, 6, 7]),
               token_loss_mask=torch.tensor([0, 1, 1]), sample_loss_mask=1.0, advantages=torch.tensor([0.5]),
               generation_logprobs=torch.tensor([-0.25, -0.5]), prev_logprobs=[-0.25, -0.5],
               token_loss=torch.tensor(0.125), truncated=False)
    rec.update(overrides)
    return rec


def test_train_data_log_writes_one_json_per_line(tmp_path):
    log = TrainDataLog(tmp_path / "train_data", every=2)
    assert log.enabled_for(4) and not log.enabled_for(3)
    path = log.write_step(4, [record(4), record(4, rewards=0.0)])
    assert path.name == "train_data_step_000004.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 and set(lines[0]) == set(FIELDS)
    assert lines[0]["token_ids"] == [5, 6, 7] and lines[0]["generation_logprobs"] == [-0.25, -0.5]
    assert lines[0]["token_loss"] == 0.125 and isinstance(lines[1]["rewards"], float)
    assert not list(log.dir.glob("*.partial"))
    log.write_step(4, [record(4)])  # a resumed step rewrites its file
    assert len(path.read_text().splitlines()) == 1


def test_train_data_log_rejects_bad_keys(tmp_path):
    log = TrainDataLog(tmp_path, every=1)
    bad = record(1, extra_field=1)
    del bad["advantages"]
    with pytest.raises(ValueError, match="advantages") as info:
        log.write_step(1, [record(1), bad])
    assert "extra_field" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # neither a final nor a partial file


def test_partial_file_is_not_final(tmp_path):
    log = TrainDataLog(tmp_path, every=1)
    log.write_step(1, [record(1)])
    (tmp_path / "train_data_step_000002.jsonl.partial").write_text('{"step": 2, "cont')  # crash mid-line
    assert log.steps() == [1]
    log.write_step(2, [record(2)])  # the resumed step starts the file over
    assert log.steps() == [1, 2]
    assert json.loads(log.path_for(2).read_text())["step"] == 2


def test_resume_from_an_older_checkpoint_never_logs_a_step_twice(tmp_path, uri):
    """The newest checkpoint was invalid, the run fell back to step 2: steps 3-4 are redone, MLflow already has
    them. A reopened run skips (key, step) pairs MLflow holds; a checkpoint's pending metrics are replayed."""
    first = Tracker(spec(), uri, tmp_path / "run")
    for step in (1, 2, 3, 4):
        first.log_metrics(step, {"train/loss": float(step)})
    first.commit()
    first.close("FAILED")
    resumed = Tracker(spec(), uri, tmp_path / "run", run_id=first.run_id)
    for step in (3, 4, 5):
        resumed.log_metrics(step, {"train/loss": 10.0 + step})
    assert resumed.commit() == 1  # only step 5 was new
    assert resumed.replay([["train/loss", 6.0, 0, 6], ["train/loss", 99.0, 0, 5]]) == 1  # 6 new, 5 known
    assert [s for s, _ in resumed.metric_history("train/loss")] == [1, 2, 3, 4, 5, 6]
    resumed.close()


# ------------------------------------------------------------------ TensorBoard (logging.tensorboard=true)


def test_tensorboard_log_buffers_until_commit_and_never_writes_a_step_twice(tmp_path):
    """Steps 1..3 committed, 4 left uncommitted (a crash); a reopened log (a resume from the checkpoint of step 2,
    as after an invalid newest one) logs 3..5 again: every step once, the committed values kept."""
    from grpo_launcher.tracking.tensorboard_log import TensorBoardLog, read_scalars

    tb = TensorBoardLog(tmp_path)
    for step in (1, 2, 3):
        tb.log_metrics(step, {"train/reward_mean": step / 10, "val/reward_mean": step / 20}, 1000.0 + step)
    assert read_scalars(tmp_path) == {}  # nothing before commit
    assert tb.commit() == 6
    tb.log_metrics(4, {"train/reward_mean": 0.4}, 1004.0)
    assert tb.pending() == [["train/reward_mean", 0.4, 1004000, 4]]
    tb.discard()
    tb.close()
    tb = TensorBoardLog(tmp_path)
    for step in (3, 4, 5):
        tb.log_metrics(step, {"train/reward_mean": step / 10 + 1}, 2000.0 + step)
    assert tb.commit() == 2  # 4 and 5
    tb.close()
    got = read_scalars(tmp_path)
    assert [s for s, _ in got["train/reward_mean"]] == [1, 2, 3, 4, 5]
    assert [round(v, 3) for _, v in got["train/reward_mean"]] == [0.1, 0.2, 0.3, 1.4, 1.5]
    assert [s for s, _ in got["val/reward_mean"]] == [1, 2, 3]


def test_trackers_without_mlflow_answer_mlflow_calls_with_nothing(tmp_path):
    from grpo_launcher.tracking.tensorboard_log import TensorBoardLog
    from grpo_launcher.tracking.trackers import Trackers

    t = Trackers(None, [TensorBoardLog(tmp_path)])
    t.log_metrics(1, {"train/reward_mean": 0.5})
    assert t.run_id is None and t.set_tag("grpo.hung", "x") is None
    assert t.replay(t.pending()) == 1  # a checkpoint's pending metrics, replayed on resume
    t.close("FAILED")
