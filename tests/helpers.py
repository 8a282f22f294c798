"""What the test files share: the repository root, `python launch.py` as a subprocess, waiting on a condition, a Slurm
job's state, the tiny model built once per machine.

Imported as `from helpers import ...` (pytest puts tests/ on sys.path; conftest.py re-exports them too)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from grpo_launcher.launch.status import slurm_env

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # data/, snapshots/ and the tier folders
LAUNCH_PY = ROOT / "launch.py"
# the tiny models every run of the suite shares: built once per machine (a minute of CPU each), not once per test
MODEL_CACHE = Path(os.environ.get("GRPO_TEST_MODEL_CACHE", "/tmp/grpo-test-cache/models"))
NO_RUNS = MODEL_CACHE.parent / "no-runs"  # an output_root that never holds a run: specs composed for their model only


def launch(*args: str, cwd: Optional[Path] = None, env: Optional[Mapping[str, str]] = None,
           timeout: float = 900) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` run to its end, output captured as text; `env` is added to this process's."""
    return subprocess.run([sys.executable, str(LAUNCH_PY), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **env} if env else None)


def job_state(job: str) -> str:
    """A Slurm job's state as `scontrol show job` gives it; UNKNOWN once slurmctld has purged it."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60,
                          env=slurm_env())
    m = re.search(r"\bJobState=(\S+)", proc.stdout)
    return m.group(1) if m else "UNKNOWN"


def wait_until(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.3) -> Any:
    """Poll `pred` until it returns something truthy (returned), or fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def interrupted(args: list[str], log: Path, ready: str, what: str, timeout: float = 300) -> tuple[int, str]:
    """`python launch.py ARGS` with its output in `log`; SIGINT (a Ctrl-C) once `ready` is in the log; its exit code
    and output. The process is killed if it outlives `timeout` after the signal."""
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, str(LAUNCH_PY), *args], stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: ready in log.read_text(), timeout, what)
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, log.read_text()


def tiny_model(*overrides: str) -> Path:
    """The tiny model of the spec these overrides compose (default: `python launch.py`'s), from MODEL_CACHE. Composed
    beside MODEL_CACHE, never against a checkout's outputs/ (where a finished tiny-grpo would refuse the spec)."""
    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model
    from grpo_launcher.spec.compose import load_spec

    aside = [] if any(o.startswith("output_root=") for o in overrides) else [f"output_root={NO_RUNS}"]
    spec = load_spec([*overrides, *aside])
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    env_name = str(getattr(spec.env.name, "value", spec.env.name))  # as train/setup.py names the cache entry
    return ensure_tiny_model(spec.model, make_env(spec), env_name, MODEL_CACHE, seed=spec.grpo.seed)


def share_models(root: Path) -> Path:
    """root/.models → MODEL_CACHE, so `launch.py output_root=root` finds its tiny model built already."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    if not (root / ".models").exists():
        (root / ".models").symlink_to(MODEL_CACHE)
    return root


def check_train_data_record(rec: dict, eos: int, version: int) -> None:
    """One row of a real step's train-data log (toy env, sync GRPO: samples from the policy of `version`)."""
    from grpo_launcher.tracking import FIELDS

    assert set(rec) == set(FIELDS)
    n = len(rec["token_ids"])
    assert len(rec["token_loss_mask"]) == len(rec["generation_logprobs"]) == len(rec["prev_logprobs"]) == n
    p = rec["token_loss_mask"].index(1)
    assert set(rec["token_loss_mask"][:p]) == {0} and set(rec["token_loss_mask"][p:]) == {1}
    gen, prev = rec["generation_logprobs"][p:], rec["prev_logprobs"][p:]
    assert max(abs(a - b) for a, b in zip(gen, prev)) < 1e-3  # the engine and the trainer agree
    assert rec["truncated"] == (rec["token_ids"][-1] != eos)  # no EOS ⇔ truncated
    assert rec["agent_ref"] == "toy/reverse_digits" and rec["sample_loss_mask"] == 1
    assert (rec["policy_version"], rec["policy_version_last"], rec["age"]) == (version, version, 0)


@contextmanager
def policy_ranks(spec: Any, model_dir: str) -> Iterator[tuple[Any, list[Any]]]:
    """In a local Ray (shut down on exit): one TorchPolicyWorker alone, and two forming a 2-rank process group."""
    import ray

    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=200 * 2**20)
    try:
        W = ray.remote(TorchPolicyWorker).options(num_cpus=1)
        single, pair = W.remote(spec, model_dir, 0, 1), [W.remote(spec, model_dir, r, 2) for r in range(2)]
        host, port = ray.get(pair[0].address.remote())
        ray.get([w.init_distributed.remote(host, port) for w in pair])
        yield single, pair
    finally:
        ray.shutdown()
