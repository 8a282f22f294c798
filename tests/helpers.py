"""What the test files share: the repository root, `python launch.py` as a subprocess, waiting on a condition.

Imported as `from helpers import ...` (pytest puts tests/ on sys.path; conftest.py re-exports them too)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_PY = ROOT / "launch.py"


def launch(*args: str, cwd: Optional[Path] = None, env: Optional[Mapping[str, str]] = None,
           timeout: float = 900) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` run to its end, output captured as text; `env` is added to this process's."""
    return subprocess.run([sys.executable, str(LAUNCH_PY), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **env} if env else None)


def wait_until(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.3) -> Any:
    """Poll `pred` until it returns something truthy (returned), or fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
