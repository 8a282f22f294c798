"""Shared test helpers. Every process a test starts is stopped by PID in the test that started it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture
def launch_cmd() -> list[str]:
    return [sys.executable, str(ROOT / "launch.py")]
