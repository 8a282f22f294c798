"""mypy on src/ held by a ratchet: fails when a module that .ci/mypy-ratchet.txt does not list has an error.

mypy runs with pyproject's [tool.mypy] (a def without annotations counts as an error). The ratchet file lists
the modules not typed yet, each with the errors it had when written; a module it does not list must be clean,
so a new module is typed from its first line and a module once clean stays clean. A listed module with more
errors than recorded is reported, not failed (several people edit those modules at once); after typing a
module, rewrite the file: `make lint-ratchet`.

    python .ci/mypy_ratchet.py            # check (make lint)
    python .ci/mypy_ratchet.py --update   # rewrite the ratchet file from today's counts
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATCHET = ROOT / ".ci" / "mypy-ratchet.txt"
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


def main(argv: list[str]) -> int:
    counts, lines = mypy_errors()
    if "--update" in argv:
        RATCHET.write_text(HEADER + "".join(f"{n:4d} {p}\n" for p, n in sorted(counts.items())))
        print(f"{RATCHET.relative_to(ROOT)}: {sum(counts.values())} errors in {len(counts)} modules")
        return 0
    limit = allowed()
    new = sorted(p for p in counts if p not in limit)
    if new:
        print("\n".join(line for line in lines if line.split(":", 1)[0] in new))
        print(f"mypy ratchet: {', '.join(new)} must be typed (not listed in .ci/mypy-ratchet.txt)")
        return 1
    more = sorted(f"{p} ({n} > {limit[p]})" for p, n in counts.items() if n > limit[p])
    if more:
        print(f"mypy ratchet: more errors than recorded in {', '.join(more)}")
    better = sorted(p for p, n in limit.items() if counts.get(p, 0) < n)
    if better:
        print(f"mypy ratchet: fewer errors than recorded in {', '.join(better)}: `make lint-ratchet` records it")
    print(f"mypy ratchet: {sum(counts.values())} known errors in {len(counts)} modules not typed yet, none new")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
