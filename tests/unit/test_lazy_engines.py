"""The imports kept inside functions in policy/megatron_*.py and rollout/vllm.py, and their reason (each module's
docstring, "Imports"): the driver imports the megatron policy's and the vLLM engine's classes to start their actors,
and vLLM's engine processes import rollout/vllm.py (worker_extension_cls); neither loads the engines themselves."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT

ENGINES = ("megatron", "mamba_ssm", "vllm", "uvicorn", "transformers.models.auto.auto_factory",
           "transformers.models.auto.modeling_auto")
PROBE = f"""
import sys
loaded = lambda names: sorted(m for m in names if m in sys.modules)
import grpo_launcher.rollout.vllm  # what an engine process imports for the refit extension
print("engine process:", loaded({ENGINES!r} + ("ray",)))
import grpo_launcher.train.driver
from grpo_launcher.policy import policy_class
from grpo_launcher.rollout import rollout_class
from grpo_launcher.spec.schema import RolloutBackend, TrainBackend
policy_class(TrainBackend.megatron), rollout_class(RolloutBackend.vllm)
print("driver:", loaded({ENGINES!r}))
"""


def test_driver_and_engine_processes_import_the_classes_without_the_engines():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["engine process: []", "driver: []"], out.stdout + out.stderr[-2000:]
