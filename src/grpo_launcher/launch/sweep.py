"""Sweeps: `python launch.py -m key=a,b ...` is Hydra multirun over the same compose → spec → plan → execute.

The `grpo` launcher validates every point before launching any; each point is its own run (own run dir,
checkpoints, MLflow child run under one parent run per sweep; on Slurm its own job). The `optuna`
sweeper (hydra/sweeper=optuna) asks for points and reads back each run's objective from its summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, IntegerNode, OmegaConf

from ..checkpoint.manager import spec_changes
from ..exit_codes import ExitCode
from ..finished import newest_meta
from ..pasteable import arg
from ..plan import make_plan
from ..preflight.training import METRIC_HIGHER_IS_BETTER
from ..spec.compose import (ConfigSource, _composition_violation, check_override_keys, compose, register_schema,
                            to_spec)
from ..spec.errors import ConfigError, Violation
from ..spec.mlflow_env import with_mlflow_env
from ..spec.schema import RunSpec
from ..tracking import metric_names
from ..tracking.store import tracking_line
from . import execute
from .names import UNSAFE, derived_name
from .preflight import EXCLUDED_FROM_NAME, Launch, preflight_config
from .status import read_status

PARENT_ENV = "GRPO_PARENT_RUN_ID"


def multirun(overrides: list[str], source: Optional[ConfigSource] = None, hydra_flags: Sequence[str] = ()) -> int:
    """Run Hydra's multirun with our launcher (and sweeper, when asked) over conf/ (and the user's config dirs)."""
    source = source or ConfigSource()
    register_schema()
    args = list(overrides)
    for group in ("launcher", "sweeper"):  # ours, unless the user picked others (e.g. hydra/sweeper=optuna)
        if not any(a.startswith(f"hydra/{group}=") for a in args):
            args.append(f"hydra/{group}=grpo")
    bad = base_problems(args, source)
    if bad:
        print(ConfigError(bad).render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    args += submitit_target(args)
    app = hydra.main(config_path=str(source.conf_dir), config_name=source.config_name, version_base="1.3")(run_point)
    saved, sys.argv = sys.argv, [sys.argv[0], "--multirun", *hydra_flags, *source.overrides(), *args]
    try:
        app()
    except SystemExit as exc:
        return int(exc.code or ExitCode.OK) if not isinstance(exc.code, str) else ExitCode.FAILED
    finally:
        sys.argv = saved
    return ExitCode.OK


SUBMITIT = {"submitit_slurm": "SubmititSlurm", "submitit_local": "SubmititLocal"}


def submitit_target(args: list[str]) -> list[str]:
    """hydra/launcher=submitit_slurm|submitit_local: the plugin's config (its keys: hydra.launcher.partition ...)
    with our launcher class, which checks every point first (hydra_plugins/grpo_launcher_plugins/submitit_points)."""
    chosen = [a.partition("=")[2] for a in args if a.startswith("hydra/launcher=")]
    if not chosen or chosen[-1] not in SUBMITIT:
        return []
    named = any(a.startswith("hydra.launcher.name=") for a in args)  # else the job is named after the runs
    return [f"hydra.launcher._target_=hydra_plugins.grpo_launcher_plugins.submitit_points.{SUBMITIT[chosen[-1]]}",
            *([] if named else ["hydra.launcher.name=${name}"])]


def base_problems(args: list[str], source: ConfigSource) -> list:
    """Unknown keys in any override, and the sweep's base (its overrides without the swept ones) composing:
    what Hydra would otherwise report with its own error and exit 1."""
    bad = check_override_keys(args, multirun=True)
    if bad:
        return bad
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(args)
    objectives = [ov.value() for ov in parsed if ov.key_or_group == "hydra.sweeper.objective"]
    bad = [v for name in objectives for v in objective_problems(name)] + sweeper_problems(parsed)
    if bad:
        return bad
    fixed = [a for a, ov in zip(args, parsed) if not ov.is_sweep_override()]
    try:
        base = compose([a for a in fixed if not a.startswith("hydra")], source=source)
    except ConfigError as err:
        return err.violations
    return [v for ov in parsed if isinstance(ov.value(), IntervalSweep) for v in interval_problems(base, ov)]


def is_int_key(cfg: DictConfig, key: str) -> bool:
    """Whether the schema types `key` as an int (Hydra's interval() gives float bounds whatever the key's type)."""
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(section, DictConfig) and isinstance(section._get_node(leaf), IntegerNode)


def interval_problems(cfg: DictConfig, ov: Override) -> list[Violation]:
    """An Optuna interval over an int key is searched as ints; with bounds that are not whole numbers every trial's
    value would be a float the int key refuses (each trial FAIL, the study empty)."""
    key, sweep = ov.get_key_element(), ov.value()
    if not is_int_key(cfg, key) or all(float(b).is_integer() for b in (sweep.start, sweep.end)):
        return []
    return [Violation("int_key_searched_as_int", (key,), f"{ov.input_line}: {key} is an int, the interval's bounds "
                      "are not whole numbers", f"whole-number bounds ({key}=interval(1,8)) or choice(...)")]


SWEEPER_CHOICES = {"hydra.sweeper.direction": ("maximize", "minimize"), "hydra.sweeper.sampler": ("tpe", "random", "grid")}


def sweeper_problems(parsed: Sequence[Override]) -> list[Violation]:
    """The Optuna sweeper's choices (was optuna's ValueError and a traceback, e.g. direction=max)."""
    return [Violation("sweeper_choice", (ov.key_or_group,), f"{ov.input_line}: not one of {', '.join(choices)}",
                      f"{ov.key_or_group}={choices[0]}")
            for ov in parsed for choices in [SWEEPER_CHOICES.get(ov.key_or_group)]
            if choices and ov.value() not in choices]


def objective_problems(objective: object) -> list[Violation]:
    """The Optuna objective must be a metric a run logs (tracking/metric_names.py): with a typo every trial would
    run to its end and then fail."""
    if isinstance(objective, str) and metric_names.is_metric(objective):
        return []
    return [Violation("sweep_objective_is_logged", ("hydra.sweeper.objective",),
                      f"{objective!r} is not a metric a run logs, so no trial could report it",
                      f"use one of: {', '.join(sorted(metric_names.METRICS))} (or time/<phase>_s)")]


def objective_higher_is_better(objective: str) -> Optional[bool]:
    """Whether the objective is better when higher (True), lower (False), or either (None, e.g. train/kl): the
    directions checkpoint.metric is ranked by (preflight/training.py), a loss, a reward or an accuracy, a wall time."""
    known = METRIC_HIGHER_IS_BETTER.get(objective)
    if known is not None:
        return known
    leaf = objective.rpartition("/")[2]
    if "loss" in leaf:  # train/pg_loss
        return False
    if objective.startswith(metric_names.TIME_PREFIX) and leaf.endswith(("_s", "_ms")):  # time/step_s
        return False
    if leaf in ("reward_mean", "accuracy") or (objective.startswith(metric_names.REWARD_PART_PREFIXES)
                                               and leaf.endswith("_mean")):  # val/reward/<function>_mean
        return True
    return None


def optuna_settings_problems(n_trials: object, n_jobs: object, objective: str, direction: str) -> list[Violation]:
    """The Optuna sweeper's numbers and the objective's direction, as the sweeper got them (command line, config).
    n_trials < 1 ran nothing and exited 0 ('0 finished trial(s), -1 wanted'); n_jobs < 1 asked for no trial, ever;
    a loss maximized (or a reward minimized) searched for the worst point, as checkpoint.metric's direction rule
    says for top-k (preflight/training.py checkpoint_metric_direction)."""
    bad = [Violation("sweeper_count", (f"hydra.sweeper.{key}",), f"hydra.sweeper.{key}={value}: must be ≥ 1 ({what})",
                     f"hydra.sweeper.{key}={fix}")
           for key, value, what, fix in (("n_trials", n_trials, "the trials the study should have", 8),
                                         ("n_jobs", n_jobs, "the trials launched per batch", 1))
           if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    higher = objective_higher_is_better(objective)
    if higher is not None and direction in ("maximize", "minimize") and (direction == "maximize") != higher:
        want = "maximize" if higher else "minimize"
        bad.append(Violation("sweep_objective_direction", ("hydra.sweeper.direction", "hydra.sweeper.objective"),
                             f"{objective} is better when {'higher' if higher else 'lower'}, but hydra.sweeper."
                             f"direction={direction}: the study would search for the worst point",
                             f"set hydra.sweeper.direction={want}"))
    return bad


def search_space_problems(ov: Override, sampler: str) -> list[Violation]:
    """A swept key the Optuna sweeper cannot search (was optuna's ValueError, or an AttributeError for grid, and a
    traceback): grid over an interval, an interval whose bounds are reversed, a log scale from 0 or below, a range
    with no value, a glob."""
    key, sweep = ov.get_key_element(), ov.value()
    space = f"{key}=choice(a,b,...), {key}=range(start,stop,step) or {key}=interval(low,high)"
    if isinstance(sweep, ChoiceSweep):
        return []
    if isinstance(sweep, RangeSweep):
        if list(ov.sweep_iterator()):
            return []
        return [Violation("search_space", (key,), f"{ov.input_line}: the range has no value",
                          f"a range with values, e.g. {key}=range(1,5)")]
    if not isinstance(sweep, IntervalSweep):
        return [Violation("search_space", (key,), f"{ov.input_line}: not a search space the Optuna sweeper knows",
                          f"use {space}")]
    if sampler == "grid":
        return [Violation("grid_needs_choices", (key, "hydra.sweeper.sampler"),
                          f"{ov.input_line}: the grid sampler enumerates each key's values, and an interval has none "
                          "to enumerate", f"give the grid choice() values ({key}=choice(1e-5,1e-4,1e-3)) or "
                          "range(...), or search the interval with hydra.sweeper.sampler=tpe or random")]
    low, high = float(sweep.start), float(sweep.end)
    if low > high:
        return [Violation("search_space", (key,), f"{ov.input_line}: the interval's low bound {low:g} is above its "
                          f"high bound {high:g}", f"{key}=interval({high:g},{low:g})")]
    if "log" in sweep.tags and low <= 0:
        example = f"{key}=tag(log,interval({high / 100:g},{high:g}))" if high > 0 else f"{key}=tag(log,interval(1e-5,1e-3))"
        return [Violation("log_interval_above_zero", (key,), f"{ov.input_line}: a log scale needs a low bound > 0, "
                          f"got {low:g}", f"a positive low bound ({example}), or the interval without tag(log, ...)")]
    return []


def named_points(base: str, points: Sequence[Sequence[str]]) -> list[list[str]]:
    """Give each point a run name made of the overrides that vary across the sweep (override_dirname-style)."""
    values: dict[str, set] = {}
    for ov in points:
        for o in ov:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    varying = {k for k, v in values.items() if len(v) > 1 and k not in EXCLUDED_FROM_NAME}
    given = [own_name(ov) for ov in points]
    names = [n for n in given if n is not None]
    # each point named apart (an Optuna batch's trials, -m name=a,b): its name as given, never `t0_train.lr=0.0003`
    # in one batch and `t2_0` in the next
    own = len(names) == len(set(names)) == len(points) > 1
    named = []
    for i, ov in enumerate(points):
        name = given[i] or base
        tagged = [o for o in ov if o.partition("=")[0] in varying] or ([str(i)] if len(points) > 1 else [])
        tagged = [] if own else tagged
        full = derived_name(name, tagged) if tagged else name  # short, readable (launch/names.py)
        named.append([o for o in ov if not o.startswith("name=")] + [f"name='{full}'"])  # quoted: has = and ,
    return named


def own_name(point: Sequence[str]) -> Optional[str]:
    """The point's `name=` value, the last one where it has several (as Hydra applies them), else None."""
    return next((o.partition("=")[2] for o in reversed(point) if o.startswith("name=")), None)


def trial_name(base: str, study: str, number: int) -> str:
    """An Optuna trial's run name: `BASE-tN` for the study named after the run (the default), else `BASE-STUDY-tN`,
    so that two studies in one output_root never share a run dir (trial numbers restart with each study)."""
    return f"{base}-t{number}" if study == base else f"{base}-{UNSAFE.sub('_', study)}-t{number}"


def trial_dir_problems(output_root: Path, names: Sequence[str], study: str) -> list[Violation]:
    """A new trial's run dir that already holds something (another study of the same name in another storage, or
    whose name reads the same): launching it would resume that run and log into its MLflow run."""
    taken = [str(output_root / n) for n in names if (output_root / n).exists()]
    if not taken:
        return []
    return [Violation("trial_run_dir_is_new", ("hydra.sweeper.study_name", "hydra.sweeper.storage"),
                      f"study {study!r}'s new trial(s) would run in {', '.join(taken)}, which already hold(s) a run "
                      "of another study: the trial would resume it and overwrite its results",
                      "give the study a name of its own (hydra.sweeper.study_name=NAME), or continue the study that "
                      "made those runs (its storage: hydra.sweeper.storage=URL)")]


STOPPED_BY_SIGNAL = (ExitCode.INTERRUPTED, ExitCode.TERMINATED)  # SIGINT / SIGTERM: checkpointed, then stopped


def run_point(cfg: DictConfig) -> Optional[float]:
    """The task of one sweep point: the same flow as a single run (pre-flight → execute). Returns the objective when
    known."""
    try:
        launch = preflight_config(cfg, task_overrides())
    except ConfigError as err:
        refusal = ConfigError(finished_under_other_values(to_spec(cfg))) if finished_only(err) else err
        if refusal.violations:  # passed at the sweep's check, refused now (a data file moved meanwhile)
            print(f"point {cfg.name}: {refusal.render()}", file=sys.stderr, flush=True)
            raise refusal from None
        run_dir = Path(str(cfg.output_root)).resolve() / str(cfg.name)
        print(f"grpo-launcher: run '{cfg.name}' already finished ({run_dir}): skipped (its result stands; "
              "checkpoint.resume=fresh runs it again)", flush=True)
        return read_objective(run_dir, objective_metric())
    if launch.spec.logging.mlflow:
        print(tracking_line(launch.spec, launch.plan.tracking_uri), flush=True)
    code = execute(launch)
    if code in STOPPED_BY_SIGNAL:  # Ctrl-C stopped the point: the sweep stops (it went on to the next point)
        print(f"sweep stopped: run {launch.spec.name} was stopped (exit {code}); no later point is started. The same "
              "command again resumes it and runs the rest", file=sys.stderr, flush=True)
        raise SystemExit(code)  # through Hydra's run_job (it catches Exception): the launcher prints the summary
    if code != ExitCode.OK:
        raise RuntimeError(f"run {launch.spec.name} exited with {code}")
    return read_objective(launch.plan.run_dir, objective_metric())


def task_overrides() -> list[str]:
    """The overrides of the point Hydra is running (for the model keys stated explicitly)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not inside a Hydra job
        return []


def point_problems(cfg: Optional[DictConfig], overrides: Sequence[str] = (),
                   compose_error: Optional[BaseException] = None) -> tuple[Optional[Launch], list[str]]:
    """(the point's Launch, its violations rendered): every pre-flight check, as for a single run."""
    if cfg is None:  # the point did not even compose (e.g. model=nope in a,b)
        return None, [_composition_violation(compose_error).render()]
    try:
        return preflight_config(cfg, list(overrides)), []
    except ConfigError as err:
        if not finished_only(err):
            return None, [v.render() for v in err.violations]
        spec = to_spec(cfg)  # the same sweep again (after a Ctrl-C or a failed point): this point is done, unless
        other = finished_under_other_values(spec)  # its run finished under other values
        return (None, [v.render() for v in other]) if other else (Launch(spec, make_plan(spec), None), [])


def finished_only(err: ConfigError) -> bool:
    """The point's one refusal is that its run already finished (rule run_name_not_finished): a sweep run again
    skips it (run_point says so) and runs the rest. It refused the whole sweep: after one point failed or a Ctrl-C,
    the same command could not finish the others."""
    return bool(err.violations) and all(v.rule == "run_name_not_finished" for v in err.violations)


RESULT_SECTIONS = ("model.", "rollout.", "loss.", "train.", "grpo.", "env.")  # what a run's result depends on


def finished_under_other_values(spec: RunSpec) -> list[Violation]:
    """A point whose run dir holds a run that finished under other values (the same sweep with another fixed key,
    e.g. train.lr): skipping it would report that run's result as this point's. Refused, the keys named."""
    run_dir = Path(spec.output_root).resolve() / spec.name
    newest = newest_meta(run_dir)
    if newest is None:  # unreadable: the skip stands on the finished rule alone
        return []
    changed = {k: v for k, v in spec_changes(newest[1], spec).items() if k.startswith(RESULT_SECTIONS)}
    if not changed:
        return []
    text = ", ".join(f"{k}: {old!r} there, {new!r} here" for k, (old, new) in changed.items())
    return [Violation("sweep_point_matches_its_finished_run", (*changed, "name"),
                      f"run '{spec.name}' already finished ({run_dir}) under other values ({text}); skipping it "
                      "would report that run's result as this point's",
                      "give the sweep a name of its own (name=...), or checkpoint.resume=fresh to run its points "
                      "again")]


def check_points(checked: Sequence[tuple], overrides: Sequence[Sequence[str]]) -> None:
    """If any point breaks a rule, report every bad point (key named), launch nothing, exit 2."""
    problems = [f"point [{' '.join(ov)}]:\n" + "\n".join(p) for (_, p), ov in zip(checked, overrides) if p]
    if problems:
        print("config error: sweep not launched, no point was started\n" + "\n".join(problems), file=sys.stderr)
        sys.exit(ExitCode.CONFIG_ERROR)  # SystemExit passes through Hydra's error reporting: no traceback


def sweep_parent_run(spec: RunSpec, sweep_dir: Path) -> Optional[str]:
    """Create (once per sweep dir) the MLflow parent run; children get its id through the environment."""
    if not spec.logging.mlflow or spec.dry_run:
        return None
    from mlflow.tracking import MlflowClient  # MLflow: imported by what talks to it, never by pre-flight
    from ..tracking.mlflow_tracker import open_experiment

    marker = sweep_dir / "mlflow_parent_run_id"
    uri = make_plan(spec).tracking_uri
    if marker.exists():
        run_id = marker.read_text().strip()
        MlflowClient(uri).update_run(run_id, status="RUNNING")  # a continued sweep
    else:
        client = MlflowClient(uri)
        exp_id = open_experiment(client, spec.logging.experiment, uri)  # artifacts beside the store, not ./mlruns
        run_id = client.create_run(exp_id, run_name=f"sweep-{sweep_dir.name}",
                                   tags={"grpo.sweep_dir": str(sweep_dir)}).info.run_id
        marker.write_text(run_id + "\n")
    os.environ[PARENT_ENV] = run_id
    return run_id


def end_sweep_parent_run(spec: RunSpec, sweep_dir: Path, ok: bool) -> Optional[str]:
    """End the sweep's MLflow parent run: FINISHED when every point ran (or was submitted) fine, else FAILED."""
    marker = sweep_dir / "mlflow_parent_run_id"
    if not spec.logging.mlflow or spec.dry_run or not marker.exists():
        return None
    from mlflow.tracking import MlflowClient  # MLflow: imported by what talks to it, never by pre-flight

    status = "FINISHED" if ok else "FAILED"
    MlflowClient(make_plan(spec).tracking_uri).set_terminated(marker.read_text().strip(), status=status)
    return status


def end_study_parent_run(cfg: DictConfig, sweep_dir: Path, ok: bool) -> Optional[str]:
    """An Optuna study's MLflow parent run ends with the study: FINISHED when every trial of this invocation completed,
    else FAILED. (Each batch's launch ends it after that batch alone: the last trial alone decided.)"""
    marker = sweep_dir / "mlflow_parent_run_id"
    if not marker.exists():
        return None
    from mlflow.tracking import MlflowClient  # MLflow: imported by what talks to it, never by pre-flight

    status = "FINISHED" if ok else "FAILED"
    client = MlflowClient(make_plan(with_mlflow_env(to_spec(cfg))).tracking_uri)  # the parent's store
    client.set_terminated(marker.read_text().strip(), status=status)
    return status


def objective_metric() -> str:
    return os.environ.get("GRPO_OBJECTIVE_METRIC", metric_names.VAL_REWARD_MEAN)


def read_objective(run_dir: Path, metric: str) -> Optional[float]:
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["metrics"].get(metric)


def log_best_to_parent(cfg: DictConfig, run_id: str, trial: int, value: float, params: dict, objective: str) -> None:
    """The best trial, on the sweep's parent run. Its store is the sweep base config's, with MLflow's variables as
    resolve fills them in (a spec built here to find the store, never launched)."""
    from mlflow.tracking import MlflowClient  # MLflow: imported by what talks to it, never by pre-flight

    client = MlflowClient(make_plan(with_mlflow_env(to_spec(cfg))).tracking_uri)  # the parent's store
    client.log_metric(run_id, f"best/{objective}", value, step=trial)
    client.set_tag(run_id, "best_trial", str(trial))
    for k, v in params.items():
        client.set_tag(run_id, f"best.{k}", str(v))


def print_summary(points: Sequence[tuple[Launch, Optional[JobReturn]]]) -> int:
    """Each point's run: name, state, job id (Slurm); a failed point also says why, in one line, and its run dir.
    `points`: each point's Launch and Hydra's JobReturn (None where it did not run). Returns how many failed."""
    outcomes = [point_outcome(launch, result) for launch, result in points]
    failed = sum(1 for bad, _ in outcomes if bad)
    print(f"sweep summary ({len(points)} runs" + (f", {failed} failed" if failed else "") + "):")
    for (launch, result), (bad, why) in zip(points, outcomes):
        status = read_status(launch.plan.run_dir)
        state = ("FAILED" if bad and status.get("state") in (None, "RUNNING") else "NOT RUN" if result is None and
                 not launch.spec.dry_run and status.get("state") in (None, "RUNNING") else status.get("state", "-"))
        print(f"  {launch.spec.name:60s} {state:10s} job {status.get('job_id', '-')}"
              + (f"\n    {why} (run dir {launch.plan.run_dir})" if bad else ""))
    return failed


def point_outcome(launch: Launch, result: Optional[JobReturn]) -> tuple[bool, str]:
    """(failed, why in one line) of a point Hydra ran: the run's recorded reason (status.json's message), else what
    its task raised."""
    if result is None or result.status != JobStatus.FAILED:
        return False, ""
    status = read_status(launch.plan.run_dir)
    exc = result._return_value
    if isinstance(exc, ConfigError):  # refused at its turn: it never ran (status.json, if any, is an earlier run's)
        return True, config_line(exc)
    raised = str(exc or "").strip().splitlines()
    why = status.get("message") or (raised[0] if raised else "")
    code = status.get("exit_code")
    return True, (f"exit {code}: " if code is not None else "") + (why or "see its log: python launch.py logs "
                                                                    f"{arg(launch.plan.run_dir)}")


def config_line(err: ConfigError) -> str:
    """A point refused when its turn came (it passed the sweep's check): its violations in one line (was 'N config
    violation(s)')."""
    return "config error: " + "; ".join(f"{', '.join(v.keys)}: {v.message}" for v in err.violations)


def end_of_sweep(failed: int, points: int) -> None:
    """A sweep in which a point failed at run time exits 1 after the summary, without Hydra's traceback."""
    if failed:
        print(f"sweep failed: {failed} of {points} point(s) failed (each named above with its run dir)",
              file=sys.stderr, flush=True)
        sys.exit(ExitCode.FAILED)  # SystemExit passes through Hydra's error reporting: no traceback
