"""mypy on src/ held by a ratchet: fails on any error beyond what .ci/mypy-ratchet.txt records.

mypy runs with pyproject's [tool.mypy] (a def without annotations counts as an error). The ratchet file lists
the modules not typed yet, each with the errors it had when written. It fails when a module it does not list
has an error (a new module is typed from its first line, a module once clean stays clean) and when a listed
module has more errors than recorded (a new untyped def in a module not typed yet: type it, and the module's
other errors with it when you can). Fewer errors than recorded pass, with a reminder: after typing a module,
rewrite the file with `make lint-ratchet` (the counts only go down; a module renamed or split: edit it by hand).

    python .ci/mypy_ratchet.py            # check (make lint)
    python .ci/mypy_ratchet.py --update   # rewrite the ratchet file from today's counts (they only go down)
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATCHET = ROOT / ".ci" / "mypy-ratchet.txt"
LISTED = ".ci/mypy-ratchet.txt"
ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error:")
HEADER = ("# The modules not typed yet, with their mypy errors when written (.ci/mypy_ratchet.py). A module not\n"
          "# listed must be clean: the list only shrinks. Rewrite with `make lint-ratchet` after typing a module.\n")


def mypy_errors() -> tuple[Counter[str], list[str]]:
    """(errors per file, mypy's error lines)."""
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        sys.exit(f"mypy failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    lines = [line for line in out.stdout.splitlines() if ERROR.match(line)]
    return Counter(m["path"] for line in lines if (m := ERROR.match(line))), lines


def allowed() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in RATCHET.read_text().splitlines() if RATCHET.exists() else []:
        line = line.split("#", 1)[0].strip()
        if line:
            n, path = line.split()
            out[path] = int(n)
    return out


def verdict(counts: Counter[str], lines: list[str], limit: dict[str, int]) -> tuple[int, list[str]]:
    """(exit code, what to print) of mypy's errors per module against the ratchet's limits."""
    def errors_of(paths: list[str]) -> list[str]:
        return [line for line in lines if line.split(":", 1)[0] in paths]

    new = sorted(p for p in counts if p not in limit)
    if new:
        return 1, [*errors_of(new), f"mypy ratchet: {', '.join(new)} must be typed (not listed in {LISTED})"]
    more = sorted(p for p, n in counts.items() if n > limit[p])
    if more:
        over = ", ".join(f"{p} ({counts[p]} > {limit[p]})" for p in more)
        return 1, [*errors_of(more), f"mypy ratchet: more errors than {LISTED} records in {over}: type what you added"]
    out = []
    better = sorted(p for p, n in limit.items() if counts.get(p, 0) < n)
    if better:
        out.append(f"mypy ratchet: fewer errors than recorded in {', '.join(better)}: `make lint-ratchet` records it")
    out.append(f"mypy ratchet: {sum(counts.values())} known errors in {len(counts)} modules not typed yet, none new")
    return 0, out


def shrunk(counts: Counter[str], limit: dict[str, int] | None) -> dict[str, int]:
    """What --update records: today's counts, never above the recorded ones, never a module not listed
    (the first write, without a ratchet file, records everything)."""
    if limit is None:
        return dict(counts)
    return {p: min(n, limit[p]) for p, n in counts.items() if p in limit}


def main(argv: list[str]) -> int:
    counts, lines = mypy_errors()
    if "--update" in argv:
        keep = shrunk(counts, allowed() if RATCHET.exists() else None)
        RATCHET.write_text(HEADER + "".join(f"{n:4d} {p}\n" for p, n in sorted(keep.items())))
        print(f"{LISTED}: {sum(keep.values())} errors in {len(keep)} modules")
        code, out = verdict(counts, lines, keep)
        if code:
            print("\n".join(out))
        return code
    code, out = verdict(counts, lines, allowed())
    print("\n".join(out))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
