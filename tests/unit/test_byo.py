"""Bring your own model, data, prompts and reward — through `launch.py`, as a user would.

Every fixture lives outside the package (tmp_path): a model dir written by transformers' save_pretrained, JSONL /
Parquet / saved `datasets` data, a reward file. The fast tests stop at pre-flight (exit 2, `config error`
naming the key and the file:line) or at a dry run; the `slow` ones train a couple of steps on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT, launch

from grpo_launcher.envs import MathEnv
from grpo_launcher.train.workers import own_score

REWARDS = '''
def correct(prompt, completion, answer, **row):
    """1 for the exact reversal; the row's other columns (here `id`) arrive as keyword arguments."""
    assert "id" in row, row
    return float(completion.strip() == answer)


def short(prompt, completion, **row):
    return 1.0 if len(completion.strip()) <= 4 else 0.0
'''

# a small training config: 4 prompts × 4 samples, one optimizer step, validation every step
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "rollout.max_new_tokens=6", "env.max_prompt_tokens=64", "train.max_total_sequence_length=72"]


def write_jsonl(path: Path, rows: list[dict], blank_first: bool = False) -> Path:
    path.write_text(("\n" if blank_first else "") + "".join(json.dumps(r) + "\n" for r in rows))
    return path


def reverse_rows(n: int, start: int = 0, prefix: str = "row") -> list[dict]:
    out = []
    for i in range(start, start + n):
        s = f"{(i * 7919) % 10000:04d}"
        out.append({"prompt": f"{s}>", "answer": s[::-1], "id": f"{prefix}-{i}"})
    return out


@pytest.fixture
def user(tmp_path: Path) -> Path:
    """A user's working directory: train/val JSONL and a reward file, nothing inside the package."""
    write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    write_jsonl(tmp_path / "val.jsonl", reverse_rows(8, start=100, prefix="val"))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def data_args(d: Path, **extra: str) -> list[str]:
    args = {"env": "dataset", "env.train_path": str(d / "train.jsonl"), "env.val_path": str(d / "val.jsonl"),
            "env.reward_fn": "rewards.py:correct", "output_root": str(d / "out"), **extra}
    return [f"{k}={v}" for k, v in args.items()]


# ------------------------------------------------------------------ pre-flight (fast)


def test_broken_data_and_reward_all_named_at_once(user):
    """A missing key (file:line, blank lines counted), a bad reward file, mismatched weights: one config error."""
    rows = reverse_rows(4)
    del rows[1]["prompt"]
    write_jsonl(user / "train.jsonl", rows, blank_first=True)  # the row without 'prompt' is on line 3
    (user / "broken.py").write_text("def f(prompt, completion):\n    return 1.0 +\n")
    r = launch(*data_args(user, **{"env.reward_fn": "null", "env.reward_fns": "[broken.py:f,rewards.py:nope]",
                                         "env.reward_weights": "[1.0]"}), cwd=user)
    assert r.returncode == 2, r.stderr
    err = r.stderr
    assert "config error" in err and "Traceback" not in err
    assert "env.train_path" in err and "1 row without 'prompt' (env.prompt_key): line 3" in err, err
    assert f"{user / 'train.jsonl'}:3 has the keys ['answer', 'id']" in err, err
    assert "env.reward_weights" in err and "1 weight(s) for 2 reward functions" in err
    assert "env.reward_fns[0]" in err and "SyntaxError" in err and "line 2" in err, err
    assert "env.reward_fns[1]" in err and "defines no 'nope'" in err, err


@pytest.mark.parametrize("case,expect", [
    ("missing", "no file"),
    ("empty", "holds no rows"),
    ("malformed", "train.jsonl: 1 row with invalid JSON: line 3 (Expecting"),
    ("signature", "cannot be called as fn(prompt, completion, **row)"),
    ("no_function", "defines no 'nope'"),
    ("too_long", "exceed env.max_prompt_tokens=64"),
])
def test_preflight_names_file_line_or_key(launch_here, user, case, expect):
    extra = {}
    if case == "missing":
        extra["env.train_path"] = str(user / "nope.jsonl")
    elif case == "empty":
        (user / "train.jsonl").write_text("\n")
    elif case == "malformed":
        (user / "train.jsonl").write_text('{"prompt": "1>", "answer": "1", "id": 1}\n\n{"prompt": "2>",\n')
    elif case == "signature":
        (user / "strict.py").write_text("def score(prompt, completion, answer):\n    return 0.0\n")
        extra["env.reward_fn"] = "strict.py:score"  # the rows also have `id`: no **kwargs to take it
    elif case == "no_function":
        extra["env.reward_fn"] = "rewards.py:nope"
    elif case == "too_long":
        write_jsonl(user / "val.jsonl", reverse_rows(3) + [{"prompt": "9" * 80 + ">", "answer": "1", "id": "x"}])
    r = launch_here(user, *data_args(user, **extra), *SMALL)
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr
    if case == "too_long":
        assert f"{user / 'val.jsonl'}:4" in r.stderr and "the longest, 81 tokens" in r.stderr, r.stderr


def test_parquet_and_saved_datasets_dirs_dry_run(launch_here, user):
    """Parquet (train) and a `datasets` save_to_disk directory (val) load through `datasets`; columns mapped."""
    import datasets

    rows = [{"question": r["prompt"], "solution": r["answer"], "id": r["id"]} for r in reverse_rows(16)]
    datasets.Dataset.from_list(rows).to_parquet(str(user / "train.parquet"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows[:4])}).save_to_disk(str(user / "val_ds"))
    r = launch_here(user, *data_args(user, **{"env.train_path": str(user / "train.parquet"),
                                              "env.val_path": str(user / "val_ds"), "env.prompt_key": "question",
                                              "env.answer_key": "solution", "env.reward_fn": "rewards.py:short",
                                              "dry_run": "true"}), *SMALL)
    assert r.returncode == 0, r.stderr
    r = launch_here(user, *data_args(user, **{"env.train_path": str(user / "train.parquet"), "env.prompt_key": "q",
                                              "dry_run": "true"}), *SMALL)
    assert r.returncode == 2 and "no row has 'q' (env.prompt_key)" in r.stderr
    assert "the columns: question, solution, id" in r.stderr, r.stderr
    assert "val.jsonl:\n      no row has 'q'" in r.stderr, r.stderr  # every problem of both files at once


def test_user_env_class_and_reward_checked_at_preflight(launch_here, user):
    (user / "envs.py").write_text("class NotAnEnv:\n    pass\n")
    r = launch_here(user, "env.name=envs.py:NotAnEnv", f"output_root={user / 'out'}", "dry_run=true")
    assert r.returncode == 2 and "is not an Env class (no train_prompts, val_prompts, score method)" in r.stderr
    r = launch_here(user, "env.name=no_such_module:Env", f"output_root={user / 'out'}", "dry_run=true")
    assert r.returncode == 2 and "no module named 'no_such_module'" in r.stderr, r.stderr
    r = launch_here(user, "env.reward_fn=rewards.py:correct", f"output_root={user / 'out'}", "dry_run=true")
    assert r.returncode == 2 and "env=toy has its own scorer" in r.stderr


def test_rerun_relaunches_the_saved_spec(launch_here, user):
    """`launch.py rerun RUN_DIR` validates the run's resolved spec again under a fresh name."""
    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    spec = load_spec(data_args(user, name="h13-orig", **{"env.epochs": "2", "env.reward_fn": f"{user}/rewards.py:correct"})
                     + SMALL[:5] + ["grpo.max_steps=16"])
    run_dir = user / "out" / "h13-orig"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    r = launch_here(user, "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert "rerunning" in r.stdout and "'h13-orig-rerun1'" in r.stdout and "dry run" in r.stdout
    r = launch_here(user, "rerun", str(run_dir), "dry_run=true", "grpo.max_steps=10")  # env.epochs=2 → 16 steps
    assert r.returncode == 2 and "env.epochs" in r.stderr and "set grpo.max_steps=16" in r.stderr, r.stderr


def test_rerun_from_another_directory_works_from_the_launch_directory(launch_here, user, monkeypatch, tmp_path_factory):
    """A spec's relative paths (data, reward file) are the launch directory's: rerun works from there."""
    import json

    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    monkeypatch.chdir(user)
    spec = load_spec(["env=dataset", "env.train_path=train.jsonl", "env.val_path=val.jsonl",
                      "env.reward_fn=rewards.py:correct", "output_root=out", "name=h13-rel", *SMALL[:5]])
    run_dir = user / "out" / "h13-rel"
    (run_dir / "repro").mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    (run_dir / "repro" / "git.json").write_text(json.dumps({"cwd": str(user)}))
    r = launch_here(tmp_path_factory.mktemp("elsewhere"), "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert f"working from {user}" in r.stdout and "'h13-rel-rerun1'" in r.stdout, r.stdout


def test_dataset_order_epochs_and_resume_safety():
    """Every row once per epoch, a new order each epoch, the same prompts for the same step (resume-safe)."""
    from grpo_launcher.envs import make_env
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec(["env=dataset", "grpo.num_prompts_per_step=16", "grpo.max_steps=64",
                      f"env.train_path={ROOT / 'data/reverse_train.jsonl'}", f"env.val_path={ROOT / 'data/reverse_val.jsonl'}"])
    env = make_env(spec)
    rows = len(env.table("train").rows)  # the sample file: 512 rows → 32 steps an epoch
    epoch1 = [p.source for s in range(1, 33) for p in env.train_prompts(s, 0, 16)]
    epoch2 = [p.source for s in range(33, 65) for p in env.train_prompts(s, 0, 16)]
    assert len(set(epoch1)) == len(set(epoch2)) == rows and epoch1 != epoch2
    assert [p.source for p in make_env(spec).train_prompts(40, 0, 16)] == epoch2[7 * 16:8 * 16]


def test_a_resume_with_another_prompt_count_carries_on_in_the_data():
    """Steps 1-4 at 4 prompts, resumed for steps 5-8 at 8: steps 5-8 trained rows 32-63 (each step at
    (step - 1) × 8), rows 16-31 never (found by the journeys tester). The checkpoint's meta keeps how many prompts
    the run drew; the resume carries on from there; a checkpoint saved before that field was kept reads as its own
    per-step count."""
    import dataclasses

    from grpo_launcher.envs import make_env
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.train.loop_state import LoopState

    args = ["env=dataset", "env.shuffle=false", f"env.train_path={ROOT / 'data/reverse_train.jsonl'}",
            f"env.val_path={ROOT / 'data/reverse_val.jsonl'}"]
    four, eight = (load_spec([*args, f"grpo.num_prompts_per_step={n}", f"train.global_batch_size={8 * n}",
                              "train.micro_batch_size=8", "train.logprob_batch_size=8"])
                   for n in (4, 8))
    first = LoopState(four, make_plan(four), None, None)
    assert first.prompts_drawn(4) == 16
    resumed = LoopState(eight, make_plan(eight), None, None, step=4, data_origin=(4, first.prompts_drawn(4)))
    env = make_env(eight)
    env.data_origin = resumed.data_origin
    rows = [p.source for s in range(5, 9) for p in env.train_prompts(s, 0, 8)]
    assert rows == [p.source for p in make_env(eight).train_prompts(2, 0, 16)] + \
        [p.source for p in make_env(eight).train_prompts(3, 0, 16)]  # rows 16..47, in order
    assert resumed.prompts_drawn(6) == 32 and dataclasses.replace(resumed, data_origin=(6, 32)).prompts_drawn(8) == 48


def test_a_subclass_score_override_is_the_reward_the_worker_gives():
    """A user's MathEnv subclass that overrides score (the issue's workaround) scores in the env worker: the inherited
    score_detail (per-function rewards) no longer bypasses it."""

    class AlwaysRight(MathEnv):
        def score(self, prompt, completion):
            return 1.0

    assert own_score(AlwaysRight) and not own_score(MathEnv)


def test_env_epochs_counts_the_rows_a_resumed_checkpoint_drew(tmp_path):
    """Resumed at step 4 after 16 prompts, at 8 prompts a step: 8 steps are 48 of 64 rows, not the epoch
    `env.epochs=1` asked for (it passed, as 8 × 8 = 64); 10 steps are."""
    import json

    import pytest

    from grpo_launcher.launch.preflight import preflight
    from grpo_launcher.spec.errors import ConfigError

    rows = (ROOT / "data/reverse_train.jsonl").read_text().splitlines()[:64]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    meta = tmp_path / "out" / "r" / "checkpoints" / "step_000004" / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"step": 4, "state": {"prompts_drawn": 16}}))
    args = ["env=dataset", f"env.train_path={tmp_path / 'train.jsonl'}", f"env.val_path={ROOT / 'data/reverse_val.jsonl'}",
            f"output_root={tmp_path / 'out'}", "name=r", "env.epochs=1", "grpo.num_prompts_per_step=8",
            "train.global_batch_size=64", "train.micro_batch_size=8", "train.logprob_batch_size=8"]
    with pytest.raises(ConfigError) as info:
        preflight([*args, "grpo.max_steps=8", "dry_run=true"])
    (v,) = [v for v in info.value.violations if v.keys == ("env.epochs", "grpo.max_steps")]
    assert "16 prompts through step 4" in v.message and "0.75 epochs" in v.message and "max_steps=10" in v.fix
    preflight([*args, "grpo.max_steps=10", "dry_run=true"])
