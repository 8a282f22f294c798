"""Pre-flight stays light: compose → rules → plan → render for the seed's recipe imports neither torch, nor
transformers, nor Ray (every config error and dry run would pay seconds for them), nor what only a sweep's plugins
use (optuna, submitit: Hydra imports every plugin module at each start)."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT

HEAVY = ("torch", "transformers", "ray", "vllm", "megatron", "mlflow", "optuna", "submitit")
PROBE = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import launch
code = launch.main(sys.argv[1:])
print("heavy:", ",".join(m for m in {HEAVY!r} if m in sys.modules), "code:", code)
"""


def test_nanov3_slurm_dry_run_imports_no_heavy_package():
    out = subprocess.run([sys.executable, "-c", PROBE, "+recipe=nanov3", "cluster=slurm", "dry_run=true"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "heavy:  code: 0" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
