"""A resume (the same run name relaunched, checkpoint.resume=auto) whose data or reward files changed since the run
began: said before it runs, file by file; and RUN/repro/data.json stays the record of what the run began with (a
resume overwrote it, leaving no record of the first steps' data), each launch's own files in repro/launches.jsonl."""

from __future__ import annotations

import json
import shutil

import pytest

from grpo_launcher.launch.repro import say_resume_input_drift
from grpo_launcher.runfiles import load_spec_file
from helpers import ROOT, launch, share_models

REWARD = "def match(prompt, completion, answer=None, **row):\n    return float(completion.strip() == str(answer))\n"


@pytest.mark.extended  # in make test-all: CI's time (benchmarks/results/ci-rehearsals.md)
def test_a_resume_on_changed_files_says_so_and_keeps_the_runs_record(tmp_path, capsys):
    for split in ("train", "val"):
        shutil.copy(ROOT / "data" / f"math_{split}.jsonl", tmp_path / f"{split}.jsonl")
    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    args = ["env=math", f"env.train_path={tmp_path / 'train.jsonl'}", f"env.val_path={tmp_path / 'val.jsonl'}",
            f"env.reward_fn={tmp_path / 'rewards.py'}:match", "name=r", "checkpoint.save_period=1", "grpo.val_period=1",
            "logging.mlflow=false", f"output_root={out}"]
    first = launch(*args, "grpo.max_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir, repro = out / "r", out / "r" / "repro"
    record = (repro / "data.json").read_text()
    say_resume_input_drift(load_spec_file(run_dir / "spec.yaml"), run_dir)  # nothing changed: nothing said
    assert "warning" not in capsys.readouterr().out

    with open(tmp_path / "val.jsonl", "a") as f:
        f.write('{"question": "1+1=", "answer": 2}\n')
    (tmp_path / "rewards.py").write_text(REWARD.replace("float(", "0.5 * float("))
    again = launch(*args, "grpo.max_steps=2")
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout.split("grpo-launcher: warning: this launch resumes run 'r' from step 1, and files the run "
                              "read at its start have changed since")[1].split("grpo-launcher: ")[0]
    assert f"  - env.val_path: {tmp_path / 'val.jsonl'} changed since the run (" in said, said
    assert f"  - {tmp_path / 'rewards.py'} differs from the run's copy {repro / 'user_code' / 'rewards.py'}" in said
    assert "train.jsonl" not in said
    # the run's start is still on record; each launch's own data files in its line of launches.jsonl
    assert (repro / "data.json").read_text() == record
    assert (repro / "user_code" / "rewards.py").read_text() == REWARD
    launches = [json.loads(line) for line in (repro / "launches.jsonl").read_text().splitlines()]
    assert [entry["resumed"] for entry in launches] == [False, True]
    assert launches[0]["data"] == json.loads(record) != launches[1]["data"]


def test_a_resume_from_another_directory_names_the_other_files_its_relative_paths_read(launch_here, tmp_path,
                                                                                        monkeypatch):
    """env.train_path=data/train.jsonl, resumed from another directory that has its own data/train.jsonl: the spec
    records no change (the same value), and the run went on with another file without a word."""
    from grpo_launcher.spec.compose import load_spec, spec_to_yaml
    from grpo_launcher.tracking.repro import write_repro

    first, other = tmp_path / "first", tmp_path / "other"
    for d, rows in ((first, slice(0, 200)), (other, slice(200, 400))):
        (d / "data").mkdir(parents=True)
        lines = (ROOT / "data" / "math_train.jsonl").read_text().splitlines(keepends=True)
        (d / "data" / "train.jsonl").write_text("".join(lines[rows]))
        shutil.copy(ROOT / "data" / "math_val.jsonl", d / "data" / "val.jsonl")
    (tmp_path / "first" / "data" / "test.jsonl").write_text((first / "data" / "val.jsonl").read_text())
    val_lines = (other / "data" / "val.jsonl").read_text().splitlines(keepends=True)
    (other / "data" / "test.jsonl").write_text("".join(val_lines[1:]))  # another held-out file, other rows
    args = ["env=math", "env.train_path=data/train.jsonl", "env.val_path=data/test.jsonl", "name=r",
            f"output_root={tmp_path / 'out'}", "logging.mlflow=false"]
    monkeypatch.chdir(first)  # the run, launched from first/: its record, a checkpoint of step 1
    spec = load_spec(args)
    run_dir = tmp_path / "out" / "r"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000001" / "meta.json").write_text("{}")
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    write_repro(spec, run_dir, argv=["launch.py"])
    r = launch_here(other, *args, "dry_run=true")
    assert r.returncode == 0, r.stdout + r.stderr
    said = r.stdout.split("have changed since")[1]
    assert (f"  - env.train_path=data/train.jsonl reads {other / 'data' / 'train.jsonl'} from here ({other}); the run "
            f"read {first / 'data' / 'train.jsonl'}") in said, said
    assert f"  - env.val_path=data/test.jsonl reads {other / 'data' / 'test.jsonl'} from here" in said, said
    r = launch_here(first, *args, "dry_run=true")  # from where it was launched: nothing to say
    assert r.returncode == 0 and "have changed since" not in r.stdout, r.stdout + r.stderr
