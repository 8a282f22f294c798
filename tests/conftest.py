"""Shared fixtures (the shared functions are in helpers.py). Every process a test starts is stopped by PID in the
test that started it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, share_models, wait_until  # noqa: F401  (wait_until: `from conftest import wait_until` still works)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture
def launch_cmd() -> list[str]:
    return [sys.executable, str(ROOT / "launch.py")]


@pytest.fixture
def launch_here(monkeypatch, capsys):
    """launch.py's main in this process, from `cwd` (no interpreter start-up, no Ray): (exit code, stdout, stderr)
    as a CompletedProcess. For pre-flight, dry runs and subcommands; a run that trains goes through helpers.launch."""
    monkeypatch.syspath_prepend(str(ROOT))
    import launch as launch_py

    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = launch_py.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["launch.py", *args], code, out, err)

    return run



@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    """A module's own output_root for the runs and specs its tests build (one per test module)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(autouse=True)
def runs_outside_the_checkout(monkeypatch, tmp_path_factory) -> Path:
    """No test reads or writes the checkout's outputs/ (after `make demo` a finished tiny-grpo there would refuse the
    default spec): a run's default output_root is $GRPO_OUTPUT_ROOT (conf/config.yaml), here a fresh directory per
    test (its .models: the shared tiny-model cache), in this process and in every launch.py it starts. A test that
    sets output_root= keeps its own."""
    root = share_models(tmp_path_factory.mktemp("outputs"))
    monkeypatch.setenv("GRPO_OUTPUT_ROOT", str(root))
    return root


@pytest.fixture(autouse=True)
def environment_put_back():
    """Every test ends with the process environment it started with, and Ray (where imported) reading it again. A
    launch in this process must put its Ray variables back itself (launch/local.py ray_environment): held here.
    RAY_AUTH_MODE is not asserted: ray.init sets it for the process when it starts a local cluster."""
    from grpo_launcher.launch.local import ray_rereads_auth

    before = dict(os.environ)
    yield
    leaked = {k for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_enable_metrics_collection")
              if os.environ.get(k) != before.get(k)}
    os.environ.clear()
    os.environ.update(before)
    ray_rereads_auth()
    assert not leaked, f"a run left its Ray variables set: {sorted(leaked)}"
