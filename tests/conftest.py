"""Shared fixtures (the shared functions are in helpers.py). Every process a test starts is stopped by PID in the
test that started it."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import ROOT, wait_until  # noqa: F401  (wait_until: `from conftest import wait_until` still works)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture
def launch_cmd() -> list[str]:
    return [sys.executable, str(ROOT / "launch.py")]

