"""hydra/launcher=grpo: validate ALL points of a batch first, then run them one after another
(cluster=local) or submit each as its own Slurm job without waiting (cluster=slurm)."""


import logging
import sys
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from grpo_launcher.launch import execute
from grpo_launcher.launch.sweep import (check_points, end_of_sweep, end_sweep_parent_run, named_points,
                                        point_problems, print_summary, sweep_parent_run)

from .shared_compose import SharedCompose

log = logging.getLogger(__name__)


@dataclass
class GrpoLauncherConf:
    _target_: str = "hydra_plugins.grpo_launcher_plugins.grpo_launcher.GrpoLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="grpo", node=GrpoLauncherConf, provider="grpo_launcher")


class GrpoLauncher(Launcher):
    def __init__(self) -> None:
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        self.invalid_points_fail = False  # the optuna sweeper turns bad points into failed trials
        self.shared: Optional[SharedCompose] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        self.shared = None  # made at the first batch, kept for the next ones (an Optuna study: one a trial)

    def point_config(self, overrides: Sequence[str], idx: int) -> Tuple[Optional[DictConfig], Optional[Exception]]:
        """(the point's composed config, None), or (None, why it does not compose): reported as a config error."""
        assert self.shared is not None, "launch() sets up the batch's composition"
        try:
            cfg = self.shared(list(overrides))
        except Exception as exc:  # a point that does not compose (model=nope in model=tiny,nope): named, exit 2
            return None, exc
        with open_dict(cfg):
            cfg.hydra.job.id = cfg.hydra.job.num = idx
        return cfg, None

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        job_overrides = named_points(str(self.config.name), job_overrides)
        if self.shared is None:  # the points' shared composition: the setup's loader and master config
            self.shared = SharedCompose(self.hydra_context.config_loader, self.config)
        composed = [self.point_config(o, initial_job_idx + i) for i, o in enumerate(job_overrides)]
        configs = [cfg for cfg, _ in composed]
        checked = [self.point_problems(cfg, o, exc) for (cfg, exc), o in zip(composed, job_overrides)]  # (launch, bad)
        if not self.invalid_points_fail:
            check_points(checked, job_overrides)  # exits 2 naming each bad point and key: nothing launched
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        first = next((launch.spec for launch, bad in checked if not bad), None)
        if first is not None:
            sweep_parent_run(first, sweep_dir)  # one MLflow parent run per sweep; children find it via env
        runs: list = []
        try:
            self._run_points(configs, checked, job_overrides, initial_job_idx, runs)
        finally:  # the parent run never stays RUNNING: FINISHED when every point succeeded, else FAILED
            if first is not None:
                ok = len(runs) == len(configs) and all(r.status == JobStatus.COMPLETED for r in runs)
                end_sweep_parent_run(first, sweep_dir, ok)
            points = [(launch, run) for (launch, _), run in zip_longest(checked, runs) if launch is not None]
            failed = print_summary(points)  # also when a point's Ctrl-C stopped the sweep (its SystemExit)
        if not self.invalid_points_fail:  # (the optuna sweeper counts failed trials itself)
            end_of_sweep(failed, len(runs))  # failed points: exit 1 after the summary, no traceback
        return runs

    def point_problems(self, cfg: Optional[DictConfig], overrides: Sequence[str],
                       exc: Optional[Exception]) -> Tuple[Optional[Any], List[str]]:
        """(a point's Launch, its problems rendered) after every pre-flight rule; a subclass adds its launcher's."""
        return point_problems(cfg, overrides, exc)

    def _run_points(self, configs: Sequence[Any], checked: Sequence[Tuple[Any, List[str]]],
                    job_overrides: Sequence[Sequence[str]], initial_job_idx: int, runs: list) -> None:
        for i, (cfg, (launch, problems)) in enumerate(zip(configs, checked)):
            log.info(f"#{initial_job_idx + i}: {' '.join(filter_overrides(job_overrides[i]))}")
            if problems:  # only with the optuna sweeper: a point that breaks a rule is a failed trial
                if self.config is not None and self.config.dry_run:  # a dry run's refused trial, named here
                    point = f"config error: point [{' '.join(job_overrides[i])}]:\n"
                    print(point + "\n".join(problems), file=sys.stderr, flush=True)  # (the sweeper tells FAIL only)
                runs.append(JobReturn(status=JobStatus.FAILED, _return_value=ValueError("\n".join(problems))))
                continue
            if launch.spec.dry_run:  # print the plan (and sbatch script) only: no job dir, no Hydra job machinery
                runs.append(JobReturn(status=JobStatus.COMPLETED, _return_value=execute(launch)))
                continue
            runs.append(run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=cfg,
                                job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir"))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)


class GrpoSweeper(BasicSweeper):
    """Hydra's basic sweeper (cartesian product of `a,b` overrides) without its own per-point composition
    check: the grpo launcher composes and validates every point anyway, with our rules."""

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        return None


@dataclass
class GrpoSweeperConf:
    _target_: str = "hydra_plugins.grpo_launcher_plugins.grpo_launcher.GrpoSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="grpo", node=GrpoSweeperConf, provider="grpo_launcher")
