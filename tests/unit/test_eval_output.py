"""`launch.py eval`'s printed metrics: each name apart from its value, whatever the reward function is called."""

from __future__ import annotations

import json
import re

import pytest

from helpers import ROOT, launch, tiny_model


@pytest.mark.slow
@pytest.mark.extended  # make test-all: CI's 30 minutes (ci-rehearsals.md, 2026-12-07)
def test_eval_prints_a_long_reward_name_apart_from_its_value(tmp_path):
    """val/reward/<fn>_mean over 31 characters ran into its value ('val/reward/math_verify_match_mean0', env=math):
    read as another number."""
    (tmp_path / "rewards.py").write_text("def a_rather_long_reward_name(prompt, completion, **row):\n    return 0.25\n")
    (tmp_path / "metrics").mkdir()
    val = ROOT / "data" / "reverse_val.jsonl"
    p = launch(
        "eval",
        str(tiny_model()),
        "env=dataset",
        f"env.train_path={val}",
        f"env.val_path={val}",
        f"env.reward_fn={tmp_path / 'rewards.py'}:a_rather_long_reward_name",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        f"output_root={tmp_path}",
        "--out",
        str(tmp_path / "metrics"),  # a directory: the file in it, under its default name (was IsADirectoryError)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(s for s in p.stdout.splitlines() if s.startswith("val/reward/a_rather_long_reward_name_mean"))
    assert re.fullmatch(r"val/reward/a_rather_long_reward_name_mean +0\.25", line), line
    (written,) = (tmp_path / "metrics").glob("*.reverse_val.json")
    record = json.loads(written.read_text())
    assert record["metrics"]["val/reward/a_rather_long_reward_name_mean"] == 0.25
    # what the eval ran under is in the file (an eval with other sampling wrote a record like the default's)
    assert "grpo.max_val_samples=8" in record["overrides"] and record["sampling"]["temperature"] == 1.0


def test_an_out_that_cannot_be_a_file_is_refused_before_the_eval_runs(launch_here, tmp_path):
    """Was found after the whole eval had run: a traceback, the metrics lost."""
    (tmp_path / "a_file").write_text("")
    r = launch_here(tmp_path, "eval", str(tiny_model()), "--out", str(tmp_path / "a_file" / "m.json"))
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stdout + r.stderr
    assert f"  - --out: {tmp_path / 'a_file' / 'm.json'} cannot be written as a file" in r.stderr
    assert "eval of" not in r.stdout and not (tmp_path / "outputs").exists()


def fake_run(tmp_path):
    """A run dir with a checkpoint of step 2 (as complete() lists one) and its spec."""
    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    (run_dir / "spec.yaml").write_text(spec_to_yaml(load_spec([f"output_root={tmp_path}", "name=r"])))
    return run_dir


def test_an_out_that_is_no_eval_result_is_never_overwritten(launch_here, tmp_path):
    """`eval RUN --out RUN/spec.yaml` (or summary.json) replaced the run's file with the metrics once the eval ran."""
    run_dir = fake_run(tmp_path)
    spec = (run_dir / "spec.yaml").read_text()
    r = launch_here(tmp_path, "eval", str(run_dir), "--out", str(run_dir / "spec.yaml"))
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stdout + r.stderr
    assert f"{run_dir / 'spec.yaml'} cannot be written as a file (it exists and is not an eval's metrics" in r.stderr
    assert (run_dir / "spec.yaml").read_text() == spec and "eval of" not in r.stdout


def test_an_eval_with_other_overrides_does_not_overwrite_the_earlier_result(tmp_path):
    """`eval RUN` then `eval RUN rollout.temperature=0.5`: both wrote RUN/eval/step_000002.json, the first result lost."""
    from grpo_launcher.launch import eval as ev

    run_dir = fake_run(tmp_path)

    def out(*overrides: str):
        ns = ev.parse([str(run_dir), *overrides], "eval")
        return ev.metrics_file(None, ev.target(ns), ns.overrides)

    first = run_dir / "eval" / "step_000002.json"
    assert out() == first
    first.parent.mkdir()
    first.write_text(json.dumps({"data": "val", "metrics": {}, "overrides": []}))
    assert out() == first  # the same eval again replaces its own result
    second = out("rollout.temperature=0.5")
    assert second == run_dir / "eval" / "step_000002.2.json"
    second.write_text(json.dumps({"data": "val", "metrics": {}, "overrides": ["rollout.temperature=0.5"]}))
    assert out("rollout.temperature=0.5") == second and out("rollout.max_new_tokens=4").name == "step_000002.3.json"


@pytest.mark.extended  # in make test-all: CI's time (benchmarks/results/ci-rehearsals.md)
def test_eval_of_a_damaged_checkpoint_is_refused_or_the_newest_good_one_used(tmp_path):
    """A truncated newest checkpoint reached the workers: a safetensors traceback after their start-up. Now it is
    verified first (manifest sizes, sha256): --step of it is a config error naming it; the default pick falls back to
    the newest that verifies, said so."""
    from helpers import share_models

    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    run = launch("name=r", "grpo.max_steps=2", "checkpoint.save_period=1", "grpo.val_period=1", "logging.mlflow=false",
                 f"output_root={out}")
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = out / "r"
    weights = run_dir / "checkpoints" / "step_000002" / "policy" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(1000)
    bad = launch("eval", str(run_dir), "--step", "2")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert f"  - --step: checkpoint {weights.parents[1]} fails verification: policy/model.safetensors has 1000 " \
           "bytes" in bad.stderr, bad.stderr
    ev = launch("eval", str(run_dir))
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-3000:]
    assert "grpo-launcher: step_000002 fails verification (policy/model.safetensors has 1000 bytes" in ev.stdout
    assert json.loads((run_dir / "eval" / "step_000001.json").read_text())["step"] == 1


def test_a_greedy_eval_is_told_how_to_decode_greedily(launch_here, tmp_path):
    """`eval MODEL rollout.temperature=0` (greedy: what a user evaluates with) was refused with the training fix,
    'set rollout.temperature=1.0', i.e. not greedy at all."""
    r = launch_here(tmp_path, "eval", str(tiny_model()), "rollout.temperature=0")
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stdout + r.stderr
    assert "fix: eval and generate sample through the run's engines, which take a temperature ≥ 1e-05: " \
           "rollout.temperature=1e-5 decodes (near-)greedily" in r.stderr, r.stderr


def test_an_eval_of_a_run_names_a_group_override_it_cannot_take(tmp_path):
    """`launch.py eval RUN env=dataset` printed '<config>: Merge error: str is not a subclass of EnvSpec' (the
    config tester): a run's saved spec has no defaults list to pick a group from."""
    from grpo_launcher.launch import eval as ev
    from grpo_launcher.spec.errors import ConfigError

    for override, key in (("env=dataset", "env"), ("+recipe=nanov3", "recipe")):
        with pytest.raises(ConfigError) as info:
            ev._run_target(tmp_path, None, [override])
        (v,) = info.value.violations
        assert v.keys == (key,) and "picks a config group" in v.message and "env.val_path" in v.fix
