"""The one door from pre-flight to a run: `execute(launch)` runs a Launch (launch/preflight.py) with the executor of
its cluster kind: `local` runs the driver here (joining an existing Ray cluster when cluster.ray_address is set,
cluster=ray), `slurm` submits the job script pre-flight rendered. Single runs, reruns (launch/app.py), sweep points
(launch/sweep.py), the Hydra launchers (src/hydra_plugins/) and `launch.py eval|generate` (launch/eval.py: the run's
workers without the loop) all come through here."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable, Optional, TypeVar, overload

from ..exit_codes import ExitCode
from ..models.nemotron_h import plan_line as mamba_line
from ..preflight.disk import report as disk_report
from ..preflight.memory_report import report as memory_report
from ..spec.schema import ClusterKind, RolloutBackend
from .local import run_local, run_workers
from .rundir import live_holder, read_lock
from .slurm import submit_slurm

if TYPE_CHECKING:  # the package is imported first by `python -m grpo_launcher.launch.status` (job.sh, several times a
    from ..train.driver import Trainer  # job): annotations only, not the driver (torch) nor pre-flight's rules
    from .preflight import Launch

EXECUTORS: dict[ClusterKind, Callable[[Launch], int]] = {ClusterKind.local: run_local, ClusterKind.slurm: submit_slurm}
T = TypeVar("T")


def busy(launch: Launch) -> bool:
    """The run dir is held by a live run or job: said in one line (the plan it would not run is not printed)."""
    holder = live_holder(read_lock(launch.plan.run_dir))
    if holder is not None:
        print(f"error: run '{launch.spec.name}' is already in use by {holder} (run dir {launch.plan.run_dir}); wait "
              f"for it, `python launch.py cancel {launch.spec.name}`, or pick another name=", file=sys.stderr)
    return holder is not None


@overload
def execute(launch: Launch) -> int: ...
@overload
def execute(launch: Launch, work: Callable[[Trainer], T]) -> T: ...


def execute(launch: Launch, work: Optional[Callable[[Trainer], T]] = None) -> int | T:
    """The one way to run a Launch: a run is said (its plan, disk and memory budget), then handed to the executor
    of its cluster kind. With `work` (launch.py eval|generate): no run and nothing said; the run's workers come up on
    this machine without the loop (eval's pre-flight admits cluster.kind=local only) and work(trainer)'s result is
    returned."""
    if work is not None:
        return run_workers(launch, work)
    spec, plan = launch.spec, launch.plan
    if not spec.dry_run and busy(launch):  # refused before its plan is printed (the executors' lock still decides)
        return ExitCode.FAILED
    print(f"grpo-launcher: run '{spec.name}' ({spec.cluster.kind.value})\n{plan.summary()}", flush=True)
    from .repro import say_resume_input_drift  # here: job.sh imports this package for `status`, several times a job

    say_resume_input_drift(spec, plan.run_dir)  # a resume whose data or reward files changed since the run began
    if mamba_line(spec):  # nemotron_h on the torch backend: which Mamba-2 kernels its workers will run
        print(mamba_line(spec), flush=True)
    print(disk_report(spec), flush=True)  # one checkpoint's bytes, the peak on disk, the room (preflight/disk.py)
    if plan.use_gpus or spec.rollout.backend == RolloutBackend.vllm:  # the memory pre-flight's budget per GPU and
        # per node (on CPU: the vLLM engines' KV cache)
        print(memory_report(spec), flush=True)
    return EXECUTORS[spec.cluster.kind](launch)
