"""Pre-flight, end to end: compose → resolve → validate → plan → render → round-trip, into ONE frozen Launch that
`launch.execute` runs (the only way to run one). Nothing escapes but ConfigError.

Every stage's failure becomes a `config error` naming the key: the rules name theirs; a failure no rule
foresaw is still reported (rule `preflight_<stage>`, the exception's text) instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

from omegaconf.errors import OmegaConfBaseException

from ..envs.preflight import training_preflight
from ..finished import last_checkpoint_step
from ..plan import Plan, make_plan
from ..preflight.validate import validate
from ..spec.compose import ConfigSource, _override_key, checked_spec, compose_all, roundtrip_problems
from ..spec.errors import ConfigError, Violation
from ..spec.schema import ClusterKind, Resume, RunSpec
from . import rundir
from .names import derived_name
from .read_back import passed, reads_back_like_one_before
from .repro import saved_config
from .sbatch import render

EXCLUDED_FROM_NAME = ("name", "output_root", "dry_run", "cluster.wait")  # never part of a derived run name


@dataclasses.dataclass(frozen=True)
class Launch:
    """Pre-flight's one result: the resolved, validated spec (as spec.yaml holds it), its plan, and the job script
    (a Slurm run's sbatch script, rendered once, here; None for a local run). `launch.execute(launch)` runs it."""

    spec: RunSpec
    plan: Plan
    script: Optional[str]

    def __iter__(self) -> Iterator[Any]:  # `spec, plan = preflight(...)`, as the result read before it had a script
        return iter((self.spec, self.plan))

    def __getitem__(self, i: int) -> Any:
        return (self.spec, self.plan)[i]


T = TypeVar("T")


def guarded(stage: str, fn: Callable[[], T]) -> T:
    """Run one stage; any exception but ConfigError becomes a ConfigError naming the stage."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise ConfigError([Violation(f"preflight_{stage}", (f"<{stage}>",), f"{type(exc).__name__}: {first}",
                                     "fix the values named above; if none is, report this config")]) from exc


def render_job(spec: RunSpec, plan: Plan) -> Optional[str]:
    """The sbatch script a Slurm run submits (None for local runs)."""
    return render(spec, plan) if spec.cluster.kind == ClusterKind.slurm else None


def read_back_as_the_job(plan: Plan) -> Callable[[RunSpec], RunSpec]:
    """Write the spec as a run dir gets it (launch/rundir.py: redacted spec.yaml + secrets), into a temporary
    directory, and read it as the job's driver does (rundir.load_spec_file)."""
    def read_back(spec: RunSpec) -> RunSpec:
        with tempfile.TemporaryDirectory(prefix="grpo-spec-") as tmp:
            rundir.prepare(spec, dataclasses.replace(plan, run_dir=Path(tmp)))
            return rundir.load_spec_file(Path(tmp) / "spec.yaml")

    return read_back


def roundtrip(spec: RunSpec, plan: Plan) -> list[Violation]:
    """spec.yaml reads back as the spec: shown leaf by leaf from a spec that passed the full check (a sweep's
    points after its first: launch/read_back.py), else written and read as the job does."""
    if reads_back_like_one_before(spec):
        return []
    problems = roundtrip_problems(spec, read_back_as_the_job(plan))
    if not problems:
        passed(spec)
    return problems


def finish(spec: RunSpec) -> Launch:
    """A resolved, validated spec → its Launch: the plan derived, the job script rendered, spec.yaml round-tripped."""
    plan = guarded("plan", lambda: make_plan(spec))
    script = guarded("render", lambda: render_job(spec, plan))
    problems = guarded("roundtrip", lambda: roundtrip(spec, plan))
    if problems:
        raise ConfigError(problems)
    return Launch(spec, plan, script)


def preflight(overrides: list[str], source: Optional[ConfigSource] = None, saved: Optional[Path] = None) -> Launch:
    """A single run's overrides → its Launch, or ONE ConfigError with every problem (composed once). `saved`: a
    run's spec.yaml (launch.py rerun) composed with the overrides instead of conf/; the rest is the same."""
    keys = [_override_key(o) for o in overrides]
    if saved is not None:
        cfg, problems = guarded("compose", lambda: saved_config(saved, overrides))
    else:
        cfg, problems = guarded("compose", lambda: compose_all(overrides, source=source))
        name_after_overrides(cfg, overrides, keys)
    with training_preflight():  # a launch that trains: env=toy's prompts counted too (not eval's nor generate's)
        spec = guarded("compose", lambda: checked_spec(cfg, keys, problems, launch=True))  # resolved, then validated
    return finish(spec)


def name_after_overrides(cfg: Any, overrides: list[str], keys: list[str]) -> None:
    """No name= given, and the run of the default name has already finished: this run is named after its overrides,
    as sweep points are (tiny-grpo_rollout=vllm), so that `python launch.py` then `python launch.py rollout=vllm`
    both run. A run that can go on (grpo.max_steps raised; checkpoint.resume=fresh) keeps the name."""
    tag = ",".join(o for o, k in zip(overrides, keys) if k not in EXCLUDED_FROM_NAME)
    if not tag or "name" in keys:
        return
    try:  # a run dir that cannot be stat'ed (a name past NAME_MAX), a section or value of another type (++checkpoint=1,
        # grpo.max_steps=x): the spec's rules name the key
        if cfg.checkpoint.resume != Resume.auto:
            return
        step = last_checkpoint_step(Path(str(cfg.output_root)).resolve() / str(cfg.name))
        if step is None or step < cfg.grpo.max_steps:
            return
    except (AttributeError, TypeError, ValueError, OSError, OmegaConfBaseException):
        return
    name = derived_name(str(cfg.name), [o for o, k in zip(overrides, keys) if k not in EXCLUDED_FROM_NAME])
    print(f"grpo-launcher: run '{cfg.name}' already finished (step {step}): this run is named '{name}' "
          "(name=NAME to choose one)")
    cfg.name = name


def preflight_config(cfg: Any, overrides: list[str]) -> Launch:
    """A composed sweep point → its Launch, or ONE ConfigError (same checks as a single run)."""
    keys = [_override_key(o) for o in overrides]
    with training_preflight():  # (the same)
        spec = guarded("compose", lambda: checked_spec(cfg, keys, launch=True))
    return finish(spec)


def real_launch_problems(spec: RunSpec) -> list[Violation]:
    """What a dry run's spec would be refused for when launched for real (rules a dry run skips so that a plan
    for another build or cluster can still be inspected). The spec is judged as a real launch's, not changed."""
    try:
        return validate(dataclasses.replace(spec, dry_run=False))
    except Exception as exc:  # the dry run itself passed; its report must not fail
        return [Violation("preflight_real_launch", ("<spec>",), f"{type(exc).__name__}: {exc}"[:300],
                          "run it without dry_run=true to see")]
