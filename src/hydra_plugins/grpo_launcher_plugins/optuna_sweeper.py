"""hydra/sweeper=optuna: hyperparameter search on optuna ≥ 4 with a persistent (sqlite) study.

    python launch.py -m hydra/sweeper=optuna hydra.sweeper.n_trials=8 \
        'train.lr=tag(log, interval(1e-5, 1e-3))' 'loss.clip_high=choice(0.2, 0.28)'

Search spaces use Hydra's override syntax (choice, range, interval, tag(log, ...)) on the command line or
in `hydra.sweeper.params`. Each trial is one run of the `grpo` launcher (a local run, or a Slurm job the
sweeper waits for); its objective is a named metric read back from the finished run. A trial that fails
or crashes is recorded as FAIL and the study goes on. The study lives in `storage` (default:
sqlite in output_root) under `study_name`: invoking again with the same name continues it.
"""

import itertools
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from grpo_launcher.exit_codes import ExitCode
from grpo_launcher.launch.sweep import (end_study_parent_run, is_int_key, log_best_to_parent, optuna_settings_problems,
                                        search_space_problems, trial_dir_problems, trial_name)
from grpo_launcher.spec.errors import ConfigError, Violation

log = logging.getLogger(__name__)
SAMPLERS = ("tpe", "random", "grid")


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.grpo_launcher_plugins.optuna_sweeper.OptunaSweeper"
    direction: str = "maximize"  # maximize | minimize
    n_trials: int = 8  # total for the study (a continued study runs only the missing ones)
    n_jobs: int = 1  # trials launched per batch (parallel where the launcher allows)
    sampler: str = "tpe"  # tpe | random | grid
    seed: int = 0
    study_name: Optional[str] = None  # default: the run name
    storage: Optional[str] = None  # default: sqlite:///<output_root>/optuna.db
    objective: str = "val/reward_mean"
    params: Dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="grpo_launcher")


def distribution(ov: Override, integer: bool = False, grid: bool = False):
    """Hydra sweep override → optuna distribution (`integer`: the key is an int, its interval searched as ints;
    `grid`: a range as its values, which the grid enumerates). launch/sweep.py search_space_problems checks first."""
    import optuna.distributions as d  # here: every launch.py start imports the plugins (Hydra's scan): 0.2 s

    sweep, log_scale = ov.value(), "log" in getattr(ov.value(), "tags", set())
    if isinstance(sweep, ChoiceSweep):
        return d.CategoricalDistribution([c for c in sweep.list])
    if isinstance(sweep, RangeSweep):
        values = list(ov.sweep_iterator())
        if all(isinstance(v, int) for v in values) and len(values) > 1 and not grid:
            return d.IntDistribution(values[0], values[-1], step=values[1] - values[0])
        return d.CategoricalDistribution(values)
    if isinstance(sweep, IntervalSweep):
        if integer:  # Hydra's interval() bounds are floats; whole numbers for an int key (launch/sweep.py checks)
            return d.IntDistribution(int(sweep.start), int(sweep.end), log=log_scale)
        return d.FloatDistribution(float(sweep.start), float(sweep.end), log=log_scale)
    raise ValueError(f"{ov.input_line}: not a search space (use choice, range or interval)")


def as_override(key: str, value: Any) -> str:
    return f"{key}={'null' if value is None else repr(value) if isinstance(value, str) else value}"


class OptunaSweeper(Sweeper):
    def __init__(self, **conf: Any) -> None:
        self.conf = OptunaSweeperConf(**conf)
        if self.conf.sampler not in SAMPLERS:  # grid: choice/range spaces, enumerated
            raise ValueError(f"hydra.sweeper.sampler={self.conf.sampler}: choose one of {', '.join(SAMPLERS)}")

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher.invalid_points_fail = True  # a sampled point that breaks a rule is a failed trial

    def split(self, arguments: List[str]) -> tuple[List[str], Dict[str, Any], List[Violation]]:
        """(the fixed overrides, the search space, what in it the sweeper cannot search)."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        params = [f"{k}={v}" for k, v in self.conf.params.items()]
        fixed, space, bad = [], {}, []
        for ov in parser.parse_overrides([*params, *arguments]):
            if not ov.is_sweep_override():
                fixed.append(ov.input_line)
            elif problems := search_space_problems(ov, self.conf.sampler):
                bad += problems
            else:
                key = ov.get_key_element()
                space[key] = distribution(ov, is_int_key(self.config, key), grid=self.conf.sampler == "grid")
        return fixed, space, bad

    def sampler(self, tried: int) -> Any:
        """The sampler, seeded by hydra.sweeper.seed and the trials the study already has: a fresh study (none) is
        seeded with the seed itself, so the same seed gives the same trials; a continued study draws new points (the
        same seed replayed the same random draws: each new trial repeated one of the first ones)."""
        import numpy as np
        import optuna  # here: every launch.py start imports the plugins

        seed = self.conf.seed if tried == 0 else int(np.random.SeedSequence([self.conf.seed, tried]).generate_state(1)[0])
        if self.conf.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=seed)
        return optuna.samplers.RandomSampler(seed=seed)

    def study(self, space: Dict[str, Any]):
        import optuna  # here: every launch.py start imports the plugins

        c = self.config
        name = self.conf.study_name or str(c.name)
        storage: Optional[str] = self.conf.storage or f"sqlite:///{Path(str(c.output_root)).resolve() / 'optuna.db'}"
        if c.dry_run:  # a dry run's trials have no value (their result is the plan's exit code): never stored
            storage = None
            log.info("dry run: the study is kept in memory only (its storage is not touched)")
        Path(str(c.output_root)).mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(study_name=name, storage=storage, sampler=self.sampler(0),
                                    direction=self.conf.direction, load_if_exists=True)
        study.sampler = self.sampler(len(study.trials))  # a continued study: seeded anew
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)  # left running by an interrupted sweep
        if self.conf.sampler == "grid":  # every grid point not tried yet is queued, in order
            # (optuna's GridSampler calls study.stop() when exhausted, which ask/tell does not allow)
            tried = [t.params for t in study.trials]
            for values in itertools.product(*(v.choices for v in space.values())):
                point = dict(zip(space, values))
                if point not in tried:
                    study.enqueue_trial(point)
        return study

    def sweep(self, arguments: List[str]) -> Any:
        c = self.conf
        fixed, space, bad = self.split(arguments)
        bad = optuna_settings_problems(c.n_trials, c.n_jobs, c.objective, c.direction) + bad
        if bad:  # before the study is opened or created: nothing is written
            print(ConfigError(bad).render(), file=sys.stderr)
            sys.exit(ExitCode.CONFIG_ERROR)  # passes through Hydra's error reporting: no traceback
        study = self.study(space)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        if "parent_run_id" in study.user_attrs:  # a continued study keeps its MLflow parent run
            (sweep_dir / "mlflow_parent_run_id").write_text(study.user_attrs["parent_run_id"] + "\n")
        os.environ["GRPO_OBJECTIVE_METRIC"] = self.conf.objective
        finished = sum(t.state.is_finished() for t in study.trials)
        log.info(f"study '{study.study_name}': {finished} finished trial(s), {self.conf.n_trials} wanted")
        job_idx, ok = 0, True
        while finished < self.conf.n_trials:
            trials = [study.ask(space) for _ in range(min(self.conf.n_jobs, self.conf.n_trials - finished))]
            names = [trial_name(str(self.config.name), study.study_name, t.number) for t in trials]
            if not self.config.dry_run:  # a dry run writes no run dir
                self.check_new(study, trials, names)
            own = [o for o in fixed if not o.startswith("name=")]  # the user's name= is in the trial's: BASE-tN
            overrides = [[*own, f"name={n}", "cluster.wait=true", *(as_override(k, v) for k, v in t.params.items())]
                         for t, n in zip(trials, names)]
            results = self.launcher.launch(overrides, initial_job_idx=job_idx)
            ok = all([self.tell(study, t, r) for t, r in zip(trials, results)]) and ok
            job_idx += len(trials)
            finished += len(trials)
        if self.config.dry_run and not ok:  # was exit 0: every trial refused read as a plan that would run
            print("optuna sweep: dry run: a trial's config was refused (its errors are above)", file=sys.stderr,
                  flush=True)
            sys.exit(ExitCode.CONFIG_ERROR)  # as a basic sweep's dry run with a refused point
        if not self.config.dry_run:
            completed = self.report(study, sweep_dir)
            end_study_parent_run(self.config, sweep_dir, ok)
            if not completed:  # was exit 0 with a warning: a study of failures read as a finished search
                where = "their errors are above" if job_idx else "in earlier sweeps; none was left to run"
                print(f"optuna sweep: no trial completed: all {len(study.trials)} trial(s) of study "
                      f"'{study.study_name}' failed ({where})", file=sys.stderr, flush=True)
                sys.exit(ExitCode.FAILED)  # passes through Hydra's error reporting: no traceback
        return study

    def check_new(self, study: Any, trials: List[Any], names: List[str]) -> None:
        """A new trial never runs in a run dir that already holds a run (it would resume it): exit 2, key named."""
        import optuna  # here: every launch.py start imports the plugins

        bad = trial_dir_problems(Path(str(self.config.output_root)).resolve(), names, study.study_name)
        if bad:
            for t in trials:
                study.tell(t, state=optuna.trial.TrialState.FAIL)
            print(ConfigError(bad).render(), file=sys.stderr)
            sys.exit(ExitCode.CONFIG_ERROR)  # passes through Hydra's error reporting: no traceback

    def tell(self, study, trial, result) -> bool:
        """Tell the study the trial's value, or FAIL; whether it completed."""
        import optuna  # here: every launch.py start imports the plugins

        if self.config.dry_run:  # its return value is execute()'s exit code, not the objective
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return result.status == JobStatus.COMPLETED and result._return_value == 0  # refused: 2
        value = result._return_value if result.status == JobStatus.COMPLETED else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            study.tell(trial, float(value))
            log.info(f"trial {trial.number}: {self.conf.objective} = {value:.4g}  {trial.params}")
            return True
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            why = result._return_value if result.status == JobStatus.FAILED else f"no {self.conf.objective}"
            log.warning(f"trial {trial.number} FAILED ({why}); the study goes on")
            return False

    def report(self, study, sweep_dir: Path) -> bool:
        """Write and print the best trial; whether any trial of the study completed."""
        import optuna  # here: every launch.py start imports the plugins

        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not done:
            return False
        best = study.best_trial
        text = OmegaConf.to_yaml({"study": study.study_name, "trial": best.number, "value": best.value,
                                  "objective": self.conf.objective, "params": best.params})
        (sweep_dir / "optuna_best.yaml").write_text(text)
        print(f"best trial of study '{study.study_name}':\n{text}", flush=True)
        marker = sweep_dir / "mlflow_parent_run_id"
        if marker.exists():
            run_id = marker.read_text().strip()
            study.set_user_attr("parent_run_id", run_id)
            log_best_to_parent(self.config, run_id, best.number, best.value, best.params, self.conf.objective)
        return True
