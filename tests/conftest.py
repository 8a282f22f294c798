"""Shared test helpers. Every process a test starts is stopped by PID in the test that started it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture
def launch_cmd() -> list[str]:
    return [sys.executable, str(ROOT / "launch.py")]


def wait_until(pred, timeout: float, what: str, poll: float = 0.3):
    """Poll `pred` until it returns something truthy (returned), or fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
