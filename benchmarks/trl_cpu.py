"""The embedded default (`python launch.py`) vs TRL GRPOTrainer on the same work, alternately, on this CPU.

TRL runs the harness ../shared/peers/trl/trl_toy_same_task.py (our tiny model directory, our toy env and scorer,
16 prompts x 8, the same sampling and optimizer settings) in its own venv (`--trl-python`, with trl installed).
Each side runs `--runs` times, alternating, so both see the same machine load. Per run: completions/s over steps
2..N (128 x (N-1) / the sum of their step times), median step, process start -> end of step 1, peak memory of
the whole process tree (sum of PSS, sampled every 0.25 s), reward first-5 -> last-5.

    python benchmarks/trl_cpu.py --runs 3 --trl-python /tmp/venv-trl/bin/python --out benchmarks/results/trl_cpu
    python benchmarks/trl_cpu.py --runs 3 --ours rollout=vllm ...      (overrides for our side only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128


def peak_pss(proc: subprocess.Popen, out: dict) -> None:
    """Peak of the summed PSS over the process and all its descendants, until it exits."""
    top = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        try:
            for p in [top, *top.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        except psutil.NoSuchProcess:
            break
        out["peak"] = max(out.get("peak", 0), total)
        time.sleep(0.25)


def timed_run(cmd: list[str], log: Path) -> tuple[int, int]:
    mem: dict = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        sampler = threading.Thread(target=peak_pss, args=(proc, mem), daemon=True)
        sampler.start()
        rc = proc.wait()
        sampler.join()
    return rc, mem.get("peak", 0)


def figures(step_s: list[float], rewards: list[float], first_step_end: float, peak: int) -> dict:
    return {"completions_per_s": BATCH * (len(step_s) - 1) / sum(step_s[1:]), "median_step_ms": 1e3 * statistics.median(step_s[1:]),
            "first_step_s": first_step_end, "peak_mib": peak / 2**20,
            "reward_first5": sum(rewards[:5]) / 5, "reward_last5": sum(rewards[-5:]) / 5}


def run_ours(i: int, args) -> dict:
    root = args.out / "ours"  # one output root: run 0 builds the tiny model, later runs find it cached
    rc, peak = timed_run([sys.executable, "launch.py", f"output_root={root}", f"name=run-{i}",
                          "checkpoint.resume=fresh", f"grpo.max_steps={args.steps}", *args.ours], args.out / f"ours-{i}.log")
    if rc:
        return {"side": "ours", "error": f"exit {rc}"}
    rows = [json.loads(line) for line in (root / f"run-{i}" / "metrics.jsonl").read_text().splitlines()]
    log = (args.out / f"ours-{i}.log").read_text()
    start = float(log.split("grpo-launcher: start-up ")[1].split(" s")[0])
    return {"side": "ours", **figures([r["time/step_s"] for r in rows], [r["train/reward_mean"] for r in rows],
                                      start, peak)}


def run_trl(i: int, args, model_dir: Path) -> dict:
    out = args.out / f"trl-{i}"
    rc, peak = timed_run([str(args.trl_python), str(args.trl_dir / "trl_toy_same_task.py"), "--model", str(model_dir),
                          "--project-src", str(ROOT / "src"), "--steps", str(args.steps), "--out", str(out)],
                         args.out / f"trl-{i}.log")
    if rc:
        return {"side": "trl", "error": f"exit {rc}"}
    recs = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    s = json.loads((out / "summary.json").read_text())
    return {"side": "trl", **figures([r["wall"] for r in recs], [r["reward_mean"] for r in recs],
                                     s["time_to_first_step_s"], peak)}


def table(results: list[dict]) -> str:
    keys = ["completions_per_s", "median_step_ms", "first_step_s", "peak_mib", "reward_first5", "reward_last5"]
    med = {side: {k: statistics.median(r[k] for r in results if r["side"] == side and "error" not in r)
                  for k in keys} for side in ("ours", "trl")}
    lines = ["| figure (median of runs) | `python launch.py` | TRL GRPOTrainer | ours/TRL |", "|---|---|---|---|"]
    for k in keys:
        o, t = med["ours"][k], med["trl"][k]
        lines.append(f"| {k} | {o:,.3f} | {t:,.3f} | {o / t:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--trl-python", type=Path, default=Path("/tmp/venv-trl/bin/python"))
    ap.add_argument("--trl-dir", type=Path, default=ROOT.parent / "shared" / "peers" / "trl")
    ap.add_argument("--out", type=Path, default=Path("/tmp/trl-cpu"))
    ap.add_argument("--ours", nargs="*", default=[], help="launch.py overrides for our side, e.g. rollout=vllm")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(args.runs):
        results.append(run_ours(i, args))
        model_dir = next((args.out / "ours" / ".models").glob("tiny-toy-*"))  # the model our run built
        results.append(run_trl(i, args, model_dir))
        print(json.dumps(results[-2:]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
