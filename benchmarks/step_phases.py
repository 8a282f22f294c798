"""Time per phase of a tiny GRPO step, time to the first step, and the cost of the train-data log.

    python benchmarks/step_phases.py [--steps 20]      (writes benchmarks/results/step_phases.md)

Runs `launch.py` as a user would (fresh output dir, so the tiny model is built too), timestamps each
output line, then reads the per-phase timings the driver logged to MLflow.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "score", "logprobs", "update", "refit", "log", "step")


def run(out: Path, steps: int, *extra: str) -> tuple[float, float]:
    """→ (seconds to the first finished step, total seconds)."""
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={out}", f"grpo.max_steps={steps}",
           "grpo.val_period=0", "grpo.val_at_end=false", "checkpoint.metric=train/reward_mean",
           f"checkpoint.save_period={steps}", *extra]
    t0, first = time.monotonic(), None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if first is None and line.startswith("step 1/"):
            first = time.monotonic() - t0
    if proc.wait() != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}")
    return first or float("nan"), time.monotonic() - t0


def phase_medians(out: Path) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (r,) = client.search_runs(client.search_experiments()[0].experiment_id)
    med = {}
    for p in PHASES:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, f"time/{p}_s"))
        med[p] = statistics.median(v for s, v in hist if s > 1) * 1e3 if hist else float("nan")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        first, total = run(Path(d1), a.steps)
        base = phase_medians(Path(d1))
        run(Path(d2), a.steps, "logging.train_data_log=true")
        logged = phase_medians(Path(d2))
    lines = [f"# Tiny GRPO step phases ({a.steps} steps, 16 prompts × 8 samples, CPU)", "",
             f"command: `python benchmarks/step_phases.py --steps {a.steps}`", "",
             f"- time to first finished step (fresh output dir: includes building the tiny model, Ray start-up, "
             f"actor start-up): **{first:.1f} s**", f"- whole run: {total:.1f} s", "",
             "| phase | median ms/step | with train-data log |", "|---|---|---|"]
    lines += [f"| {p} | {base[p]:.1f} | {logged[p]:.1f} |" for p in PHASES]
    lines += ["", f"train-data log cost: {logged['log'] - base['log']:.1f} ms/step "
              f"({(logged['step'] - base['step']) / base['step'] * 100:+.1f} % of the step; 128 JSON lines/step)"]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "benchmarks" / "results" / "step_phases.md").write_text(text)


if __name__ == "__main__":
    main()
