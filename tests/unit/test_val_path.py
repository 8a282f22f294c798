"""env.val_path is required only when the run validates (grpo.val_period > 0, grpo.val_at_start or grpo.val_at_end:
spec.schema.validation_on). With validation off it was still a config error (`env.val_path is null`), and a val
file that was set was read anyway (pre-flight's checks and prompt budget, the prompting record, repro's data
record); now nothing reads it. With validation on, a missing env.val_path is a config error naming the key."""

from __future__ import annotations

import json

from grpo_launcher.envs.dataset import DataError, DatasetEnv
from grpo_launcher.envs.prompting import split_prompts
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.schema import EnvSpec, GrpoSpec, validation_on
from grpo_launcher.tracking.repro import data_files

OFF = ["grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpoint.metric=train/reward_mean"]


def data(tmp_path, name: str = "train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    return path


def test_what_validation_off_means():
    assert not validation_on(GrpoSpec(val_period=0, val_at_start=False, val_at_end=False))
    assert validation_on(GrpoSpec(val_period=0, val_at_start=False, val_at_end=True))
    assert validation_on(GrpoSpec(val_period=0, val_at_start=True, val_at_end=False))
    assert validation_on(GrpoSpec(val_period=5, val_at_start=False, val_at_end=False))


def test_no_val_path_without_validation_is_no_config_error(launch_here, tmp_path):
    train = data(tmp_path)
    for env in ("dataset", "math"):
        r = launch_here(tmp_path, f"env={env}", f"env.train_path={train}", "env.val_path=null",
                        "env.prompt_key=prompt", *OFF, "dry_run=true")
        assert r.returncode == 0, r.stderr
        assert "env.val_path" not in r.stderr + r.stdout, r.stderr


def test_a_val_file_set_without_validation_is_not_read(launch_here, tmp_path):
    """A val file that does not exist, or is no data file, is neither refused nor read (a real launch's
    local_paths_exist too: the dry run's note of what a real launch would be refused for is empty)."""
    train, broken = data(tmp_path), tmp_path / "val.jsonl"
    broken.write_text("not json\n")
    for val in (broken, tmp_path / "missing.jsonl"):
        r = launch_here(tmp_path, "env=dataset", f"env.train_path={train}", f"env.val_path={val}", *OFF,
                        "dry_run=true")
        assert r.returncode == 0, r.stderr
        assert "env.val_path" not in r.stderr + r.stdout and "would be refused" not in r.stdout, r.stdout + r.stderr
    spec = load_spec(["env=dataset", f"env.train_path={train}", f"env.val_path={broken}", *OFF,
                      f"output_root={tmp_path / 'out'}"])
    assert list(data_files(spec)) == ["env.train_path"]  # repro's record: the train file only


def test_with_validation_on_a_missing_val_path_names_the_key(launch_here, tmp_path):
    train = data(tmp_path)
    for on in (["grpo.val_period=10"], ["grpo.val_period=0", "grpo.val_at_end=true"]):
        r = launch_here(tmp_path, "env=dataset", f"env.train_path={train}", "env.val_path=null", *on,
                        "checkpoint.metric=train/reward_mean", "dry_run=true")
        assert r.returncode == 2, r.stderr
        line = next(x for x in r.stderr.splitlines() if "env.val_path" in x)
        assert line.startswith("  - env.val_path: ") and "validation is on" in line, r.stderr
        assert "grpo.val_period=0 grpo.val_at_start=false grpo.val_at_end=false" in r.stderr


def test_the_prompting_record_reads_no_val_split_without_validation(tmp_path):
    env = DatasetEnv(EnvSpec(name="dataset", train_path=str(data(tmp_path)), val_path=None), seed=0)
    splits = split_prompts(env, 2, val=False)
    assert list(splits) == ["train"] and len(splits["train"]) == 4
    try:
        split_prompts(env, 2)
    except DataError as exc:
        assert "env.val_path" in str(exc)
    else:
        raise AssertionError("the val split was read without env.val_path")


def test_eval_of_a_spec_without_validation_still_needs_a_val_set(tmp_path, launch_here):
    """`launch.py eval` scores the val set: with validation off in the spec and no env.val_path it is refused before
    anything starts, naming env.val_path (the spec's own validation setting does not exempt it)."""
    from helpers import tiny_model

    model = tiny_model()
    train = data(tmp_path)
    r = launch_here(tmp_path, "eval", str(model), "env=dataset", f"env.train_path={train}", "env.val_path=null", *OFF,
                    f"output_root={tmp_path / 'out'}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "  - env.val_path: " in r.stderr, r.stderr
