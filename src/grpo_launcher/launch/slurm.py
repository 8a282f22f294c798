"""cluster=slurm: render the sbatch script into the run dir and submit it (dry run: print it).

Returns right after `sbatch` with the job id, run dir and log paths; `cluster.wait=true` instead follows
the job (driver log streamed here) until it ends and exits with its result.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TYPE_CHECKING

from ..exit_codes import ExitCode
from ..plan import Plan
from ..spec.schema import RunSpec
from . import rundir
from .sbatch import python_of, script_path

if TYPE_CHECKING:  # launch/__init__.py says why
    from .preflight import Launch

T_COMMAND = time.time()  # ≈ when launch.py started (this module is imported at start-up)


def submit_slurm(launch: Launch) -> int:
    """Submit the job script pre-flight rendered (the spec's output_root is absolute: spec/resolve.py)."""
    spec, plan, script = launch.spec, launch.plan, launch.script
    assert script is not None, "a Slurm launch's script is rendered at pre-flight"
    if spec.dry_run:
        print(f"dry run: the sbatch script that would be submitted ({script_path(plan)}):\n")
        print(script)
        return ExitCode.OK
    if shutil.which("sbatch") is None:
        print("error: sbatch not found on PATH (cluster=slurm submits with sbatch; for the local test cluster: "
              "bash scripts/local-slurm.sh install && bash scripts/local-slurm.sh start)", file=sys.stderr)
        return ExitCode.FAILED
    try:  # atomic: of two launches of one run at once, one gets the run dir; the job holds it from here on
        rundir.acquire_run_lock(plan.run_dir, "slurm")
    except OSError as exc:
        return rundir.unmakeable(plan.run_dir, exc)
    except rundir.RunBusy as holder:
        print(f"error: run '{spec.name}' is already in use by {holder} (its run dir {plan.run_dir} "
              f"would be shared); `python launch.py cancel {spec.name}` first, or pick another name=",
              file=sys.stderr)
        return ExitCode.FAILED
    try:
        return _submit_locked(spec, plan, script)
    except BaseException:
        rundir.release_run_lock(plan.run_dir)  # this launcher still holds it (no job took it over)
        raise


def _submit_locked(spec: RunSpec, plan: Plan, script: str) -> int:
    # imported here, as below: `python -m grpo_launcher.launch.status` (job.sh) imports this package first, and
    # runpy warns when the module it runs was loaded already
    from .status import slurm, write_status

    missing = [n for n in spec.cluster.env_passthrough if n not in os.environ]
    if missing:  # names only: values are never printed
        print(f"warning: cluster.env_passthrough names unset variable(s): {', '.join(missing)}", file=sys.stderr)
    if not spec.cluster.python and not spec.cluster.container_image:
        print(f"python on the nodes: {python_of(spec)} (this interpreter; set cluster.python to change)")
    rundir.prepare(spec, plan)
    path = script_path(plan)
    rundir.write_atomic(path, script)
    path.chmod(0o700)
    proc = slurm(["sbatch", "--parsable", str(path)], timeout=60)
    if proc.returncode != 0:
        print(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
        rundir.release_run_lock(plan.run_dir)
        return ExitCode.FAILED
    job_id = proc.stdout.strip().split(";")[0]
    rundir.record_job(plan.run_dir, job_id)
    write_status(plan.run_dir, "SUBMITTED", reset=True, job_id=job_id, name=spec.name, run_dir=str(plan.run_dir),
                 submitted=round(T_COMMAND, 3))
    logs = plan.run_dir / "logs"
    print(f"submitted job {job_id} (run '{spec.name}')\n"
          f"  run dir    : {plan.run_dir}\n"
          f"  status     : {plan.run_dir / 'status.json'}   python launch.py status {spec.name}\n"
          f"  driver log : {logs / f'driver-{job_id}.log'}   python launch.py logs -f {spec.name}\n"
          f"  slurm log  : {logs / f'slurm-{job_id}.out'}   python launch.py logs --slurm {spec.name}\n"
          f"  cancel     : python launch.py cancel {spec.name}", flush=True)
    if spec.cluster.wait:
        from .cli import wait_for_job  # cli imports status: not at the top, as above

        return wait_for_job(plan.run_dir, job_id, t_command=T_COMMAND)
    return ExitCode.OK
