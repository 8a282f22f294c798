"""cluster=local: run the GRPO driver in this process, against a Ray instance it starts here.

The run dir is locked for this process (a second launch of the run is refused, naming it); Ray's auth
token is a fresh 0600 file in the run dir."""

from __future__ import annotations

import os
import sys

from ..exit_codes import ExitCode
from ..plan import Plan
from ..spec.schema import RunSpec
from . import rundir


def run_local(spec: RunSpec, plan: Plan) -> int:
    if spec.dry_run:
        print("dry run: nothing started")
        return ExitCode.OK
    try:  # one live process per run dir (a Slurm job of the same run counts too)
        rundir.acquire_run_lock(plan.run_dir, "local")
    except rundir.RunBusy as holder:
        print(f"error: run '{spec.name}' is already in use by {holder} (run dir {plan.run_dir}); "
              f"wait for it, cancel it, or pick another name=", file=sys.stderr)
        return ExitCode.FAILED
    try:
        rundir.prepare(spec, plan)
        private_ray_token(plan)
        # no Ray Prometheus listener: it binds every interface without auth (the run's metrics go to MLflow)
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        from ..train.driver import run
        from .local_status import recorded

        with recorded(spec, plan) as rec:  # status.json + logs/driver-local.log: `launch.py status|logs` find it
            rec["rc"] = run(spec, plan)
        return rec["rc"]
    finally:
        rundir.release_run_lock(plan.run_dir)


def private_ray_token(plan: Plan) -> None:
    """The local Ray cluster's auth token: a fresh one per run in RUN_DIR/.ray_auth_token (0600), not Ray's
    default ~/.ray/auth_token (written 0644 by Ray). An explicitly configured token/mode is left alone."""
    import secrets

    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")):
        return
    from ..secrets import write_private

    path = plan.run_dir / ".ray_auth_token"
    write_private(path, secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
