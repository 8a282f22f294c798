"""The plan's tracking line says where runs are tracked, and that they are not when MLflow is off."""

from __future__ import annotations


def test_the_plan_names_no_store_when_mlflow_is_off(launch_here, tmp_path):
    """logging.mlflow=false printed 'tracking : sqlite:///OUTPUT_ROOT/mlflow.db', a store nothing is written to."""
    off = launch_here(tmp_path, "dry_run=true", "logging.mlflow=false", f"output_root={tmp_path}")
    on = launch_here(tmp_path, "dry_run=true", f"output_root={tmp_path}")
    assert off.returncode == on.returncode == 0, off.stderr + on.stderr
    assert "tracking             : MLflow off (logging.mlflow=false)\n" in off.stdout and "mlflow.db" not in off.stdout
    assert f"tracking             : sqlite:///{tmp_path.resolve() / 'mlflow.db'}\n" in on.stdout
