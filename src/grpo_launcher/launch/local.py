"""cluster=local: run the GRPO driver in this process, against a Ray instance it starts here."""

from __future__ import annotations

import sys

from ..plan import Plan
from ..spec.schema import RunSpec
from . import rundir


def run_local(spec: RunSpec, plan: Plan) -> int:
    if spec.dry_run:
        print("dry run: nothing started")
        return 0
    try:  # one live process per run dir (a Slurm job of the same run counts too)
        rundir.acquire_run_lock(plan.run_dir, "local")
    except rundir.RunBusy as holder:
        print(f"error: run '{spec.name}' is already in use by {holder} (run dir {plan.run_dir}); "
              f"wait for it, cancel it, or pick another name=", file=sys.stderr)
        return 1
    try:
        rundir.prepare(spec, plan)
        from ..train.driver import run

        return run(spec, plan)
    finally:
        rundir.release_run_lock(plan.run_dir)
