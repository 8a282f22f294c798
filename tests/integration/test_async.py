"""Async GRPO (grpo.async_grpo.*; train/async_loop.py): the plan and the rules (fast), the age bound and the
versions in the train-data log (fast), then real runs through launch.py (slow): the bound held and recorded per
sample, a stop and resume exact on the step axis, an async run that learns, and rollout=vllm's async engine with
in-flight weight updates (requests interrupted and resumed on the new weights)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import share_models, tiny_model, wait_until

from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.train.async_loop import InFlight, RolloutBuffer, StaleTrajectory

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ["grpo.async_grpo.enabled=true", "cluster.cpu_workers_per_node=2", "cluster.rollout_devices=1"]
IS_TIS = ["loss.importance_sampling_correction=true", "loss.is_truncation=tis", "loss.is_threshold=2"]


# ------------------------------------------------------------------ plan, rules, the bound (fast)


def test_async_plan_gives_the_engine_its_own_slot():
    plan = make_plan(load_spec(ASYNC))
    assert (plan.world_size, plan.train_devices, plan.rollout_devices, plan.dp_size, plan.rollout_engines) == (
        2, 1, 1, 1, 1)
    assert plan.engine_bundle0 == 1 and plan.async_grpo and plan.max_trajectory_age == 1
    assert not plan.hybrid_rollout and not plan.logprobs_from_update  # off-policy: a separate logprob pass
    sync = make_plan(load_spec(["cluster.cpu_workers_per_node=2"]))
    assert (sync.train_devices, sync.rollout_devices, sync.dp_size, sync.engine_bundle0) == (2, 0, 2, 0)
    assert sync.hybrid_rollout and sync.logprobs_from_update and not sync.async_grpo


def test_async_without_devices_of_its_own_says_how_many():
    with pytest.raises(ConfigError) as info:
        load_spec(["grpo.async_grpo.enabled=true", "cluster.rollout_devices=0"])  # stated: not picked for it
    (v,) = [v for v in info.value.violations if v.rule == "async_grpo_combinations"]
    assert "cluster.rollout_devices" in v.keys and "cluster.cpu_workers_per_node=2" in v.fix


def test_buffer_refuses_a_sample_past_the_bound():
    buf = RolloutBuffer(max_age=2)
    buf.add(InFlight(5, [], [], submitted_version=2))
    with pytest.raises(RuntimeError, match="submitted twice"):
        buf.add(InFlight(5, [], [], submitted_version=2))
    assert buf.take(5).step == 5 and len(buf) == 0
    assert buf.ages([4, 3, 2], trainer_version=4) == [0, 1, 2]
    with pytest.raises(StaleTrajectory, match="3 policy versions old"):
        buf.ages([4, 1], trainer_version=4)
    with pytest.raises(StaleTrajectory):
        buf.ages([5], trainer_version=4)  # newer than the trainer: a bookkeeping error, never trained on
    with pytest.raises(ValueError):
        RolloutBuffer(max_age=0)


def test_train_data_log_records_the_versions_of_every_sample(tmp_path):
    """policy_version / policy_version_last / age per record, the same fields whichever loop wrote them; a count
    that does not match the records writes nothing."""
    from grpo_launcher.tracking import FIELDS, TrainDataLog

    log = TrainDataLog(tmp_path, every=1)
    base = {f: 0 for f in FIELDS if f not in ("policy_version", "policy_version_last", "age")}
    path = log.write_step(5, [dict(base, step=5)] * 3, versions=[(4, 4), (2, 3), (3, 4)])
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["policy_version"], r["policy_version_last"], r["age"]) for r in rows] == [(4, 4, 0), (2, 3, 2),
                                                                                         (3, 4, 1)]
    assert all(tuple(r) == FIELDS for r in rows)
    for versions in ([(4, 4)] * 2, [(4, 4)] * 4):
        with pytest.raises(ValueError, match="policy versions"):
            log.write_step(6, [dict(base, step=6)] * 3, versions=versions)
    assert log.steps() == [5] and not list(tmp_path.glob("*.partial"))
    with pytest.raises(ValueError, match="policy_version"):  # records without them and no versions given
        log.write_step(7, [dict(base, step=7)])


def test_sync_loop_versions_are_the_previous_step():
    from grpo_launcher.train.sources import on_previous_weights

    assert on_previous_weights(7, 3) == [(6, 6)] * 3


def test_separate_hf_engine_records_the_version_it_generated_with():
    """HFRolloutWorker (rollout/versions.py): staged weights change nothing until the next generate call, which
    applies them first and reports their version; update_weights applies at once."""
    import torch

    from grpo_launcher.rollout.hf import HFRolloutWorker

    spec = load_spec(["logging.mlflow=false"])
    model_dir = tiny_model()
    w = HFRolloutWorker(spec, str(model_dir))
    ids = [w.engine.tokenizer("4821>")["input_ids"], w.engine.tokenizer("1234>")["input_ids"]]
    first = w.generate_versioned(ids, 2, seed=1)
    assert first["version"] == 0 and len(first["gens"]) == 4 and first["idle_s"] == 0.0
    assert first["versions"] == [(0, 0)] * 4  # (first, last) per sample: a call in flight is never interrupted
    old = {k: v.clone() for k, v in w.engine.model.state_dict().items()}
    new = {k: v + 0.01 for k, v in old.items()}
    assert w.stage_weights(new, 3) == 3
    name = next(iter(old))
    assert w.version == 0 and torch.equal(w.engine.model.state_dict()[name], old[name])  # not applied yet
    second = w.generate_versioned(ids, 2, seed=1)
    assert second["version"] == 3 and second["versions"] == [(3, 3)] * 4 and torch.equal(w.engine.model.state_dict()[name], new[name])
    assert second["idle_s"] >= 0.0 and second["gen_s"] > 0.0
    w.update_weights(old, 4)  # the queued path: applied when the call runs
    assert w.version == 4 and torch.equal(w.engine.model.state_dict()[name], old[name])
    assert w.generate_versioned(ids, 2, seed=1)["version"] == 4


# ------------------------------------------------------------------ real runs (slow)


def launch(tmp_path: Path, name: str, *overrides: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={share_models(tmp_path)}", f"name={name}",
           "logging.experiment=h17-async", *overrides]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def history(tmp_path: Path, name: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("h17-async")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.slow
@pytest.mark.extended
def test_async_run_learns_within_the_age_bound_and_records_versions(tmp_path):
    """The default task, one step off-policy with the IS correction: reward +0.3 (last 5 steps vs first 5, as the
    sync test; +0.37 measured), no step trained on a sample older than 1 version, every sample's version logged."""
    log = tmp_path / "run.log"
    proc = launch(tmp_path, "h17-learn", *ASYNC, *IS_TIS, "logging.train_data_log=true",
                  "logging.train_data_log_every=25", log=log)
    try:
        rc = proc.wait(timeout=1800)
    finally:
        stop_group(proc)
    assert rc == 0, log.read_text()[-3000:]
    rewards = [v for _, v in history(tmp_path, "h17-learn", "train/reward_mean")]
    assert len(rewards) == 150
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, (first, last)
    ages = history(tmp_path, "h17-learn", "buffer/sample_age_max")
    assert [s for s, _ in ages] == list(range(1, 151)) and max(a for _, a in ages) == 1  # ran ahead, bounded
    depth = history(tmp_path, "h17-learn", "buffer/depth")
    assert max(d for _, d in depth) <= 2  # N + 1 batches in flight at most
    for step in range(25, 151, 25):
        rows = [json.loads(x) for x in (tmp_path / "h17-learn" / "train_data" /
                                        f"train_data_step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 * 8
        assert all(r["age"] == step - 1 - r["policy_version"] and 0 <= r["age"] <= 1 for r in rows)
        assert all(r["policy_version_last"] == r["policy_version"] for r in rows)  # no in-flight updates here


@pytest.mark.slow
@pytest.mark.extended
def test_async_stop_and_resume_is_exact_on_the_step_axis(tmp_path):
    """SIGTERM mid-run with in-flight weight updates: the step finishes, the checkpoint is saved, the batches
    generated ahead are dropped; the resumed run trains each remaining step once (MLflow: 1..8, no repeat)."""
    name, log = "h17-resume", tmp_path / "run.log"
    args = [*ASYNC, "grpo.async_grpo.in_flight_weight_updates=true", "grpo.async_grpo.max_trajectory_age_steps=2",
            "grpo.max_steps=8", "checkpoint.save_period=100", "grpo.val_period=0", "grpo.val_at_end=false",
            "checkpoint.metric=train/reward_mean", "logging.progress=true"]
    proc = launch(tmp_path, name, *args, log=log)
    try:
        wait_until(lambda: re.search(r"^step 2/8", log.read_text(), re.MULTILINE) or proc.poll() is not None, 900,
                   "step 2")
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # the driver only
        rc = proc.wait(timeout=600)
    finally:
        stop_group(proc)
    text = log.read_text()
    assert rc == 143, text[-3000:]
    stopped = int(re.search(r"stopped after step (\d+) \(SIGTERM\); checkpoint saved", text).group(1))
    assert 2 <= stopped < 8
    assert "batch(es) generated ahead" in text  # dropped, not checkpointed
    proc = launch(tmp_path, name, *args, log=log)
    try:
        rc = proc.wait(timeout=1200)
    finally:
        stop_group(proc)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert f"resuming from step_{stopped:06d}" in text
    assert [s for s, _ in history(tmp_path, name, "train/reward_mean")] == list(range(1, 9))
    versions = history(tmp_path, name, "train/policy_version")
    assert [v for _, v in versions] == [float(s - 1) for s in range(1, 9)]
    assert max(a for _, a in history(tmp_path, name, "buffer/sample_age_max")) <= 2


@pytest.mark.slow
def test_vllm_async_engine_with_in_flight_updates_runs_within_the_bound(tmp_path):
    """launch.py rollout=vllm rollout.async_engine=true grpo.async_grpo.enabled=true ...in_flight_weight_updates:
    the engine generates ahead on its own slot, each update is pushed at once (a request in flight is interrupted
    and resumes on the new weights), and no step trains on a sample older than 2 versions. Every record's versions
    are consistent: first ≤ last ≤ the trainer's version, age = (step - 1) - first. (Whether a request was
    actually interrupted depends on timing: reported, not asserted.)"""
    name, log, steps = "h17b-vllm-async", tmp_path / "run.log", 6
    proc = launch(tmp_path, name, "rollout=vllm", "rollout.async_engine=true", *ASYNC, *IS_TIS,
                  "grpo.async_grpo.in_flight_weight_updates=true", "grpo.async_grpo.max_trajectory_age_steps=2",
                  f"grpo.max_steps={steps}", "grpo.val_period=0", "grpo.val_at_end=false", "logging.mlflow=false",
                  "checkpoint.metric=train/reward_mean",
                  "logging.train_data_log=true", "rollout.max_new_tokens=16", log=log)
    try:
        rc = proc.wait(timeout=900)
    finally:
        stop_group(proc)
    assert rc == 0, log.read_text()[-3000:]
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in lines}  # a reader keeps the last line of each step
    assert sorted(by_step) == list(range(1, steps + 1))
    assert all(m["train/policy_version"] == s - 1 and m["buffer/sample_age_max"] <= 2 for s, m in by_step.items())
    assert max(m["buffer/depth"] for m in by_step.values()) <= 3  # N + 1 batches in flight at most
    interrupted = 0
    for step in range(1, steps + 1):
        rows = [json.loads(x) for x in (tmp_path / name / "train_data" /
                                        f"train_data_step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 * 8
        for r in rows:
            assert 0 <= r["policy_version"] <= r["policy_version_last"] <= step - 1, r
            assert r["age"] == step - 1 - r["policy_version"] <= 2
            assert len(r["generation_logprobs"]) == len(r["token_ids"])  # a resumed request kept every logprob
        interrupted += sum(r["policy_version_last"] > r["policy_version"] for r in rows)
    print(f"\n{interrupted} of {steps * 128} samples resumed on newer weights after an in-flight update")
