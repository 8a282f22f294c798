"""`launch.py rerun RUN_DIR [key=value ...]`: a recorded run's spec again, as a new run.

    python launch.py rerun RUN_DIR [key=value ...]   the same spec again, as a new run RUN_NAME-rerunN
                                                     (name=... to choose; the same name resumes that run)

What a run dir records about its code, packages and data (RUN_DIR/repro/) is tracking/repro.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..tracking.repro import REPRO, git_state

if TYPE_CHECKING:
    from ..spec.schema import RunSpec


def rerun(args: list[str]) -> int:
    """`launch.py rerun RUN_DIR [key=value ...]`: the run's resolved spec again, validated, as a new run."""
    import argparse

    ap = argparse.ArgumentParser(prog="launch.py rerun", description=rerun.__doc__)
    ap.add_argument("run_dir", type=Path, help="a run directory (holding spec.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value changes (name=... picks the new run's name)")
    ns = ap.parse_args(args)
    ns.run_dir = ns.run_dir.resolve()  # before _launch_dir changes the working directory
    spec_file = ns.run_dir / "spec.yaml"
    if not spec_file.is_file():
        print(f"error: {ns.run_dir} is not a run dir (no spec.yaml)", file=sys.stderr)
        return 2
    from ..plan import make_plan
    from ..spec.errors import ConfigError
    from . import execute

    _launch_dir(ns.run_dir / REPRO / "git.json")
    try:
        spec = rerun_spec(spec_file, ns.overrides)
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        return 2
    _say_code_drift(ns.run_dir / REPRO / "git.json")
    print(f"grpo-launcher: rerunning {ns.run_dir} as '{spec.name}'", flush=True)
    return execute(spec, make_plan(spec))


def rerun_spec(spec_file: Path, overrides: list[str]) -> RunSpec:
    """The saved spec (secrets included) + overrides → a validated RunSpec with a fresh run name."""
    import dataclasses

    from omegaconf import OmegaConf

    from ..spec.compose import spec_to_yaml, to_spec
    from ..spec.errors import ConfigError, Violation
    from ..spec.rules import validate
    from .rundir import load_spec_file

    base = load_spec_file(spec_file)
    cfg = OmegaConf.create(spec_to_yaml(base))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError([Violation("override_syntax", (b,), f"{b!r} is not key=value", "write key=value")
                           for b in bad])
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError([Violation("composition", ("<overrides>",), str(exc), "fix the override")]) from exc
    spec = to_spec(cfg)
    if not any(o.startswith("name=") for o in overrides):
        spec = dataclasses.replace(spec, name=_fresh_name(Path(spec.output_root), base.name))
    violations = validate(spec)
    if violations:
        raise ConfigError(violations)
    return spec


def _launch_dir(git_file: Path) -> None:
    """Work from the directory the run was launched in: its spec's relative paths are relative to it."""
    import os

    try:
        then = json.loads(git_file.read_text()).get("cwd")
    except (OSError, ValueError):
        return
    if then and Path(then).is_dir() and Path(then).resolve() != Path.cwd().resolve():
        os.chdir(then)
        print(f"grpo-launcher: working from {then}, where the run was launched (its relative paths, and any "
              f"relative path given here, are relative to it)", flush=True)


def _fresh_name(root: Path, name: str) -> str:
    n = 1
    while (root.resolve() / f"{name}-rerun{n}").exists():
        n += 1
    return f"{name}-rerun{n}"


def _say_code_drift(git_file: Path) -> None:
    if not git_file.is_file():
        return
    then, now = json.loads(git_file.read_text()), git_state()
    if then.get("commit") and then.get("commit") != now.get("commit"):
        print(f"grpo-launcher: note: the run used commit {then['commit'][:12]}, this checkout is at "
              f"{(now.get('commit') or '?')[:12]}: `git checkout {then['commit'][:12]}` to run the same code",
              flush=True)
    diff = git_file.parent / "uncommitted.diff"
    if then.get("dirty") and diff.is_file():
        print(f"grpo-launcher: note: the run had uncommitted changes: `git apply {diff}` reproduces them",
              flush=True)
