"""`launch.py rerun` says which of the files the run read (data, reward code) changed since: it reads them as they are
now, so a rerun of a run whose data or reward file was edited trained on other inputs without a word."""

from __future__ import annotations

from pathlib import Path

from grpo_launcher.checkpoint.manager import record_spec_changes, spec_as_dict
from grpo_launcher.spec.compose import load_spec, spec_to_yaml
from grpo_launcher.tracking.repro import write_repro

REWARD = "def digits(prompt, completion, **row):\n    return float(completion.strip() == str(row['a']))\n"


def recorded_run(user: Path) -> Path:
    """A run dir as a launch leaves it: spec.yaml and repro/ written by the launch's own recorder."""
    (user / "train.csv").write_text("q,a\n" + "".join(f"{i:04d}>,{i:04d}\n" for i in range(32)))
    (user / "val.csv").write_text("q,a\n" + "".join(f"{i:04d}>,{i:04d}\n" for i in range(100, 108)))
    (user / "rewards.py").write_text(REWARD)
    spec = load_spec(
        [
            "env=dataset",
            f"env.train_path={user / 'train.csv'}",
            f"env.val_path={user / 'val.csv'}",
            "env.prompt_key=q",
            "env.answer_key=a",
            f"env.reward_fn={user / 'rewards.py'}:digits",
            f"output_root={user / 'out'}",
            "name=orig",
            "logging.mlflow=false",
        ]
    )
    run_dir = user / "out" / "orig"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    write_repro(spec, run_dir, argv=["launch.py"])
    return run_dir


def test_rerun_names_the_data_and_reward_files_changed_since_the_run(launch_here, tmp_path):
    run_dir = recorded_run(tmp_path)
    r = launch_here(tmp_path, "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0 and "changed since" not in r.stdout + r.stderr, r.stdout + r.stderr
    with open(tmp_path / "val.csv", "a") as f:
        f.write("0999>,0999\n")
    (tmp_path / "rewards.py").write_text(REWARD.replace("==", "!="))
    r = launch_here(tmp_path, "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert "warning: files the run read have changed since; this rerun reads them as they are now" in r.stdout
    assert f"  - env.val_path: {tmp_path / 'val.csv'} changed since the run (" in r.stdout, r.stdout
    assert (
        f"  - {tmp_path / 'rewards.py'} differs from the run's copy {run_dir / 'repro/user_code/rewards.py'}"
        in r.stdout
    )
    assert "train.csv" not in r.stdout.split("warning: files")[1].split("rerunning")[0]
    # the changed files given anew on the command line: the user chose them, nothing to say
    r = launch_here(
        tmp_path,
        "rerun",
        str(run_dir),
        "dry_run=true",
        f"env.val_path={tmp_path / 'val.csv'}",
        f"env.reward_fn={tmp_path / 'rewards.py'}:digits",
    )
    assert r.returncode == 0 and "changed since" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_rerun_names_the_keys_a_resume_changed(launch_here, tmp_path):
    """Resumed at step 3 with train.lr 3e-4 → 1e-4: spec.yaml holds 1e-4, which a rerun ran from step 1, a run the
    original never was, without a word."""
    run_dir = recorded_run(tmp_path)
    spec = load_spec([f"output_root={tmp_path / 'out'}", "name=orig", "logging.mlflow=false", "train.lr=1e-4"])
    before = load_spec([f"output_root={tmp_path / 'out'}", "name=orig", "logging.mlflow=false", "grpo.max_steps=2"])
    record_spec_changes(run_dir, {"step": 2, "spec": spec_as_dict(before)}, spec, say=lambda _: None)
    r = launch_here(tmp_path, "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0, r.stderr
    said = r.stdout.split("warning: the run was resumed with changed keys")[1].split("rerunning")[0]
    assert (
        "this rerun runs their last values from step 1:\n  - train.lr: 0.0003 until step 2, 0.0001 from step 3" in said
    )
    assert "grpo.max_steps" not in said  # the rerun's length is the run's last: nothing to warn of
    r = launch_here(tmp_path, "rerun", str(run_dir), "dry_run=true", "train.lr=3e-4")  # chosen on the command line
    assert r.returncode == 0 and "resumed with changed keys" not in r.stdout, r.stdout + r.stderr


def test_rerun_takes_a_run_name_as_eval_and_export_do(launch_here, tmp_path):
    """`rerun orig --root OUT` (or GRPO_OUTPUT_ROOT): a run name under the output root; it was 'not a run dir'."""
    run_dir = recorded_run(tmp_path)
    r = launch_here(tmp_path, "rerun", "orig", "--root", str(run_dir.parent), "dry_run=true")
    assert r.returncode == 0 and "rerunning" in r.stdout, r.stdout[-2000:] + r.stderr
    r = launch_here(tmp_path, "rerun", "nope", "--root", str(run_dir.parent), "dry_run=true")
    assert r.returncode == 2 and f"nor a run under {run_dir.parent}" in r.stderr, r.stderr
