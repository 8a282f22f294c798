"""cluster=slurm: render the sbatch script into the run dir and submit it (dry run: print it)."""

from __future__ import annotations

import subprocess
import sys

from ..plan import Plan
from ..spec.schema import RunSpec
from . import rundir
from .sbatch import render
from .status import write_status


def submit_slurm(spec: RunSpec, plan: Plan) -> int:
    script = render(spec, plan)
    if spec.dry_run:
        print(f"dry run: the sbatch script that would be submitted ({plan.run_dir / 'job.sbatch'}):\n")
        print(script)
        return 0
    rundir.prepare(spec, plan)
    path = plan.run_dir / "job.sbatch"
    rundir.write_atomic(path, script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = proc.stdout.strip().split(";")[0]
    write_status(plan.run_dir, "SUBMITTED", job_id=job_id, name=spec.name)
    print(f"submitted job {job_id}\n  run dir    : {plan.run_dir}\n"
          f"  slurm log  : {plan.run_dir}/logs/slurm-{job_id}.out\n"
          f"  driver log : {plan.run_dir}/logs/driver-{job_id}.log")
    return 0
