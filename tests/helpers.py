"""What the test files share: the repository root, `python launch.py` as a subprocess, waiting on a condition,
the tiny model built once per machine.

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
# the tiny models every run of the suite shares: built once per machine (a minute of CPU each), not once per test
MODEL_CACHE = Path(os.environ.get("GRPO_TEST_MODEL_CACHE", "/tmp/grpo-test-cache/models"))


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


def tiny_model(*overrides: str) -> Path:
    """The tiny model of the spec these overrides compose (default: `python launch.py`'s), from MODEL_CACHE."""
    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec(list(overrides))
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    env_name = str(getattr(spec.env.name, "value", spec.env.name))  # as train/setup.py names the cache entry
    return ensure_tiny_model(spec.model, make_env(spec), env_name, MODEL_CACHE, seed=spec.grpo.seed)


def share_models(root: Path) -> Path:
    """root/.models → MODEL_CACHE, so `launch.py output_root=root` finds its tiny model built already."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    if not (root / ".models").exists():
        (root / ".models").symlink_to(MODEL_CACHE)
    return root
