"""cluster=local: run the GRPO driver in this process, against a Ray instance it starts here."""

from __future__ import annotations

from ..plan import Plan
from ..spec.schema import RunSpec
from . import rundir


def run_local(spec: RunSpec, plan: Plan) -> int:
    if spec.dry_run:
        print("dry run: nothing started")
        return 0
    rundir.prepare(spec, plan)
    from ..train.driver import run

    return run(spec, plan)
