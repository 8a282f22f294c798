"""The ecosystem's conventions, through `launch.py` (issue 31): MLflow's own environment variables, subcommand typos,
Hydra's submitit launcher without -m refused with a pointer, the dry run's sbatch script, and the resume command
after a stop. The fast tests run launch.py's main in this process (dry runs, refusals); one slow run trains."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import sys
from pathlib import Path

import pytest

from helpers import ROOT, launch, share_models

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "rollout.max_new_tokens=6"]


@pytest.mark.slow
@pytest.mark.extended
def test_a_run_goes_to_the_mlflow_store_of_the_environment_and_resumes_there(tmp_path):
    """MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME: the run's metrics land there (not in the output root), a stop
    (must_save_by=0: saved and stopped after step 1, exit 3) prints the resume command, and that command continues the same MLflow run."""
    env = {"MLFLOW_TRACKING_URI": "sqlite:///team.db", "MLFLOW_EXPERIMENT_NAME": "team"}
    (tmp_path / "out").mkdir()
    share_models(tmp_path / "out")  # the tiny model, built once for the suite
    args = [*SMALL, "output_root=out", "name=conv", "grpo.max_steps=2", "checkpoint.must_save_by=00:00:00"]
    r = launch(*args, cwd=tmp_path, env=env)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"MLflow runs go to sqlite:///{tmp_path.resolve()}/team.db (from MLFLOW_TRACKING_URI)" in r.stdout
    resume = next(line for line in r.stdout.splitlines() if line.strip().startswith("resume"))
    words = shlex.split(resume.split(":", 1)[1])
    assert words[:3] == ["MLFLOW_TRACKING_URI=sqlite:///team.db", "MLFLOW_EXPERIMENT_NAME=team", "python"], resume
    r = launch(*words[4:], cwd=tmp_path, env=env)  # the printed command (its launch.py path and overrides)
    assert r.returncode in (0, 3), r.stdout[-3000:] + r.stderr[-3000:]
    assert not (tmp_path / "out" / "mlflow.db").exists()
    with sqlite3.connect(tmp_path / "team.db") as db:
        runs = db.execute("SELECT r.name, COUNT(DISTINCT m.step) FROM runs r JOIN experiments e ON "
                          "r.experiment_id = e.experiment_id JOIN metrics m ON m.run_uuid = r.run_uuid "
                          "WHERE e.name = 'team' AND m.key = 'train/reward_mean' GROUP BY r.run_uuid").fetchall()
    assert runs == [("conv", 2)], runs  # one MLflow run, both steps


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.extended  # in make test-all: CI's time (benchmarks/results/ci-rehearsals.md)
def test_cluster_ray_joins_an_existing_cluster_with_its_token_and_leaves_it_running(tmp_path):
    """A real `ray start --head --block` with token auth (its own token file and temp dir), stopped by its PID at the
    end. RAY_ADDRESS + cluster=ray: the run joins (RAY_AUTH_MODE=token set for it), trains 2 steps, and leaves the
    cluster up with every CPU free again and its placement group removed; a wrong token is a config error."""
    import subprocess
    import tempfile

    from helpers import wait_until

    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4)
    token.chmod(0o600)
    port = free_port()
    temp = tempfile.mkdtemp(prefix="grpo-rh-", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", f"--temp-dir={temp}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = [sys.executable, "-c", "import json, ray; ray.init(logging_level='ERROR'); from ray.util import "
             "placement_group_table as t; print(json.dumps([ray.available_resources().get('CPU'), "
             "sorted({p['state'] for p in t().values()})]))"]
    try:
        import socket

        wait_until(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 120, "the Ray head's GCS port")
        (tmp_path / "out").mkdir()
        share_models(tmp_path / "out")
        user = {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_TOKEN_PATH": str(token)}  # no RAY_AUTH_MODE: we set it
        run_env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")} | user
        r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cluster=ray", *SMALL,
                            "output_root=out", "name=joined", "grpo.max_steps=2", "logging.mlflow=false"],
                           cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"joining the Ray cluster at 127.0.0.1:{port} (auth: token)" in r.stdout
        assert "run 'joined' finished at step 2" in r.stdout
        assert head.poll() is None  # the cluster is still up
        p = subprocess.run(probe, env={**run_env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        cpus, states = json.loads(p.stdout.strip().splitlines()[-1])
        assert cpus == 2.0 and states in ([], ["REMOVED"]), p.stdout  # what the run took is released

        bad = run_env | {"RAY_AUTH_TOKEN": "f" * 64}
        r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cluster=ray", *SMALL,
                            "output_root=out", "name=refused", "grpo.max_steps=1", "logging.mlflow=false"],
                           cwd=tmp_path, env=bad, capture_output=True, text=True, timeout=600)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "  - cluster.ray_address: could not join the Ray cluster" in r.stderr and "Traceback" not in r.stderr
        assert head.poll() is None
    finally:
        head.terminate()  # `ray start --block` stops the processes it started on SIGTERM
        head.wait(timeout=60)
