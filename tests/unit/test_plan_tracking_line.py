"""The plan's tracking line says where runs are tracked, and that they are not when MLflow is off."""

from __future__ import annotations


def test_the_plan_names_no_store_when_mlflow_is_off(launch_here, tmp_path):
    """logging.mlflow=false printed 'tracking : sqlite:///OUTPUT_ROOT/mlflow.db', a store nothing is written to."""
    off = launch_here(tmp_path, "dry_run=true", "logging.mlflow=false", f"output_root={tmp_path}")
    on = launch_here(tmp_path, "dry_run=true", f"output_root={tmp_path}")
    assert off.returncode == on.returncode == 0, off.stderr + on.stderr
    assert "tracking             : MLflow off (logging.mlflow=false)\n" in off.stdout and "mlflow.db" not in off.stdout
    assert f"tracking             : sqlite:///{tmp_path.resolve() / 'mlflow.db'}\n" in on.stdout


def test_the_plan_warns_when_local_cpu_slots_ask_for_more_cores_than_the_machine_has():
    """cluster.cpus_per_worker=64 on a local CPU run started without a word: Ray is told the cores exist, and the
    workers' threads then share the real ones."""
    import os

    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import compose, to_spec

    cores = len(os.sched_getaffinity(0))

    def line(*overrides: str) -> str:
        lines = make_plan(to_spec(compose(list(overrides)))).summary().splitlines()
        return next(x for x in lines if x.startswith("Ray bundle"))

    assert "warning" not in line()
    many = line(f"cluster.cpus_per_worker={cores + 62}")
    assert f"{cores + 62} cores asked, this machine has {cores}" in many and "cluster.cpus_per_worker" in many
