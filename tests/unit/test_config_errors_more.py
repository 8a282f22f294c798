"""Config errors QA found after a clean dry run (each refused before anything starts, exit 2, the key named with a
whole fix): an MLflow store no MLflow store opens (bogus://), a file store MLflow 3 refuses without
MLFLOW_ALLOW_FILE_STORE, an experiment name MLflow refuses (''), a range's fix cut at its '(' and `recipe=NAME`
without the '+'. In-process dry runs (launch_here) and validation: nothing trains."""

from __future__ import annotations

import pytest

from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.tracking import store


@pytest.fixture
def no_mlflow_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def refused(r) -> str:
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "config error" in r.stderr and "Traceback" not in r.stderr + r.stdout, r.stderr
    return r.stderr


# ------------------------------------------------------------------ the store's scheme (item 1)


def test_an_unknown_tracking_uri_scheme_is_a_config_error(launch_here, no_mlflow_env, tmp_path):
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out", "logging.tracking_uri=bogus://x"))
    assert "  - logging.tracking_uri: the MLflow store bogus://x (from logging.tracking_uri) has the scheme 'bogus:'" \
        in err, err
    for works in ("sqlite:///PATH.db", "http(s)://HOST:PORT", "postgresql://", "databricks", "a directory path"):
        assert works in err, err
    assert "fix: set logging.tracking_uri to one of those" in err, err


def test_an_unknown_scheme_from_the_variable_names_it(launch_here, no_mlflow_env, tmp_path):
    no_mlflow_env.setenv("MLFLOW_TRACKING_URI", "bogus://x")
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out"))
    assert "  - MLFLOW_TRACKING_URI, logging.tracking_uri: the MLflow store bogus://x (from MLFLOW_TRACKING_URI)" \
        in err, err
    assert "fix: unset MLFLOW_TRACKING_URI" in err, err


def test_a_real_launch_is_refused_for_it_before_anything_starts(launch_here, no_mlflow_env, tmp_path):
    err = refused(launch_here(tmp_path, "output_root=out", "name=bog", "grpo.max_steps=2",
                              "logging.tracking_uri=bogus://x"))
    assert "logging.tracking_uri" in err and not (tmp_path / "out" / "bog").exists()


def test_no_store_no_scheme_check(launch_here, no_mlflow_env, tmp_path):
    r = launch_here(tmp_path, "dry_run=true", "output_root=out", "logging.tracking_uri=bogus://x",
                    "logging.mlflow=false")
    assert r.returncode == 0, r.stderr


def test_the_schemes_known_without_mlflow_are_mlflows_own():
    """The fast path (no mlflow import at pre-flight) holds exactly the schemes MLflow's two registries hold."""
    assert sorted(store.MLFLOW_SCHEMES) == store.mlflow_schemes()


@pytest.mark.parametrize("uri", ["sqlite:////tmp/m.db", "postgresql+psycopg2://u@h/db", "mysql://h/db",
                                 "https://mlflow.example:5000", "databricks", "databricks://profile", "uc:x",
                                 "file:///tmp/mlruns", "/tmp/mlruns", "relative/mlruns"])
def test_every_store_mlflow_opens_passes(uri):
    assert store.scheme_problem(uri) is None


def test_a_plugins_scheme_is_looked_up_in_mlflows_registries(monkeypatch):
    from mlflow.tracking._model_registry.utils import _get_store_registry
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    assert "has the scheme 'myplug:'" in store.scheme_problem("myplug://h")
    monkeypatch.setitem(_tracking_store_registry._registry, "myplug", object())
    monkeypatch.setitem(_get_store_registry()._registry, "myplug", object())
    assert store.scheme_problem("myplug://h") is None
    assert "myplug:// (a plugin's)" in store.scheme_problem("bogus://h")


# ------------------------------------------------------------------ a file store (probe: a real launch from here)


def test_a_file_store_without_mlflow_allow_file_store_is_refused(no_mlflow_env, tmp_path):
    with pytest.raises(ConfigError) as info:
        load_spec([f"output_root={tmp_path}/out", f"logging.tracking_uri={tmp_path}/mlruns"])
    (v,) = [v for v in info.value.violations if v.rule == "tracking_store_reachable"]
    assert "logging.tracking_uri" in v.keys
    assert "MLFLOW_ALLOW_FILE_STORE=true (unset)" in v.message and f"sqlite:///{tmp_path}/mlruns.db" in v.message
    no_mlflow_env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert load_spec([f"output_root={tmp_path}/out", f"logging.tracking_uri={tmp_path}/mlruns"])


def test_mlflow_refuses_a_file_store_as_the_rule_says(no_mlflow_env, tmp_path):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="MLFLOW_ALLOW_FILE_STORE"):
        MlflowClient(tracking_uri=str(tmp_path / "mlruns"))
    assert store.file_store_problem(str(tmp_path / "mlruns"))
    no_mlflow_env.setenv("MLFLOW_ALLOW_FILE_STORE", "1")
    MlflowClient(tracking_uri=str(tmp_path / "mlruns"))
    assert store.file_store_problem(str(tmp_path / "mlruns")) is None


# ------------------------------------------------------------------ the experiment's name (item 2)


def test_an_empty_experiment_name_is_a_config_error(launch_here, no_mlflow_env, tmp_path):
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out", "logging.experiment=''"))
    assert "  - logging.experiment: the MLflow experiment name '' (from logging.experiment) is empty" in err, err
    assert "fix: set logging.experiment to a name of 1 to 500 characters" in err, err


def test_an_empty_variable_leaves_the_default_experiment(launch_here, no_mlflow_env, tmp_path):
    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "")
    r = launch_here(tmp_path, "dry_run=true", "output_root=out")
    assert r.returncode == 0 and "experiment 'grpo'" in r.stdout, r.stderr


def test_a_too_long_experiment_name_from_the_variable_names_it(launch_here, no_mlflow_env, tmp_path):
    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "e" * 501)
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out"))
    assert "  - MLFLOW_EXPERIMENT_NAME, logging.experiment: the MLflow experiment name" in err, err
    assert "is 501 characters long: MLflow takes at most 500" in err and "fix: set MLFLOW_EXPERIMENT_NAME" in err


def test_the_experiment_limits_are_mlflows():
    from mlflow.store.tracking.dbmodels.models import SqlExperiment
    from mlflow.utils.validation import MAX_EXPERIMENT_NAME_LENGTH

    assert store.MAX_EXPERIMENT_NAME == MAX_EXPERIMENT_NAME_LENGTH
    assert store.MAX_SQL_EXPERIMENT_NAME == SqlExperiment.__table__.c.name.type.length
    assert store.experiment_problem("e" * 300, "sqlite:////tmp/m.db") is None  # sqlite keeps any length
    assert "takes at most 256" in store.experiment_problem("e" * 300, "postgresql://h/db")
    assert store.experiment_problem(" ", "sqlite:////tmp/m.db") is None  # MLflow takes a blank name


# ------------------------------------------------------------------ a range's fix is whole (item 4)


@pytest.mark.parametrize("override, fix", [
    ("rollout.gpu_memory_utilization=1.5", "fix: set rollout.gpu_memory_utilization to a value in (0, 1]   [rule"),
    ("model.warm_start_steps=-1", "fix: set model.warm_start_steps to a value ≥ 0 (0 = random weights)   [rule"),
    ("rollout.kv_cache_memory_mb=-1", "fix: set rollout.kv_cache_memory_mb to a value ≥ 0 or null   [rule"),
    ("deadlines.factor=0", "fix: set deadlines.factor to a value > 0   [rule"),
])
def test_a_value_ranges_fix_is_whole(launch_here, tmp_path, override, fix):
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out", override))
    assert fix in err, err


# ------------------------------------------------------------------ recipe=NAME without '+' (item 5)


def test_a_recipe_without_plus_is_told_to_add_it(launch_here, tmp_path):
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out", "recipe=nanov3"))
    assert "add one with +recipe=nanov3" in err and "drop '~recipe'" not in err, err
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out", "recipe=nosuch"))
    assert "add one with +recipe=NAME (one of: nanov3)" in err, err
    err = refused(launch_here(tmp_path, "dry_run=true", "output_root=out", "~recipe"))
    assert "drop '~recipe'" in err, err  # removing what is not there: still told to drop the '~'
