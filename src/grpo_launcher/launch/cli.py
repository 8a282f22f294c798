"""`launch.py status|logs|cancel RUN` (placeholder until the Slurm issue fills it in)."""

from __future__ import annotations

import sys


def status(args: list[str]) -> int:
    print("status: not implemented yet", file=sys.stderr)
    return 1


logs = cancel = status
