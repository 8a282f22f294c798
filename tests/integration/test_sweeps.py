"""Sweeps for real: Hydra multirun through our launcher, MLflow parent/child runs, an Optuna study in sqlite."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from grpo_launcher.tracking import metric_names

from helpers import launch, share_models, tiny_model

SHORT = ["grpo.max_steps=1", "grpo.val_period=1", "checkpoint.save_period=1"]


def runs_of(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_64_point_dry_run_prints_64_plans(tmp_path):
    p = launch("-m", "grpo.seed=range(0,64)", "cluster=slurm", "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("#SBATCH --nodes=1") == 64
    assert len({line for line in p.stdout.splitlines() if line.startswith("run dir")}) == 64


def test_bad_point_stops_the_sweep_before_anything_runs(tmp_path):
    p = launch("-m", "train.global_batch_size=128,100", f"output_root={tmp_path}", *SHORT)
    assert p.returncode == 2 and "train.global_batch_size=100" in p.stderr and "Traceback" not in p.stderr
    assert "sweep not launched" in p.stderr and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("sweep,key", [
    ("model=tiny,nope", "model"),  # a point that does not compose: was exit 1 with Hydra's error
    ("train.lr=1e-4,inf", "train.lr"),
    ("name=a,..", "name"),
    ("model=nope", "model"),  # the sweep's base does not compose
])
def test_every_point_failure_is_a_config_error(tmp_path, sweep, key):
    p = launch("-m", sweep, "grpo.seed=1,2", "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 2 and p.stderr.startswith("config error"), p.stderr[-2000:]
    assert f"  - {key}" in p.stderr and "Traceback" not in p.stdout + p.stderr


def test_an_objective_no_run_logs_is_a_config_error(tmp_path):
    """A typo in the Optuna objective fails pre-flight (exit 2, key named), not every trial after it ran."""
    p = launch("-m", "hydra/sweeper=optuna", "hydra.sweeper.objective=val/reward_men", "train.lr=choice(1e-4,3e-4)",
               f"output_root={tmp_path}", *SHORT)
    assert p.returncode == 2 and p.stderr.startswith("config error"), p.stderr[-2000:]
    assert "  - hydra.sweeper.objective: 'val/reward_men' is not a metric" in p.stderr and "val/reward_mean" in p.stderr
    assert "Traceback" not in p.stdout + p.stderr and not list(tmp_path.iterdir())


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
              f"output_root={tmp_path}", *SHORT]
    # grid over 4 points; the two with a model.path that is not a model crash inside the run (for real)
    p = launch(*common, "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=4", "train.lr=choice(1e-4,3e-4)",
               f"model.path=choice({model},{not_a_model})")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    study = optuna.load_study(study_name="s1", storage=storage)
    first_states = [t.state.name for t in study.trials]
    assert sorted(first_states) == ["COMPLETE", "COMPLETE", "FAIL", "FAIL"]
    assert all(t.params["model.path"] == str(model) for t in study.trials if t.state.name == "COMPLETE")
    assert "best trial of study 's1'" in p.stdout
    # the same study name (and space) again: it continues (5 wanted, 4 done → 1 new trial), no restart
    p = launch(*common, "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=5", "train.lr=choice(1e-4,3e-4)",
               f"model.path=choice({model},{not_a_model})")
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


def test_sweep_points_share_the_reward_probe(tmp_path, monkeypatch):
    """A sweep's points that differ only in train.lr / loss keys probe each reward function once (issue 41), and
    every point still gets the same verdict as the unshared path."""
    from grpo_launcher.envs import preflight as P
    from grpo_launcher.spec.compose import compose, to_spec

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}", "answer": f"{n}"[::-1]}) + "\n" for n in (12, 345, 6789)))
    probed = []
    real = P._reward_verdict
    monkeypatch.setattr(P, "_reward_verdict", lambda *a: probed.append(a[1].ref) or real(*a))
    base = ["env=dataset", f"env.train_path={data}", f"env.val_path={data}", "env.max_prompt_tokens=64",
            "train.max_total_sequence_length=80", f"output_root={tmp_path}"]
    verdicts = [list(P.check_env(to_spec(compose([*base, f"train.lr={lr}", f"loss.clip_high={c}"]))))
                for lr in ("1e-6", "2e-6") for c in ("0.2", "0.28")]
    assert len(probed) == len(set(probed)) >= 1, probed
    assert all(v == verdicts[0] for v in verdicts)
