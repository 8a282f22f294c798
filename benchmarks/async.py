"""Sync vs async GRPO on the toy task, through launch.py, the same two worker slots: wall time to val reward +0.3
and steps/s.

    python benchmarks/async.py [--steps 150] [--rounds 1]      (writes benchmarks/results/async.md)
    python benchmarks/async.py --vllm --out FILE                (rollout=vllm: sync vs async with in-flight updates)

Configurations (all: cluster.cpu_workers_per_node=2, the default task, seeds and batch; validation at the start
and every --val-period steps):
    sync           colocated: 2 policy ranks (DP 2), each generating with its own hybrid engine
    async age 1    1 policy rank + 1 engine of its own (cluster.rollout_devices=1), max_trajectory_age_steps=1,
                   IS correction (loss.is_truncation=tis, loss.is_threshold=2)
    async age 2    the same, max_trajectory_age_steps=2
With --vllm (rollout=vllm, vLLM's CPU build, the same two slots):
    sync vllm      colocated: 2 policy ranks (DP 2), 2 vllm.LLM engines sharing their slots
    async vllm     1 policy rank + 1 AsyncLLM engine of its own (rollout.async_engine=true), age 1, in-flight
                   weight updates (requests in flight are interrupted and resume on the new weights), IS correction
Runs alternate (sync, async 1, async 2, sync, ...) so that a change in the machine's load hits every one. Each
run's output lines are timestamped here; "to +0.3" is the wall time from the end of step 1 (Ray and the actors
are up) to the first validation at least 0.3 above the run's own step-0 validation, and also from the launch.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOTS = ["cluster.cpu_workers_per_node=2"]
# the importance-sampling correction (tis, cap 2) against the behaviour logprobs: off-policy samples need it (without
# it an age-2 run collapsed early on this task; see benchmarks/results/async.md)
ASYNC = ["grpo.async_grpo.enabled=true", "cluster.rollout_devices=1", "loss.importance_sampling_correction=true",
         "loss.is_truncation=tis", "loss.is_threshold=2"]
CONFIGS = {
    "sync (DP 2, colocated)": [],
    "async age 1": [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1"],
    "async age 2": [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2"],
}
VLLM_CONFIGS = {
    "sync vllm (DP 2, colocated)": ["rollout=vllm"],
    "async vllm age 1, in-flight updates": ["rollout=vllm", "rollout.async_engine=true", *ASYNC,
                                            "grpo.async_grpo.max_trajectory_age_steps=1",
                                            "grpo.async_grpo.in_flight_weight_updates=true"],
}
STEP = re.compile(r"^step (\d+)/(\d+)")


def uptime() -> str:
    return subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()


def run(out: Path, models: Path, steps: int, val_period: int, extra: list[str]) -> dict:
    """One launch.py run → its figures (wall times from the launch and from the end of step 1)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / ".models").symlink_to(models)  # the tiny model is built once, not timed
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={out}", f"grpo.max_steps={steps}",
           "grpo.val_at_start=true", f"grpo.val_period={val_period}", "checkpoint.save_period=1000000",
           *SLOTS, *extra]
    t0 = time.monotonic()
    at: dict[int, float] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if m := STEP.match(line):
            at[int(m.group(1))] = time.monotonic() - t0
    if proc.wait() != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{''.join(tail)}")
    total = time.monotonic() - t0
    rows = {}
    for line in (out / "tiny-grpo" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = r
    val0 = start_val(out)
    hit = next((s for s in sorted(rows) if s > 0 and rows[s].get("val/reward_mean", -1) >= val0 + 0.3), None)
    return {"total_s": total, "step1_s": at[1], "loop_s": at[steps] - at[1],
            "steps_per_s": (steps - 1) / (at[steps] - at[1]), "val0": val0,
            "val_end": rows[steps].get("val/reward_mean", float("nan")), "hit_step": hit,
            "to_target_s": at[hit] - at[1] if hit else None, "to_target_launch_s": at[hit] if hit else None,
            "age_max": max(rows[s].get("buffer/sample_age_max", 0.0) for s in rows if s > 0),
            "trainer_idle_s": statistics.median(rows[s]["time/trainer_idle_s"] for s in rows if s > 1),
            "gen_idle_s": statistics.median(rows[s]["time/generation_idle_s"] for s in rows if s > 1),
            "step_s": statistics.median(rows[s]["time/step_s"] for s in rows if s > 1)}


def start_val(out: Path) -> float:
    """val/reward_mean at step 0 (grpo.val_at_start): MLflow has it (metrics.jsonl starts at step 1)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (r,) = client.search_runs(client.search_experiments()[0].experiment_id)
    return next(m.value for m in client.get_metric_history(r.info.run_id, "val/reward_mean") if m.step == 0)


def fmt(x, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--val-period", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "async.md")
    ap.add_argument("--vllm", action="store_true", help="rollout=vllm: sync vs async (age 1, in-flight updates)")
    a = ap.parse_args()
    configs = VLLM_CONFIGS if a.vllm else CONFIGS
    before = uptime()
    results: dict[str, list[dict]] = {k: [] for k in configs}
    with tempfile.TemporaryDirectory(prefix="h17-async-bench-") as d:
        root = Path(d)
        models = root / "models"
        # build the tiny model once (a 1-step sync run), outside every timing
        subprocess.run([sys.executable, str(ROOT / "launch.py"), f"output_root={root / 'warm'}", "grpo.max_steps=1",
                        "grpo.val_period=0", "grpo.val_at_end=false", "checkpoint.metric=train/reward_mean",
                        "logging.mlflow=false"], check=True, capture_output=True, cwd=ROOT)
        shutil.move(str(root / "warm" / ".models"), models)
        for i in range(a.rounds):
            for j, (name, extra) in enumerate(configs.items()):
                r = run(root / f"round{i}-config{j}", models, a.steps, a.val_period, extra)
                results[name].append(r)
                print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
                      flush=True)
    after = uptime()
    sync = results[next(iter(configs))]

    def med(rs: list[dict], key: str):
        vals = [r[key] for r in rs if r[key] is not None]
        return statistics.median(vals) if vals else None

    base_t, base_sps = med(sync, "to_target_s"), med(sync, "steps_per_s")
    cmd = (f"python benchmarks/async.py --steps {a.steps} --rounds {a.rounds} --val-period {a.val_period}"
           + (" --vllm" if a.vllm else ""))
    lines = [f"# Sync vs async GRPO{' (rollout=vllm)' if a.vllm else ''}, toy task, 2 CPU worker slots ({a.steps} steps, 16 prompts × 8 samples)", "",
             f"command: `{cmd}`", "",
             f"- machine load before: `{before}`", f"- machine load after: `{after}`",
             ("- the machine is shared (2 cores, other agents' jobs run beside this one): figures move with its "
              "load; runs alternate between the configurations so that load changes hit each of them"), "",
             ("| configuration | runs | to val +0.3 (s, from step 1) | same, from launch | val step reached | "
              "steps/s | speed-up to +0.3 | steps/s × | median step s | trainer idle s/step | engine idle s/step | "
              "max sample age |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in results.items():
        t, sps = med(rs, "to_target_s"), med(rs, "steps_per_s")
        speed = f"{base_t / t:.2f}×" if t and base_t else "—"
        lines.append(f"| {name} | {len(rs)} | {fmt(t)} | {fmt(med(rs, 'to_target_launch_s'))} | "
                     f"{', '.join(str(r['hit_step']) for r in rs)} | {fmt(sps, '.2f')} | {speed} | "
                     f"{fmt(sps / base_sps if sps and base_sps else None, '.2f')} | {fmt(med(rs, 'step_s'), '.3f')} | "
                     f"{fmt(med(rs, 'trainer_idle_s'), '.3f')} | {fmt(med(rs, 'gen_idle_s'), '.3f')} | "
                     f"{fmt(max(r['age_max'] for r in rs), '.0f')} |")
    lines += ["", "Per run (val at step 0 → last; seconds from the end of step 1 to val +0.3):", ""]
    for name, rs in results.items():
        for r in rs:
            lines.append(f"- {name}: val {r['val0']:.3f} → {r['val_end']:.3f}, +0.3 at step {r['hit_step']} after "
                         f"{fmt(r['to_target_s'])} s; {r['steps_per_s']:.2f} steps/s; launch → end {r['total_s']:.1f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.write_text(text)


if __name__ == "__main__":
    main()
