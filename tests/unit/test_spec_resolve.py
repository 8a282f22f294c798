"""The spec is resolved once (spec/resolve.py) and never rewritten after pre-flight: what the driver receives is
what pre-flight validated and wrote to spec.yaml, the launch's own values (MLflow's variables, the HTTP key, the
Slurm job's absolute output_root) included."""

from __future__ import annotations

import re

import pytest

from grpo_launcher.launch import execute, rundir
from grpo_launcher.launch.preflight import preflight
from grpo_launcher.launch.sbatch import render
from grpo_launcher.spec import resolve
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.preflight.validate import validate

HTTP = ["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true"]


@pytest.fixture
def driver_entry(monkeypatch):
    """What reaches the driver's entry (train/driver.py run) of a cluster=local launch: recorded, not run (no Ray).
    The environment variables a local launch sets for its Ray are put back afterwards."""
    from grpo_launcher.train import driver

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_enable_metrics_collection"):
        monkeypatch.delenv(name, raising=False)
    got: list = []
    monkeypatch.setattr(driver, "run", lambda spec, plan, pending=(): got.append((spec, plan)) or 0)
    return got


def test_the_driver_receives_the_spec_preflight_validated_and_wrote(tmp_path, monkeypatch, driver_entry):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///team.db")  # relative: made absolute once, at pre-flight
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    launch = preflight(["output_root=out", *HTTP])
    spec, plan = launch.spec, launch.plan
    assert validate(spec) == [] and launch.script is None  # a local run has no job script
    assert re.fullmatch(r"[0-9a-f]{64}", spec.rollout.http_api_key)  # drawn by resolve, not by the driver
    assert spec.logging.tracking_uri == f"sqlite:///{tmp_path.resolve()}/team.db" and spec.logging.experiment == "team"
    assert execute(launch) == 0  # the one door: the executor of the cluster kind (local)
    [(received, _)] = driver_entry
    assert received == spec  # the very spec pre-flight validated ...
    assert rundir.load_spec_file(plan.run_dir / "spec.yaml") == spec  # ... and wrote for the job (secrets included)
    assert spec.rollout.http_api_key not in (plan.run_dir / "spec.yaml").read_text()  # redacted there


def test_a_slurm_job_reads_the_spec_preflight_validated(tmp_path, monkeypatch):
    """The job's view (output_root absolute) is part of the resolved spec: the script rendered at pre-flight and the
    spec.yaml the job reads hold the validated spec; nothing makes a second, job-only copy."""
    monkeypatch.chdir(tmp_path)
    launch = preflight(["cluster=slurm", "output_root=rel", "dry_run=true"])
    spec, plan = launch.spec, launch.plan
    assert spec.output_root == str(tmp_path.resolve() / "rel") and validate(spec) == []
    assert launch.script == render(spec, plan) and f"RUN_DIR={plan.run_dir}\n" in launch.script  # rendered once
    rundir.prepare(spec, plan)  # what the submission writes before sbatch
    assert rundir.load_spec_file(plan.run_dir / "spec.yaml") == spec


def test_resolve_runs_its_steps_in_the_documented_order():
    documented = re.findall(r"^ +\d\. (.+?) {2,}", resolve.__doc__ or "", re.M)
    assert documented == [s.name for s in resolve.STEPS]
    launch_only = [s.name for s in resolve.STEPS if s.launch_only]
    assert launch_only == ["tracking store", "job's view", "HTTP API key"]


def test_a_config_read_is_resolved_but_takes_no_launch_values(monkeypatch):
    """load_spec (tests, eval, probes) resolves the config's own facts, not a launch's: no key drawn, no variable."""
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    spec = load_spec([*HTTP, "cluster=slurm", "output_root=rel"])
    assert spec.rollout.http_api_key is None and spec.logging.experiment == "grpo" and spec.output_root == "rel"
    assert resolve.resolve(spec, launch=True)[0].rollout.http_api_key is not None
