"""Pre-flight on real data: `python launch.py env=dataset ... dry_run=true` wall and CPU time, against the no-data
dry run (`python launch.py dry_run=true`), on a 64-row and a 200,000-row JSONL (issue 30, case 4).

    python benchmarks/data_preflight.py [--rounds 3] [--rows 200000] [--out benchmarks/results/data_preflight.md]

Targets: 200k rows <= 10 s; 64 rows <= 2 s above the no-data dry run. The rows are the toy task as text
("Reverse the digits of 4821." -> "1284", ~60 bytes a line), tokenised with the tiny model's tokenizer (no chat
template); each configuration is run --rounds times, alternating, and the median is reported with the machine's
load average (this machine may be shared: CPU seconds, user + sys of the launch process, are shown beside wall).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["env.max_prompt_tokens=64", "train.max_total_sequence_length=96", "dry_run=true"]


def write_rows(path: Path, n: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            s = f"{(i * 7919) % 10000:04d}"
            fh.write(json.dumps({"prompt": f"Reverse the digits of {s}.", "answer": s[::-1], "id": i}) + "\n")
    return path


def timed(args: list[str], cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one `python launch.py ARGS` that must exit 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"launch.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_preflight.md")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        small, big = write_rows(tmp / "small.jsonl", 64), write_rows(tmp / "big.jsonl", a.rows)
        root = f"output_root={tmp / 'out'}"
        configs = {
            "no data (env=toy)": ["dry_run=true", root],
            "64 rows": ["env=dataset", f"env.train_path={small}", f"env.val_path={small}", *COMMON, root],
            f"{a.rows:,} rows (train) + 64 (val)": ["env=dataset", f"env.train_path={big}", f"env.val_path={small}",
                                                    *COMMON, root],
        }
        timed(configs["no data (env=toy)"], tmp)  # warm the file cache and the tiny tokenizer's files
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
        loads = []
        for _ in range(a.rounds):
            for name, args in configs.items():
                runs[name].append(timed(args, tmp))
                loads.append(os.getloadavg()[0])
        size_mb = big.stat().st_size / 2**20
    base = statistics.median(w for w, _ in runs["no data (env=toy)"])
    lines = ["# Data pre-flight (issue 30, case 4)", "",
             f"`python benchmarks/data_preflight.py --rounds {a.rounds} --rows {a.rows}` "
             f"({os.cpu_count()} cores, load average {min(loads):.1f}-{max(loads):.1f} while it ran; "
             f"the big file: {size_mb:.1f} MiB). Median of {a.rounds} runs each, alternating.", "",
             "| dry run | wall s | above no-data s | CPU s (user+sys) |", "|---|---|---|---|"]
    for name, got in runs.items():
        wall, cpu = statistics.median(w for w, _ in got), statistics.median(c for _, c in got)
        lines.append(f"| {name} | {wall:.2f} | {wall - base:+.2f} | {cpu:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.write_text(text)


if __name__ == "__main__":
    main()
