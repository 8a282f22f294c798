"""Sweeps for real: Hydra multirun through our launcher, MLflow parent/child runs, an Optuna study in sqlite."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from grpo_launcher.tracking import metric_names

from helpers import launch, share_models, tiny_model
from unit.test_sweeps import SHORT


def runs_of(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.slow
@pytest.mark.extended
def test_2x2_local_sweep_four_runs_under_one_parent(tmp_path):
    p = launch("-m", "loss.clip_high=0.2,0.28", "train.lr=1e-4,3e-4", f"output_root={share_models(tmp_path)}", *SHORT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    dirs = sorted(d.name for d in tmp_path.iterdir() if d.name.startswith("tiny-grpo_"))
    assert dirs == ["tiny-grpo_loss.clip_high=0.2,train.lr=0.0001", "tiny-grpo_loss.clip_high=0.2,train.lr=0.0003",
                    "tiny-grpo_loss.clip_high=0.28,train.lr=0.0001", "tiny-grpo_loss.clip_high=0.28,train.lr=0.0003"]
    for d in dirs:
        assert '"status": "FINISHED"' in (tmp_path / d / "summary.json").read_text()
    logged = json.loads((tmp_path / dirs[0] / "summary.json").read_text())["metrics"]
    assert [k for k in logged if not metric_names.is_metric(k)] == []  # every name in tracking/metric_names.py
    runs = runs_of(tmp_path)
    parents = [r for r in runs if r.info.run_name.startswith("sweep-")]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 4
    assert parents[0].info.status == "FINISHED"  # ended with the sweep, never left RUNNING
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert {c.data.params["loss.clip_high"] for c in children} == {"0.2", "0.28"}
    (multirun_yaml,) = tmp_path.glob("multirun/*/multirun.yaml")  # the sweep, re-creatable
    assert "loss.clip_high=0.2,0.28" in multirun_yaml.read_text()


@pytest.mark.slow
def test_optuna_study_persists_continues_and_survives_a_crashing_trial(tmp_path):
    import optuna

    model = tiny_model()
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    common = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.study_name=s1", f"hydra.sweeper.storage={storage}",
              f"output_root={tmp_path}", "name=opt", *SHORT]
    cwd = tmp_path / "cwd"  # the user's own directory: nothing is written there
    cwd.mkdir()
    # grid over 4 points; the two with a model.path that is not a model crash inside the run (for real)
    p = launch(*common, "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=4", "train.lr=choice(1e-4,3e-4)",
               f"model.path=choice({not_a_model},{model})", cwd=cwd)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    # each trial in a run dir of its own, named after the user's name= (all four ran in `opt`: the first trial's
    # result was told for the other three, which never ran)
    assert sorted(d.name for d in tmp_path.glob("opt-*")) == ["opt-s1-t1", "opt-s1-t3"]  # t0, t2: not a model
    assert list(cwd.iterdir()) == []  # the sweep's MLflow artifacts went to ./mlruns
    study = optuna.load_study(study_name="s1", storage=storage)
    first_states = [t.state.name for t in study.trials]
    assert first_states == ["FAIL", "COMPLETE", "FAIL", "COMPLETE"]
    (parent,) = [r for r in runs_of(tmp_path) if r.info.run_name.startswith("sweep-")]
    assert parent.info.status == "FAILED"  # the study's trials, not its last one alone (was FINISHED)
    assert all(t.params["model.path"] == str(model) for t in study.trials if t.state.name == "COMPLETE")
    assert "best trial of study 's1'" in p.stdout
    # the same study name (and space) again: it continues (5 wanted, 4 done → 1 new trial), no restart
    p = launch(*common, "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=5", "train.lr=choice(1e-4,3e-4)",
               f"model.path=choice({not_a_model},{model})", cwd=cwd)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "study 's1': 4 finished trial(s), 5 wanted" in p.stdout + p.stderr
    again = optuna.load_study(study_name="s1", storage=storage)
    assert len(again.trials) == 5
    assert [t.state.name for t in again.trials[:4]] == first_states


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.extended
def test_2x2_slurm_sweep_submits_four_jobs_without_waiting(tmp_path):
    """Each point is its own Slurm job (its own Ray cluster); the command returns at once; all four finish."""
    import re
    import time

    from grpo_launcher.launch.status import read_status

    share_models(tmp_path)
    tiny_model()  # built once here, not inside four jobs
    t0 = time.monotonic()
    p = launch("-m", "loss.clip_high=0.2,0.28", "train.lr=1e-4,3e-4", "cluster=local_slurm", "cluster.nodes=1",
               f"output_root={tmp_path}", *SHORT, timeout=300)
    submit_s = time.monotonic() - t0
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    jobs = re.findall(r"submitted job (\d+)", p.stdout)
    assert len(set(jobs)) == 4, p.stdout[-3000:]
    print(f"4-job Slurm sweep submitted in {submit_s:.1f} s")
    run_dirs = [d for d in tmp_path.iterdir() if d.name.startswith("tiny-grpo_")]
    deadline = time.monotonic() + 1200
    try:
        while time.monotonic() < deadline:
            states = [read_status(d).get("state") for d in run_dirs]
            if all(s in ("COMPLETED", "FAILED", "CANCELLED") for s in states):
                break
            time.sleep(2)  # polling the jobs' status files (a condition, with a deadline)
        assert states == ["COMPLETED"] * 4, states
    finally:
        subprocess.run(["scancel", *jobs], capture_output=True)
    children = [r for r in runs_of(tmp_path) if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 4 and len({c.data.tags["mlflow.parentRunId"] for c in children}) == 1


@pytest.mark.slow
@pytest.mark.extended  # make test-all: CI's 30 minutes (ci-rehearsals.md, 2026-12-07)
def test_a_second_study_never_resumes_the_first_ones_runs(tmp_path):
    """Trial numbers restart with each study: study 'b''s trial 0 ran in the default study's `tiny-grpo-t0`, resumed
    it (its spec.yaml and MLflow run overwritten) and reported a value of that mixed run. Now it has its own run dir;
    the same study name in another storage (its trial 0's dir taken) is refused before any trial runs."""
    import optuna

    share_models(tmp_path)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    common = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "train.lr=choice(1e-4,3e-4)",
              f"output_root={tmp_path}", "grpo.val_period=1", "checkpoint.save_period=1"]
    p = launch(*common, f"hydra.sweeper.storage={storage}", "grpo.max_steps=1")  # study 'tiny-grpo': tiny-grpo-t0
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    first = (tmp_path / "tiny-grpo-t0" / "summary.json").read_text()
    p = launch(*common, f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=b", "grpo.max_steps=2")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (tmp_path / "tiny-grpo-t0" / "summary.json").read_text() == first  # untouched
    assert json.loads((tmp_path / "tiny-grpo-b-t0" / "summary.json").read_text())["step"] == 2  # from step 0
    assert [t.state.name for t in optuna.load_study(study_name="b", storage=storage).trials] == ["COMPLETE"]
    children = [r for r in runs_of(tmp_path) if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 2 and len({c.data.tags["mlflow.parentRunId"] for c in children}) == 2
    p = launch(*common, f"hydra.sweeper.storage=sqlite:///{tmp_path / 'other.db'}", "hydra.sweeper.study_name=b",
               "grpo.max_steps=2")
    assert p.returncode == 2 and "  - hydra.sweeper.study_name, hydra.sweeper.storage:" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr and "tiny-grpo-b-t0" in p.stderr
