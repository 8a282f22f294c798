"""The start-up line of a real run (train/startup.py): the waits for the workers are named by what they waited for,
each with the slowest actor's own phases measured inside it (imports, load, engine), and the parts add up."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import ROOT, share_models

from unit.test_async import ASYNC

pytestmark = pytest.mark.slow

LINE = re.compile(r"grpo-launcher: start-up ([0-9.]+) s to the end of step 1 \((.*)\)$", re.M)
PART = re.compile(r"([a-z0-9 ]+?) ([0-9.]+)(?: \[([^\]]*)\])?(?:, |$)")


def parts(line: str) -> dict[str, tuple[float, str]]:
    return {name: (float(s), detail or "") for name, s, detail in PART.findall(line)}


@pytest.mark.extended  # 15 s: start-up's phases, a figure for benchmarks/results/startup.md, not a behaviour CI holds
def test_startup_line_names_the_policy_and_engine_phases(tmp_path):
    """A separate rollout engine (HF, on a slot of its own): `policy ready` and `engines ready` each name the
    actor's own phases; no `tokenizer` wait stands for the policy's start-up any more. The engine's process starts
    no later than the policy's (create_workers creates the engines first: their start overlaps the policy's load)."""
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={share_models(tmp_path)}", "grpo.max_steps=1",
           "logging.mlflow=false", *ASYNC]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (total, body), = LINE.findall(out.stdout)
    p = parts(body)
    names = list(p)
    assert names.index("repro") < names.index("policy ready") < names.index("tokenizer") \
        < names.index("process group") < names.index("engines ready") < names.index("step 1"), names
    assert abs(sum(s for s, _ in p.values()) - float(total)) < 0.1 * len(p)  # each part rounded to 0.1
    policy = [w.split(" ")[0] for w in p["policy ready"][1].split(", ")]
    assert policy == ["from", "imports", "transformers", "device", "load", "setup", "engine"], p["policy ready"]
    engine = [w.split(" ")[0] for w in p["engines ready"][1].split(", ")]
    assert engine == ["from", "imports", "transformers", "engine"], p["engines ready"]
    assert started(p["engines ready"][1]) <= started(p["policy ready"][1]), (p["engines ready"], p["policy ready"])


def started(detail: str) -> float:
    """An actor's process start, seconds into the run: the bracket's `from`."""
    return float(detail.split(", ")[0].split(" ")[1])
