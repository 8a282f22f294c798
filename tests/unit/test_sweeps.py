"""Sweeps for real: Hydra multirun through our launcher, MLflow parent/child runs, an Optuna study in sqlite."""

from __future__ import annotations

import json

import pytest


from helpers import interrupted, launch, share_models

SHORT = ["grpo.max_steps=1", "grpo.val_period=1", "checkpoint.save_period=1"]


def test_64_point_dry_run_prints_64_plans(tmp_path):
    p = launch("-m", "grpo.seed=range(0,64)", "cluster=slurm", "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("#SBATCH --nodes=1") == 64
    assert len({line for line in p.stdout.splitlines() if line.startswith("run dir")}) == 64


def test_values_that_read_the_same_get_run_dirs_of_their_own(tmp_path):
    """'a%b' and 'a_b' both read 'a_b' in a run name: each point still gets its own run dir (was one for both: the
    second point resumed the first's run), and a plain value keeps its plain name."""
    p = launch("-m", "logging.experiment=a%b,a_b,a:b,a b", "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    dirs = [line.split(":", 1)[1].strip() for line in p.stdout.splitlines() if line.startswith("run dir")]
    assert len(dirs) == len(set(dirs)) == 4, dirs
    assert str(tmp_path / "tiny-grpo_logging.experiment=a_b") in dirs


def test_a_trial_is_named_after_its_study_and_never_reuses_a_run_dir(tmp_path):
    from grpo_launcher.launch.sweep import trial_dir_problems, trial_name

    assert trial_name("tiny-grpo", "tiny-grpo", 3) == "tiny-grpo-t3"  # the default study: names as before
    assert trial_name("tiny-grpo", "lr search/2", 0) == "tiny-grpo-lr_search_2-t0"
    assert trial_dir_problems(tmp_path, ["tiny-grpo-t0"], "s") == []
    (tmp_path / "tiny-grpo-t0").mkdir()
    (bad,) = trial_dir_problems(tmp_path, ["tiny-grpo-t0", "tiny-grpo-t1"], "s")
    assert bad.keys[0] == "hydra.sweeper.study_name" and str(tmp_path / "tiny-grpo-t0") in bad.message
    assert "tiny-grpo-t1" not in bad.message


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


def test_an_optuna_dry_run_searches_int_keys_as_ints_and_never_stores_the_study(tmp_path):
    """Hydra's interval() has float bounds: an int key got floats (grpo.seed=6.37, every trial refused). A dry run
    told each trial its exit code as the objective (val/reward_mean = 0, COMPLETE in output_root/optuna.db): a later
    real sweep of the same n_trials found them finished and ran nothing."""
    import re

    p = launch("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "grpo.seed=interval(1,10)",
               "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    seeds = re.findall(r"#\d: .* grpo\.seed=(\S+)", p.stdout + p.stderr)
    assert len(seeds) == 2 and all(re.fullmatch(r"\d+", s) for s in seeds), seeds
    assert not (tmp_path / "optuna.db").exists() and "= 0 " not in p.stdout + p.stderr


def test_an_optuna_dry_run_names_each_refused_trial(tmp_path):
    """Each batch (one trial here) is checked by every rule through the launcher's composition kept from the first
    batch; a trial a rule refuses is named with its key (a dry run's refused trials were dropped without a word), and
    the dry run exits 2, as a basic sweep's with a refused point (it exited 0, even with every trial refused)."""
    import re

    p = launch("-m", "hydra/sweeper=optuna", "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=4",
               "train.global_batch_size=choice(128,100)", "grpo.seed=choice(1,2)", "dry_run=true",
               f"output_root={tmp_path}")
    assert p.returncode == 2 and "dry run: a trial's config was refused" in p.stderr, p.stderr[-2000:]
    dirs = [line.rsplit("/", 1)[1] for line in p.stdout.splitlines() if line.startswith("run dir")]
    refused = re.findall(r"^config error: point \[.*name='(\S+)'\]:\n  - train.global_batch_size", p.stderr, re.M)
    assert dirs == ["tiny-grpo-t0", "tiny-grpo-t1"] and refused == ["tiny-grpo-t2", "tiny-grpo-t3"], p.stderr[-2000:]


def test_a_point_takes_its_last_name():
    """An Optuna trial's `name=BASE-tN` comes after the user's own `name=BASE`: the first one won, so every trial
    ran in BASE (the first's result told for all)."""
    from grpo_launcher.launch.sweep import named_points

    points = [["name=opt", "train.lr=1", "name=opt-t0"], ["name=opt", "train.lr=2", "name=opt-t1"]]
    assert named_points("opt", points) == [["train.lr=1", "name='opt-t0'"], ["train.lr=2", "name='opt-t1'"]]


def test_trials_run_in_parallel_keep_their_own_names(tmp_path):
    """hydra.sweeper.n_jobs=2: a batch's trials were renamed after what varied in that batch (tiny-grpo-t0_train.lr=
    0.0003, then tiny-grpo-t2_0), so the run-dir check of a new trial looked at the wrong dir; `-m name=a,b` gave
    a_0, b_1."""
    p = launch("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
               "train.lr=choice(1e-4,3e-4)", "dry_run=true", f"output_root={tmp_path}")
    q = launch("-m", "name=a,b", "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == q.returncode == 0, (p.stderr + q.stderr)[-2000:]
    dirs = [line.rsplit("/", 1)[1] for line in (p.stdout + q.stdout).splitlines() if line.startswith("run dir")]
    assert dirs == ["tiny-grpo-t0", "tiny-grpo-t1", "tiny-grpo-t2", "tiny-grpo-t3", "a", "b"]


def test_an_int_key_over_an_interval_of_fractions_is_a_config_error(tmp_path):
    p = launch("-m", "hydra/sweeper=optuna", "grpo.seed=interval(1.5,10)", f"output_root={tmp_path}")
    assert p.returncode == 2 and "  - grpo.seed: grpo.seed=interval(1.5,10): grpo.seed is an int" in p.stderr
    assert "Traceback" not in p.stdout + p.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["hydra.sweeper.direction=max", "hydra.sweeper.sampler=cmaes"])
def test_an_optuna_option_out_of_its_choices_is_a_config_error(tmp_path, option):
    """Was optuna's ValueError with a traceback (exit 1) once the sweep had started."""
    p = launch("-m", "hydra/sweeper=optuna", option, "train.lr=choice(1e-4,3e-4)", f"output_root={tmp_path}")
    assert p.returncode == 2 and f"  - {option.partition('=')[0]}: {option}: not one of" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stdout + p.stderr and not list(tmp_path.iterdir())


DIRECTION = ["hydra.sweeper.direction", "hydra.sweeper.objective"]


@pytest.mark.parametrize("options,keys", [
    (["hydra.sweeper.sampler=grid", "train.lr=interval(1e-5,1e-3)"], ["train.lr", "hydra.sweeper.sampler"]),
    (["train.lr=tag(log,interval(0,1e-3))"], ["train.lr"]),
    (["train.lr=interval(1e-3,1e-5)"], ["train.lr"]),
    (["hydra.sweeper.n_trials=0", "train.lr=choice(1e-4,3e-4)"], ["hydra.sweeper.n_trials"]),
    (["hydra.sweeper.n_trials=-1", "train.lr=choice(1e-4,3e-4)"], ["hydra.sweeper.n_trials"]),
    (["hydra.sweeper.n_jobs=0", "train.lr=choice(1e-4,3e-4)"], ["hydra.sweeper.n_jobs"]),
    (["hydra.sweeper.objective=train/loss", "train.lr=choice(1e-4,3e-4)"], DIRECTION),
    (["hydra.sweeper.direction=minimize", "train.lr=choice(1e-4,3e-4)"], DIRECTION),
])
def test_what_the_optuna_sweeper_cannot_search_is_a_config_error(tmp_path, options, keys):
    """grid over an interval was an AttributeError ('FloatDistribution' object has no attribute 'choices'), a log
    interval from 0 optuna's ValueError, both with a traceback; n_trials < 1 ran nothing and exited 0 ('0 finished
    trial(s), -1 wanted'), n_jobs=0 asked for no trial, ever; train/loss was maximized (the default direction)."""
    p = launch("-m", "hydra/sweeper=optuna", *options, "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 2 and p.stderr.startswith("config error"), (p.stdout + p.stderr)[-2000:]
    assert f"  - {', '.join(keys)}: " in p.stderr and "fix: " in p.stderr
    assert "Traceback" not in p.stdout + p.stderr and not list(tmp_path.iterdir())


def test_the_optuna_sweeper_takes_a_loss_minimized_and_a_grid_over_a_range(tmp_path):
    """The direction rule leaves an objective minimized as it should be; grid enumerates a range of ints (was
    'IntDistribution' object has no attribute 'choices')."""
    import re

    from grpo_launcher.launch.sweep import objective_higher_is_better

    assert [objective_higher_is_better(m) for m in ("val/reward_mean", "val/accuracy", "val/reward/format_mean",
                                                     "train/pg_loss", "time/step_s", "train/kl")] == \
        [True, True, True, False, False, None]
    p = launch("-m", "hydra/sweeper=optuna", "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=2",
               "hydra.sweeper.objective=train/loss", "hydra.sweeper.direction=minimize", "grpo.seed=range(1,3)",
               "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert re.findall(r"#\d: .* grpo\.seed=(\S+)", p.stdout + p.stderr) == ["1", "2"]


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_continued_study_draws_new_points_and_a_fresh_one_the_same(tmp_path, sampler):
    """The sampler was seeded with hydra.sweeper.seed on every invocation: continuing a study (n_trials=2, then 3,
    then 4) replayed the same random draws, so trials 2 and 3 got exactly trial 0's params (and 1's)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from omegaconf import OmegaConf

    from hydra_plugins.grpo_launcher_plugins.optuna_sweeper import OptunaSweeper

    space = {"train.lr": FloatDistribution(1e-5, 1e-3, log=True), "loss.clip_high": CategoricalDistribution([0.2, 0.28])}

    def invocations(root, wanted):
        sweeper = OptunaSweeper(sampler=sampler, seed=0)
        sweeper.config = OmegaConf.create({"name": "opt", "output_root": str(root), "dry_run": False})
        for n in wanted:  # each: `launch.py -m hydra/sweeper=optuna hydra.sweeper.n_trials=n ...` again
            study = sweeper.study(space)
            while len(study.trials) < n:
                trial = study.ask(space)
                study.tell(trial, trial.params["train.lr"])
        return [tuple(t.params.values()) for t in study.trials]

    continued = invocations(tmp_path / "a", [2, 3, 4])
    assert len(set(continued)) == 4, continued
    assert invocations(tmp_path / "b", [2]) == continued[:2]  # a fresh study: the seed's own draws
    assert invocations(tmp_path / "c", [4]) == invocations(tmp_path / "d", [4])


FAILS_AT_RUN_TIME = """def boom(prompt, completion, answer=None, **row):
    if str(completion).strip() == str(answer).strip():  # pre-flight's probe: the row's answer as the completion
        return 1.0
    raise ValueError("reward broke on " + repr(completion))
"""


@pytest.mark.extended  # 2 real runs (CI's time); make test runs a real sweep in test_ctrl_c_in_a_point_stops_the_sweep
def test_points_that_fail_at_run_time_end_in_a_summary_not_a_traceback(tmp_path):
    """Points that pass pre-flight and fail in the run (a reward function that raises on a model's completion): the
    sweep printed Hydra's 'Error executing job' and a traceback of run_point. Now every point runs, the summary names
    each failed one with its reason (the run's 'error:' line, kept in status.json) and run dir, and the exit is 1."""
    (tmp_path / "bad.py").write_text(FAILS_AT_RUN_TIME)
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    p = launch("-m", "loss.clip_high=0.2,0.28", "env=math", f"env.reward_fn={tmp_path}/bad.py:boom",
               "grpo.max_steps=1", "logging.mlflow=false", f"output_root={out}", timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "Error executing job" not in text, text[-3000:]
    summary = p.stdout[p.stdout.index("sweep summary (2 runs, 2 failed):"):].splitlines()
    for clip in ("0.2", "0.28"):
        run_dir = out / f"tiny-grpo_loss.clip_high={clip}"
        (row,) = [i for i, line in enumerate(summary) if line.split()[:2] == [run_dir.name, "FAILED"]]
        why = summary[row + 1]
        assert "exit 1: reward function" in why and "raised ValueError: reward broke on" in why, why
        assert why.endswith(f"(run dir {run_dir})"), why
        assert json.loads((run_dir / "status.json").read_text())["message"].startswith("reward function")
    assert p.stderr.strip().splitlines()[-1].startswith("sweep failed: 2 of 2 point(s) failed")


MOVES_THE_DATA = """import os

def score(prompt, completion, answer=None, **row):
    if str(completion).strip() != str(answer).strip() and os.path.exists({val!r}):
        os.remove({val!r})  # the user moves the val set away while the first point runs
    return float(str(completion).strip() == str(answer).strip())
"""


@pytest.mark.extended  # 2 real runs (CI's time), as the test above
def test_a_point_refused_when_its_turn_comes_is_named_with_its_reason(tmp_path):
    """A point that passed the sweep's check and is refused when its turn comes (its val file removed meanwhile):
    nothing was printed for it, and the summary's reason was 'RuntimeError' text or '1 config violation(s)'. Now its
    config error is printed, and the summary's line names the key and why."""
    import shutil

    from helpers import ROOT

    val = tmp_path / "val.jsonl"
    shutil.copy(ROOT / "data" / "math_val.jsonl", val)
    (tmp_path / "moves.py").write_text(MOVES_THE_DATA.format(val=str(val)))
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    p = launch("-m", "loss.clip_high=0.2,0.28", "env=math", f"env.val_path={val}",
               f"env.train_path={ROOT / 'data' / 'math_train.jsonl'}", f"env.reward_fn={tmp_path}/moves.py:score",
               "grpo.max_steps=1", "logging.mlflow=false", f"output_root={out}", timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 1 and not val.exists(), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "point tiny-grpo_loss.clip_high=0.28: config error" in p.stderr and f"no file at {val}" in p.stderr
    summary = p.stdout[p.stdout.index("sweep summary (2 runs, 1 failed):"):].splitlines()
    (row,) = [i for i, line in enumerate(summary) if line.split()[:2] == ["tiny-grpo_loss.clip_high=0.28", "FAILED"]]
    assert summary[row + 1].strip().startswith(f"config error: env.val_path: no file at {val}"), summary
    assert any(line.split()[:2] == ["tiny-grpo_loss.clip_high=0.2", "COMPLETED"] for line in summary), summary


def test_ctrl_c_in_a_point_stops_the_sweep(tmp_path):
    """Ctrl-C stopped the running point (checkpoint, exit 130) and the sweep went on to the next point, which ran to
    its end: the user's Ctrl-C stopped nothing. Now the sweep stops there, its summary says which points did not run,
    and the exit is the point's 130."""
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    first, second = out / "tiny-grpo_grpo.seed=1", out / "tiny-grpo_grpo.seed=2"
    rc, text = interrupted(["-m", "grpo.seed=1,2", "grpo.max_steps=500", "logging.mlflow=false", f"output_root={out}"],
                           tmp_path / "sweep.log", "step 2/500", "the first point's second step")
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text and not second.exists(), text[-3000:]
    assert "sweep stopped: run tiny-grpo_grpo.seed=1 was stopped (exit 130); no later point is started" in text
    summary = text[text.index("sweep summary (2 runs"):].splitlines()
    assert any(line.split()[:2] == [first.name, "STOPPED"] for line in summary), summary
    assert any(line.split()[:3] == [second.name, "NOT", "RUN"] for line in summary), summary


@pytest.mark.extended  # in make test-all: CI's time (benchmarks/results/ci-rehearsals.md)
def test_the_same_sweep_again_skips_its_finished_points_and_runs_the_rest(tmp_path):
    """After a Ctrl-C or a failed point, the same command again was refused whole ('run ... already finished', rule
    run_name_not_finished, for each point that had finished): the rest of the sweep could not be run. Now a finished
    point is skipped, said so, its run dir untouched, and the others run."""
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    done = out / "tiny-grpo_grpo.seed=1"
    common = ["grpo.max_steps=1", "logging.mlflow=false", f"output_root={out}"]
    first = launch("grpo.seed=1", f"name='{done.name}'", *common)  # the sweep's first point, finished before
    assert first.returncode == 0, first.stderr[-3000:]
    launches = (done / "repro" / "launches.jsonl").read_text()
    p = launch("-m", "grpo.seed=1,2", *common)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert f"grpo-launcher: run '{done.name}' already finished ({done}): skipped" in p.stdout, p.stdout[-3000:]
    assert (done / "repro" / "launches.jsonl").read_text() == launches  # not launched again
    summary = p.stdout[p.stdout.index("sweep summary (2 runs):"):].splitlines()
    for name in (done.name, "tiny-grpo_grpo.seed=2"):
        assert any(line.split()[:2] == [name, "COMPLETED"] for line in summary), summary
    # the same points with another fixed key: their runs finished under other values, so their results are not
    # this sweep's (both were skipped, reported COMPLETED, exit 0, the old train.lr's results standing)
    other = launch("-m", "grpo.seed=1,2", "train.lr=1e-4", *common)
    assert other.returncode == 2 and other.stderr.startswith("config error"), other.stderr[-3000:]
    assert "  - train.lr, name: run 'tiny-grpo_grpo.seed=1' already finished" in other.stderr, other.stderr[-3000:]
    assert "0.0003 there, 0.0001 here" in other.stderr and "Traceback" not in other.stdout + other.stderr
    assert (done / "repro" / "launches.jsonl").read_text() == launches


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


# ------------------------------------------------------------------ issue 41: what every point shares, done once


@pytest.fixture(scope="module")
def loader_and_master():
    """Hydra's config loader over conf/ and a multirun's master config, as `launch.py -m` has them."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import JobRuntime
    from hydra.types import RunMode

    import hydra_plugins.grpo_launcher_plugins.grpo_launcher  # noqa: F401 (registers hydra/launcher=grpo)
    from grpo_launcher.spec.compose import CONF_DIR, register_schema

    register_schema()
    JobRuntime.instance().set("name", "launch")
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
    master = loader.load_configuration("config", ["hydra/launcher=grpo", "hydra/sweeper=grpo"], RunMode.MULTIRUN)
    return loader, master


@pytest.mark.parametrize("point", [
    ["grpo.seed=3", "cluster=slurm", "dry_run=True", "name='tiny-grpo_grpo.seed=3'"],
    ["model=nemotron_h_tiny", "train.lr=1e-5", "grpo.seed=1", "grpo.seed=2"],
    ["+recipe=nanov3", "loss.clip_high=0.3"],
    ["train.lr=${loss.clip_high}", "cluster.nodes=2", "grpo={seed: 4}"],
    ["+foo=1", "foo=2", "grpo.seed=9"],
    ["loss.clip_high=0.3", "~logging.experiment", "logging.experiment=foo"],
    ["nope.key=1"],
    ["model=nope", "grpo.seed=1"],
    ["hydra.job.chdir=false", "grpo.seed=1"],
])
def test_a_point_composes_as_hydra_composes_it(loader_and_master, point):
    """Points share Hydra's composition of their group choices (hydra_plugins/.../shared_compose.py): each
    point's config, or its error, is the one Hydra's load_sweep_config gives."""
    from omegaconf import OmegaConf

    from hydra_plugins.grpo_launcher_plugins.shared_compose import SharedCompose

    loader, master = loader_and_master
    shared = SharedCompose(loader, master)

    def composed(compose):
        try:
            cfg = compose(list(point))
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg.hydra)

    hydra = composed(lambda ov: loader.load_sweep_config(master, ov))
    assert composed(shared) == hydra
    assert composed(shared) == hydra  # the second point of the same choices: from the shared composition


def test_points_of_the_same_choices_compose_once(loader_and_master):
    from hydra_plugins.grpo_launcher_plugins.shared_compose import SharedCompose

    shared = SharedCompose(*loader_and_master)
    for seed in range(4):
        for model in ("tiny", "nemotron_h_tiny"):
            shared([f"grpo.seed={seed}", f"model={model}", "dry_run=True", f"name=n{seed}"])
    assert sorted(shared.bases) == [("model=nemotron_h_tiny",), ("model=tiny",)]


def put(spec, key, value):
    """The spec with one leaf replaced (dataclasses.replace down the key's sections)."""
    import dataclasses

    section, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(spec, **{key: value})
    return dataclasses.replace(spec, **{section: put(getattr(spec, section), rest, value)})


def without_tmp(violations):
    import re

    return [re.sub(r"grpo-spec-[^/]+", "grpo-spec-TMP", repr(v)) for v in violations]


TRICKY = ["1e5", "true", "on", "null", "~", "???", "${x}", "\\${x}", "a: b", "x\ny", "", " lead", "0x10", "1:20",
          ".nan", "#c", "'q'", "[1]", "é", "x" * 200, "http://u:pw@h/x", "a?token=z", "<<", "*a", "!t", "12"]


@pytest.mark.parametrize("key,value", [
    *[("name", s) for s in TRICKY], *[("logging.experiment", s) for s in TRICKY],
    *[("grpo.seed", v) for v in (0, -1, 2**70, True, 1.5, "3", None)],
    *[("train.lr", v) for v in (1e-6, 1e16, float("inf"), float("nan"), -0.0, 3, "1e-6", None)],
    *[("model.head_dim", v) for v in (None, 64, "64")],
    ("rollout.backend", "vllm"),
    *[("rollout.http_api_key", s) for s in [*TRICKY, "abc", "\udcff", 5, [], None]],
    *[("env.reward_fns", v) for v in ([], ["a"], ["a", "${x}"], ["1e5", "true"], ("a",), [1])],
])
def test_a_point_reads_back_as_the_full_round_trip_says(tmp_path, key, value):
    """spec.yaml's round trip, shown leaf by leaf from a spec that passed it (launch/read_back.py), never passes a
    spec the full check (written and read back as the job does) refuses; a plain seed or name takes that path."""
    from grpo_launcher.launch import read_back
    from grpo_launcher.launch.preflight import read_back_as_the_job, roundtrip
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec, roundtrip_problems

    spec = load_spec(["cluster=slurm", "dry_run=true", f"output_root={tmp_path}"])
    plan = make_plan(spec)
    assert roundtrip(spec, plan) == []  # the full check: remembered
    point = put(spec, key, value)
    full = roundtrip_problems(point, read_back_as_the_job(plan))
    assert not (read_back.reads_back_like_one_before(point) and full)
    assert without_tmp(roundtrip(point, plan)) == without_tmp(full)  # each full check writes to a temporary dir
    if key in ("name", "grpo.seed") and value in ("1e5", "x" * 200, 2**70, 0):
        assert read_back.reads_back_like_one_before(point)


def test_points_with_their_own_http_key_read_back_leaf_by_leaf(tmp_path):
    """A sweep with rollout.expose_http_server draws a fresh key (a secret) per point: after the first point's full
    check, the others are shown leaf by leaf, and each still reads back (the full check agrees)."""
    from secrets import token_hex

    from grpo_launcher.launch import read_back
    from grpo_launcher.launch.preflight import read_back_as_the_job, roundtrip
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec, roundtrip_problems

    http = ["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true"]
    spec = load_spec([*http, "dry_run=true", f"output_root={tmp_path}"])
    plan = make_plan(spec)
    assert spec.rollout.http_api_key is None and roundtrip(put(spec, "rollout.http_api_key", token_hex(32)), plan) == []
    for seed in range(3):
        point = put(put(spec, "rollout.http_api_key", token_hex(32)), "grpo.seed", seed)
        assert read_back.reads_back_like_one_before(point)
        assert roundtrip_problems(point, read_back_as_the_job(plan)) == []
