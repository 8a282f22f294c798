"""The ecosystem's conventions, through `launch.py` (issue 31): MLflow's own environment variables, subcommand typos,
Hydra's submitit launcher without -m refused with a pointer, the dry run's sbatch script, and the resume command
after a stop. The fast tests run launch.py's main in this process (dry runs, refusals); one slow run trains."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture
def no_mlflow_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ------------------------------------------------------------------ MLflow's environment variables


@pytest.mark.parametrize("value, expected", [
    ("sqlite:///team.db", "sqlite:///{tmp}/team.db"),  # relative to where launch.py starts, made absolute
    ("http://127.0.0.1:5999", "http://127.0.0.1:5999"),
    ("mlruns", "{tmp}/mlruns"),  # a plain path: MLflow's file store
])
def test_mlflow_tracking_uri_and_experiment_name_are_honoured(launch_here, no_mlflow_env, tmp_path, value, expected):
    no_mlflow_env.setenv("MLFLOW_TRACKING_URI", value)
    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    r = launch_here(tmp_path, "dry_run=true", "output_root=out")
    assert r.returncode == 0, r.stderr
    uri = expected.format(tmp=tmp_path.resolve())
    assert (f"MLflow runs go to {uri} (from MLFLOW_TRACKING_URI), experiment 'team' (from MLFLOW_EXPERIMENT_NAME)"
            in r.stdout), r.stdout
    assert f"tracking             : {uri}\n" in r.stdout  # the plan (and so the driver) uses it
    assert "mlflow.db" not in r.stdout


def test_logging_keys_on_the_command_line_win_over_the_variables(launch_here, no_mlflow_env, tmp_path):
    no_mlflow_env.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    cli = f"sqlite:///{tmp_path}/cli.db"
    r = launch_here(tmp_path, "dry_run=true", "output_root=out", f"logging.tracking_uri={cli}",
                    "logging.experiment=grpo")  # the default's value, given explicitly: it wins too
    assert r.returncode == 0, r.stderr
    assert (f"MLflow runs go to {cli} (from logging.tracking_uri; MLFLOW_TRACKING_URI not used), experiment 'grpo' "
            "(from logging.experiment; MLFLOW_EXPERIMENT_NAME not used)") in r.stdout, r.stdout


def test_without_the_variables_runs_go_to_the_output_root(launch_here, no_mlflow_env, tmp_path):
    r = launch_here(tmp_path, "dry_run=true", "output_root=out")
    assert r.returncode == 0, r.stderr
    assert (f"MLflow runs go to sqlite:///{tmp_path.resolve()}/out/mlflow.db (from the output root's store "
            "(MLFLOW_TRACKING_URI unset)), experiment 'grpo'") in r.stdout, r.stdout


def test_a_tracker_does_not_export_its_store_as_the_users(tmp_path, no_mlflow_env):
    """MLflow's global set_tracking_uri exports MLFLOW_TRACKING_URI: the next point of an in-process sweep (say
    output_root=a,b) would take the first point's store for the user's."""
    from grpo_launcher.spec.schema import RunSpec
    from grpo_launcher.tracking import Tracker

    tracker = Tracker(RunSpec(), f"sqlite:///{tmp_path}/m.db", tmp_path, buffer_until_commit=False)
    tracker.close()
    assert "MLFLOW_TRACKING_URI" not in os.environ


# ------------------------------------------------------------------ subcommands, launchers, dry run


def test_a_subcommand_typo_suggests_the_command(launch_here, tmp_path):
    r = launch_here(tmp_path, "staus", "my-run")
    assert r.returncode == 2
    assert "config error" in r.stderr and "did you mean 'status'? python launch.py status my-run" in r.stderr
    assert "quote the value" not in r.stderr
    r = launch_here(tmp_path, "dry_run")  # a key without its value is not taken for `rerun`
    assert r.returncode == 2 and "did you mean" not in r.stderr and "dry_run" in r.stderr


@pytest.mark.parametrize("args, pointer", [  # with -m it runs the points (tests/integration/test_submitit.py)
    (["hydra/launcher=submitit_slurm", "dry_run=true"], "cluster=slurm [-m KEY=a,b]"),
    (["hydra/launcher=submitit_local", "dry_run=true"], "python launch.py -m hydra/launcher=submitit_local"),
])
def test_hydra_submitit_launcher_without_m_is_refused_with_a_pointer(launch_here, tmp_path, args, pointer):
    r = launch_here(tmp_path, *args, "output_root=out")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("config error: 1 problem"), r.stderr
    assert "hydra/launcher:" in r.stderr and pointer in r.stderr and "[rule: hydra_launcher]" in r.stderr
    assert "Traceback" not in r.stderr and "Could not find" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_slurm_dry_run_says_its_script_is_not_written(launch_here, tmp_path):
    r = launch_here(tmp_path, "cluster=slurm", "dry_run=true", "output_root=out")
    assert r.returncode == 0, r.stderr
    script = tmp_path.resolve() / "out" / "tiny-grpo" / "job.sbatch"
    assert (f"dry run: nothing was written: a real launch writes the script above to {script} and submits it"
            in r.stdout), r.stdout
    assert not script.exists()


# ------------------------------------------------------------------ the end-of-run block


def stopped_run(tmp_path: Path, monkeypatch, argv: list[str]) -> tuple[object, object]:
    """A spec and plan of a run dir holding one checkpoint, as after a stop at step 2."""
    from grpo_launcher.launch.preflight import preflight

    monkeypatch.chdir(tmp_path)
    spec, plan = preflight(["output_root=out", "grpo.max_steps=5"])
    step = plan.checkpoint_dir / "step_000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 2}\n')
    monkeypatch.setattr(sys, "argv", argv)
    return spec, plan


@pytest.mark.parametrize("rc", [143, 130, 3])
def test_the_end_of_run_block_after_a_stop_offers_the_same_launch(tmp_path, no_mlflow_env, capsys, rc):
    from grpo_launcher.tracking.report import finish_run

    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    spec, plan = stopped_run(tmp_path, no_mlflow_env, ["launch.py", "output_root=out", "grpo.max_steps=5"])
    (plan.run_dir / "repro").mkdir()
    tracker = SimpleNamespace(run_id="abc", experiment_id="7")
    assert finish_run(spec, plan, SimpleNamespace(step=2, tracker=tracker), rc) == rc
    out = capsys.readouterr().out
    assert "resume" in out and "MLFLOW_EXPERIMENT_NAME=team python launch.py grpo.max_steps=5 output_root=out " \
                               "name=tiny-grpo" in out  # fmt: skip
    assert "rerun" not in out
    assert f"{plan.tracking_uri}  experiment 'team'  run abc" in out


@pytest.mark.parametrize("argv, expect", [
    (["launch.py", "name=now${now:%H%M%S}", "grpo.max_steps=5"],  # another name at every launch
     "python launch.py grpo.max_steps=5 output_root={root} name={name}"),
    (["launch.py", "grpo.max_steps=5"],  # output_root from $GRPO_OUTPUT_ROOT: written out
     "python launch.py grpo.max_steps=5 output_root={root} name={name}"),
    (["launch.py", "grpo.max_steps=5", "rollout.http_api_key=SUPERSECRET123"],  # a credential: the run's own spec
     "python launch.py rerun {run_dir} name={name}"),
], ids=["interpolated-name", "env-output-root", "credential"])
def test_the_resume_command_continues_this_run_and_never_prints_a_credential(argv, expect):
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.tracking.report import resume_command

    spec = load_spec(["output_root=/tmp/r", "name=now024218", "dry_run=true"])
    plan = make_plan(spec)
    got = resume_command(spec, plan, argv)
    assert got.endswith(expect.format(root="/tmp/r", name="now024218", run_dir=plan.run_dir)), got
    assert "SUPERSECRET123" not in got


def test_a_stopped_slurm_driver_offers_its_own_spec_under_the_same_name(tmp_path, no_mlflow_env, capsys):
    """The job's driver was not started by the user's command line: the run's spec.yaml under its name resumes it."""
    from grpo_launcher.tracking.report import finish_run

    spec, plan = stopped_run(tmp_path, no_mlflow_env, ["-m", "grpo_launcher.train.driver", "spec.yaml"])
    finish_run(spec, plan, SimpleNamespace(step=2, tracker=None), 143)
    assert "resume" in (out := capsys.readouterr().out)
    assert f"python launch.py rerun {plan.run_dir} name=tiny-grpo" in out


# ------------------------------------------------------------------ status: elapsed time and ETA


def test_status_shows_elapsed_time_and_eta_of_a_live_local_run(launch_here, tmp_path):
    """A live local run (this process's pid) started 100 s ago, at step 5 of 10, 2 s per step lately: the ETA is the
    5 steps left at that pace; a resumed step's last line counts."""
    import json
    import socket
    import time

    run = tmp_path / "out" / "live"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({
        "kind": "local", "name": "live", "state": "RUNNING", "pid": os.getpid(), "host": socket.gethostname(),
        "max_steps": 10, "events": {"started": time.time() - 100}}))
    steps = [(s, 9.0) for s in (1, 2, 3)] + [(s, 2.0) for s in (1, 2, 3, 4, 5)]  # a resume from step 0 logs 1..3 again
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/step_s": t}) + "\n" for s, t in steps))
    r = launch_here(tmp_path, "status", "live", "--root", "out")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("time"))
    assert line.startswith("time       elapsed 0:01:4"), line  # 100 s and the test's own time
    assert line.endswith("(this start); eta 0:00:10 (5 steps left at 2 s/step, the mean of the last 5)"), line
    r = launch_here(tmp_path, "status", "live", "--root", "out", "--json")
    assert "eta 0:00:10" in json.loads(r.stdout)["timing"]


# ------------------------------------------------------------------ cluster=ray: an existing Ray cluster


@pytest.mark.parametrize("args, message", [
    (["cluster=ray"], "cluster=ray needs the cluster's address HOST:PORT, got '' (RAY_ADDRESS is unset)"),
    (["cluster=ray", "cluster.ray_address=ray://head:10001"], "cluster=ray needs the cluster's address HOST:PORT, "
                                                              "got 'ray://head:10001'"),
    (["cluster=ray", "cluster.ray_address=127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
])
def test_a_bad_ray_address_is_a_config_error(launch_here, tmp_path, monkeypatch, args, message):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    r = launch_here(tmp_path, *args, "output_root=out")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "  - cluster.ray_address: " + message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_local_runs_ray_token_is_private_fresh_and_read_by_ray_again(tmp_path):
    """Each local run of a process (an in-process sweep's points) gets a fresh 0600 token in its own run dir, and a
    Ray imported before it reads the new one: Ray reads its auth mode at import and caches the token at first use."""
    import subprocess

    code = ("import os, sys; from types import SimpleNamespace as N; from pathlib import Path\n"
            "import ray; from ray._raylet import AuthenticationTokenLoader as L\n"
            "from ray._private.authentication.authentication_utils import is_token_auth_enabled\n"
            "from grpo_launcher.launch.local import private_ray_token, ray_rereads_auth\n"
            "tokens = []\n"
            "for name in ('a', 'b'):\n"
            "    d = Path(sys.argv[1]) / name; d.mkdir(); private_ray_token(N(run_dir=d)); f = d / '.ray_auth_token'\n"
            "    assert os.environ['RAY_AUTH_TOKEN_PATH'] == str(f) and f.stat().st_mode & 0o077 == 0\n"
            "    assert is_token_auth_enabled() and L.instance().get_raw_token() == f.read_text()\n"
            "    tokens.append(f.read_text())\n"
            "    del os.environ['RAY_AUTH_MODE'], os.environ['RAY_AUTH_TOKEN_PATH']; ray_rereads_auth()\n"
            "    assert not is_token_auth_enabled()\n"
            "assert tokens[0] != tokens[1] and all(len(t) == 64 for t in tokens), tokens\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
