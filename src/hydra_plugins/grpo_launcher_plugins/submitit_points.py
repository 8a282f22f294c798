"""hydra/launcher=submitit_slurm|submitit_local (hydra-submitit-launcher's convention): every point is checked
first, as with hydra/launcher=grpo, then each is one submitit job that runs the run on its node.

    python launch.py -m hydra/launcher=submitit_slurm hydra.launcher.partition=debug train.lr=1e-4,3e-4

The launcher's own keys (hydra.launcher.partition, timeout_min, cpus_per_task, gpus_per_node, mem_gb ...) are
the plugin's; `launch.py -m` points its `_target_` here (launch/sweep.py). The job runs the sweep's task,
launch/sweep.py run_point (pre-flight → execute, as every sweep point): a single-node run (cluster=local) in the
job's allocation, its run dir output_root/name as usual. Hydra's submitit launcher waits for every job; a
multi-node point, or a point with cluster=slurm (it would submit a second job from inside the first), is refused
with a pointer to `cluster=slurm -m`, our sweep, which submits each point as its own multi-node job and returns.
"""

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from hydra.core.utils import JobReturn
from omegaconf import DictConfig
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (BaseSubmititLauncher, LocalLauncher,
                                                                     SlurmLauncher)

from grpo_launcher.exit_codes import ExitCode
from grpo_launcher.launch.status import scheduler_job
from grpo_launcher.spec.errors import Violation

from .grpo_launcher import GrpoLauncher

OURS = ("python launch.py cluster=slurm cluster.nodes=N -m KEY=a,b ... (our sweep: each point its own sbatch "
        "job, Ray over its nodes; the command returns at once: launch.py status)")


def submitit_problems(spec: Any, params: dict) -> List[str]:
    """What hydra-submitit-launcher cannot run: a point's run must fit the one task of the one node it gets."""
    out = []
    for key in ("nodes", "tasks_per_node"):
        if params.get(key, 1) != 1:
            out.append(Violation("submitit_single_node", (f"hydra.launcher.{key}",),
                                 f"is {params[key]}: a submitit point is one run in one task on one node",
                                 f"leave it at 1; for multi-node points: {OURS}"))
    if spec is not None and spec.cluster.kind.value == "slurm":
        nodes = f" with cluster.nodes={spec.cluster.nodes}" if spec.cluster.nodes > 1 else ""
        out.append(Violation("submitit_single_node", ("cluster",), f"cluster=slurm{nodes} in a submitit point: the "
                             "submitit job is the Slurm job, and the run inside it would submit another",
                             OURS if nodes else "drop cluster=slurm (hydra.launcher.partition, timeout_min, "
                             f"cpus_per_task, gpus_per_node, mem_gb size the job), or {OURS}"))
    return [v.render() for v in out]


def gpu_problems(spec: Any, params: dict) -> List[str]:
    """submitit_slurm: the job must ask Slurm for the GPUs the run takes on its node."""
    want, get = (spec.cluster.gpus_per_node if spec is not None else 0), params.get("gpus_per_node") or 0
    if want <= get:
        return []
    return [Violation("submitit_gpus", ("hydra.launcher.gpus_per_node", "cluster.gpus_per_node"),
                      f"the run takes {want} GPU(s) on its node, and its job asks Slurm for {get}",
                      f"hydra.launcher.gpus_per_node={want}").render()]


class SubmititPoints(GrpoLauncher):
    """GrpoLauncher's checks, MLflow parent run and summary; the points go to hydra-submitit-launcher."""

    PLUGIN: type = BaseSubmititLauncher

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.submitit = self.PLUGIN(**params)

    def setup(self, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.submitit.setup(**kwargs)

    def point_problems(self, cfg: Optional[DictConfig], overrides: Sequence[str],
                       exc: Optional[Exception]) -> Tuple[Optional[Any], List[str]]:
        launch, problems = super().point_problems(cfg, overrides, exc)
        extra = submitit_problems(launch.spec if launch else None, self.submitit.params)
        return (None, problems + extra) if extra else (launch, problems)

    def _run_points(self, configs: Sequence[Any], checked: Sequence[Tuple[Any, List[str]]],
                    job_overrides: Sequence[Sequence[str]], initial_job_idx: int, runs: List[JobReturn]) -> None:
        if all(launch.spec.dry_run for launch, _ in checked):  # the plans printed here; nothing submitted
            super()._run_points(configs, checked, job_overrides, initial_job_idx, runs)
            return
        from submitit.core.utils import UncompletedJobError  # here: every launch.py start imports the plugins

        try:
            runs.extend(self.submitit.launch(job_overrides, initial_job_idx))  # waits for every job, in order
        except UncompletedJobError as exc:  # sbatch refused, scancel'ed, killed, node lost: no traceback here
            head, _, tail = str(exc).partition("Error stream produced:")
            last = f"\n  its last lines:{tail.rstrip()[-1500:]}" if tail.strip() else ""
            print(f"error: a sweep point's job failed or ended without a result: {head.strip()}{last}\n"
                  "  the other points' jobs may still run: squeue --me", file=sys.stderr)
            raise SystemExit(ExitCode.FAILED) from None


def scontrol_watcher() -> Any:
    """submitit's job watcher, reading job states from `scontrol show job` (launch/status.py, as `launch.py
    status` reads them), not sacct: a cluster without accounting (the local test cluster) has no sacct, and
    submitit would then wait forever for a job that ended without its result file (scancel, node failure, OOM).
    A job Slurm no longer knows (MinJobAge passed) counts as ended: submitit then reports it as failed.
    (submitit is imported here, not at plugin discovery: every launch.py start scans the plugins.)"""
    from submitit.slurm.slurm import SlurmInfoWatcher  # here: every launch.py start imports the plugins (Hydra's scan)

    class ScontrolWatcher(SlurmInfoWatcher):
        def update(self) -> None:
            for job in self._registered - self._finished:
                info = scheduler_job(job)
                self._info_dict[job] = {"State": info.get("JobState", "UNKNOWN") if info else "GONE"}
                if self.is_done(job, mode="cache"):
                    self._finished.add(job)
            self._last_status_check = time.time()

    return ScontrolWatcher(delay_s=60)


class SubmititSlurm(SubmititPoints):
    PLUGIN = SlurmLauncher

    def point_problems(self, cfg: Optional[DictConfig], overrides: Sequence[str],
                       exc: Optional[Exception]) -> Tuple[Optional[Any], List[str]]:
        """The run's GPUs are the job's node's, not this machine's: local_gpus_present is checked in the job (the
        run's own pre-flight there); here, the job must ask Slurm for as many as the run takes."""
        launch, problems = super().point_problems(cfg, overrides, exc)
        problems = [p for p in problems if "[rule: local_gpus_present]" not in p]
        if launch is None and not problems and cfg is not None:  # it was the only one: the spec, probes skipped
            dry = cfg.copy()
            dry.dry_run = True
            launch, problems = super().point_problems(dry, overrides, exc)
            if launch is not None:  # never executed here (its job pre-flights the point on its node): dry_run put
                # back, so that this launcher does not take the point for a dry run
                launch = dataclasses.replace(launch, spec=dataclasses.replace(launch.spec, dry_run=cfg.dry_run))
        return launch, problems + gpu_problems(launch.spec if launch else None, self.submitit.params)

    def _run_points(self, *args: Any) -> None:
        from submitit.slurm.slurm import SlurmJob  # here: every launch.py start imports the plugins

        SlurmJob.watcher = scontrol_watcher()  # submitit's jobs all share this class attribute
        try:
            super()._run_points(*args)
        except KeyboardInterrupt:  # Ctrl-C stops the waiting, not the jobs (submitit's way): say so, and how
            folder = Path(str(self.config.hydra.sweep.dir)) / ".submitit" if self.config is not None else Path()
            ids = {d.name.partition("_")[0] for d in folder.glob("[0-9]*")}  # JOB (the array's) and JOB_I
            print(f"\ninterrupted: the points' Slurm jobs go on (their logs: {folder}); "
                  f"to stop them: scancel {' '.join(sorted(ids)) or 'JOB'}", file=sys.stderr)
            raise SystemExit(130) from None


class SubmititLocal(SubmititPoints):
    PLUGIN = LocalLauncher
