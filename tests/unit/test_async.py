"""Async GRPO (grpo.async_grpo.*; train/async_loop.py): the plan and the rules (fast), the age bound and the
versions in the train-data log (fast), then real runs through launch.py (slow): the bound held and recorded per
sample, a stop and resume exact on the step axis, an async run that learns, and rollout=vllm's async engine with
in-flight weight updates (requests interrupted and resumed on the new weights)."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_model

from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.train.async_loop import InFlight, RolloutBuffer, StaleTrajectory
ASYNC = ["grpo.async_grpo.enabled=true", "cluster.cpu_workers_per_node=2", "cluster.rollout_devices=1"]


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
