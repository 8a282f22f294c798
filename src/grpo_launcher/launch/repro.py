"""`launch.py rerun RUN_DIR [key=value ...]`: a recorded run's spec again, as a new run.

    python launch.py rerun RUN_DIR [key=value ...]   the same spec again, as a new run RUN_NAME-rerunN
                                                     (name=... to choose; the same name resumes that run)

What a run dir records about its code, packages and data (RUN_DIR/repro/) is tracking/repro.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import yaml
from omegaconf import OmegaConf

from ..checkpoint.manager import PATH_KEYS, SPEC_CHANGES
from ..finished import last_checkpoint_step
from ..spec.compose import _override_key, spec_to_yaml
from ..spec.errors import ConfigError, Violation
from ..spec.model_dir import ARCH_KEYS
from ..spec.schema import ModelSpec, Resume, RunSpec
from ..tracking.repro import REPRO, data_files, git_state, user_files
from .rundir import load_spec_file


def rerun(args: list[str], single_run: Callable[..., int]) -> int:
    """`launch.py rerun RUN_DIR [key=value ...]`: the run's resolved spec again, as a new run, through the same door
    as a launch (single_run, app.py's: pre-flight, model.path's config.json, plan, execute)."""
    ap = argparse.ArgumentParser(prog="launch.py rerun", description=rerun.__doc__)
    ap.add_argument("run_dir", type=Path, help="a run directory (holding spec.yaml), or a run name under --root")
    ap.add_argument("overrides", nargs="*", help="key=value changes (name=... picks the new run's name)")
    from .cli import default_root  # here: cli imports the status readers, which preflight (our importer) never needs

    ap.add_argument("--root", type=Path, default=default_root(),
                    help="where run dirs live, for a run name (default: $GRPO_OUTPUT_ROOT, else ./outputs)")
    ns = ap.parse_intermixed_args(args)
    named = ns.root / ns.run_dir  # a run name, as eval, export and status take one
    if not (ns.run_dir / "spec.yaml").is_file() and (named / "spec.yaml").is_file():
        ns.run_dir = named
    ns.run_dir = ns.run_dir.resolve()  # before _launch_dir changes the working directory
    spec_file = ns.run_dir / "spec.yaml"
    if not spec_file.is_file():
        print(f"error: {ns.run_dir} is not a run dir (no spec.yaml), nor a run under {ns.root.resolve()} (--root)",
              file=sys.stderr)
        return 2
    incomplete = spec_file_problems(spec_file)
    if incomplete:
        print(ConfigError(incomplete).render(), file=sys.stderr)
        return 2
    ns.overrides = [callers_path(o) for o in ns.overrides]  # before the working directory changes
    work_from_launch_dir(ns.run_dir / REPRO / "git.json")
    _say_code_drift(ns.run_dir / REPRO / "git.json")
    _say_input_drift(ns.run_dir, ns.overrides)
    _say_resumed_changes(ns.run_dir, ns.overrides)
    print(f"grpo-launcher: rerunning {ns.run_dir}", flush=True)
    return single_run(ns.overrides, saved=spec_file)


def spec_file_problems(spec_file: Path) -> list[Violation]:
    """A run's spec.yaml must hold every section a launch writes (name, output_root, model, rollout, ...): one that is
    empty, cut short or not a mapping would rerun the defaults in their place. The missing ones are named."""
    try:
        saved = yaml.safe_load(spec_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = (str(exc).splitlines() or [""])[0]
        return [Violation("rerun_spec_complete", ("spec.yaml",), f"{spec_file} cannot be read: "
                          f"{type(exc).__name__}: {first}"[:300], "rerun a run dir whose spec.yaml a launch wrote")]
    found = saved if isinstance(saved, dict) else {}
    missing = [f.name for f in dataclasses.fields(RunSpec) if f.name not in found]
    if not missing:
        return []
    what = "is empty" if saved is None else "is not a mapping" if not isinstance(saved, dict) else "lacks sections"
    return [Violation("rerun_spec_complete", tuple(missing), f"{spec_file} {what}: missing "
                      f"{', '.join(missing)}; a rerun would put the defaults in their place",
                      "rerun a run dir whose spec.yaml a launch wrote (or launch the config again)")]


def saved_config(spec_file: Path, overrides: list[str]) -> tuple[Any, list[Violation]]:
    """The saved spec (secrets included) + overrides, as a config for pre-flight (launch/preflight.py), with a fresh
    run name unless name= is given. A new model.path drops the saved architecture (model.family, num_layers, ...):
    pre-flight reads it from that directory's config.json, as for a launch."""
    base = load_spec_file(spec_file)
    cfg = OmegaConf.create(spec_to_yaml(base))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        return cfg, [Violation("override_syntax", (b,), f"{b!r} is not key=value", "write key=value") for b in bad]
    keys = [_override_key(o) for o in overrides]
    if "model.path" in keys:
        for field in ("name", *ARCH_KEYS):
            cfg.model[field] = getattr(ModelSpec(), field)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as exc:  # noqa: BLE001
        return cfg, [Violation("composition", ("<overrides>",), str(exc), "fix the override")]
    if "name" not in keys:
        cfg.name = _fresh_name(Path(str(cfg.output_root)), base.name)
    return cfg, []


def callers_path(override: str) -> str:
    """`env.val_path=data/val.jsonl` (a path key: model.path, env.train_path, env.val_path) naming a file or folder
    relative to the caller's directory, as its absolute path: rerun, eval and generate work from the run's launch directory, where
    the same name read another file (an eval: 64 samples of the project's own val set instead of the caller's 8), silently.
    A relative path that is not there stays relative to the launch directory (the spec's own are)."""
    key, eq, value = override.partition("=")
    if eq and key.lstrip("+") in PATH_KEYS and value and not Path(value).is_absolute() and Path(value).exists():
        return f"{key}={Path(value).absolute()}"
    return override


def work_from_launch_dir(git_file: Path) -> None:
    """Work from the directory the run was launched in: its spec's relative paths are relative to it (rerun, and
    eval / generate of a run dir)."""
    try:
        then = json.loads(git_file.read_text()).get("cwd")
    except (OSError, ValueError):
        return
    if then and Path(then).is_dir() and Path(then).resolve() != Path.cwd().resolve():
        os.chdir(then)
        print(f"grpo-launcher: working from {then}, where the run was launched (its spec's relative paths are "
              f"relative to it)", flush=True)


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


def _say_input_drift(run_dir: Path, overrides: list[str]) -> None:
    """The data and reward / Env files the run read at its start against those files now: a rerun reads them as they
    are now, so one changed since is said, with where the run's copy is (was silent: the rerun trained on other data
    or another reward under the run's name). A key given anew on the command line is the user's choice: not said."""
    try:
        spec = load_spec_file(run_dir / "spec.yaml")
    except (OSError, ValueError, ConfigError):
        return
    changed = input_changes(run_dir, spec, {_override_key(o) for o in overrides if "=" in o})
    if changed:
        print("grpo-launcher: warning: files the run read have changed since; this rerun reads them as they are "
              "now:\n" + "\n".join(f"  - {c}" for c in changed), flush=True)


REWARD_KEYS = {"env.reward_fn", "env.reward_fns", "env.name"}


def input_changes(run_dir: Path, spec: RunSpec, skip: set[str]) -> list[str]:
    """What differs between the files `spec` reads now and those the run read at its start (RUN/repro/data.json:
    size, sha256; RUN/repro/user_code/: the reward / Env files), one line each; keys in `skip` are not compared."""
    repro = run_dir / REPRO
    try:
        then = json.loads((repro / "data.json").read_text())
    except (OSError, ValueError):
        return []
    now = data_files(spec)
    changed = [f"{key}: {path} {_drift(info, now.get(key, {}).get(path))}" for key, files in then.items()
               if key not in skip for path, info in files.items() if _drift(info, now.get(key, {}).get(path))]
    changed += [f"{key}: {path} is new since the run" for key, files in now.items() if key in then and key not in skip
                for path in files if path not in then[key]]
    for f in user_files(spec) if not REWARD_KEYS & skip else []:
        copy = repro / "user_code" / f.name
        if copy.is_file() and copy.read_bytes() != f.read_bytes():
            changed.append(f"{f} differs from the run's copy {copy}")
    return changed


def say_resume_input_drift(spec: RunSpec, run_dir: Path) -> None:
    """A launch that resumes a run (checkpoint.resume=auto, the run dir holds a checkpoint) whose data or reward
    files differ from those the run started with (repro/data.json, user_code/): said, file by file, before it runs
    (was silent: the run went on with other data under the same name, and data.json was overwritten). A key that
    now names another file is not compared (the resume says the keys it changed)."""
    step = last_checkpoint_step(run_dir) if spec.checkpoint.resume == Resume.auto else None
    if step is None:
        return
    try:
        then = json.loads((run_dir / REPRO / "data.json").read_text())
    except (OSError, ValueError):
        return
    moved = {key for key, files in then.items() if not _reads_same_path(getattr(spec.env, key[4:], None), files)}
    changed = [c for c in input_changes(run_dir, spec, moved) if not c.endswith(" is gone")]
    changed += _same_value_other_file(run_dir, spec, {k: then[k] for k in moved})
    if changed:
        print(f"grpo-launcher: warning: this launch resumes run '{spec.name}' from step {step}, and files the run read "
              f"at its start have changed since ({run_dir / REPRO}): its next steps read them as they are now:\n"
              + "\n".join(f"  - {c}" for c in changed), flush=True)


def _same_value_other_file(run_dir: Path, spec: RunSpec, moved: dict[str, dict]) -> list[str]:
    """A data key whose value is the run's (spec.yaml) but names another file now: a relative path resumed from
    another directory (the spec records no change, and the run reads another file under the same name). Another
    file of the same bytes is not said."""
    try:
        before = load_spec_file(run_dir / "spec.yaml")
    except (OSError, ValueError, ConfigError):
        return []
    out, now = [], data_files(spec)
    for key, files in moved.items():
        value = getattr(spec.env, key[4:], None)
        same_bytes = sorted(str(i.get("sha256")) for i in files.values()) == \
            sorted(str(i.get("sha256")) for i in now.get(key, {}).values())
        if value and value == getattr(before.env, key[4:], None) and not same_bytes:
            here = Path(str(value)).expanduser().resolve()
            out.append(f"{key}={value} reads {here} from here ({Path.cwd()}); the run read {', '.join(files)}")
    return out


def _reads_same_path(value: Any, files: dict) -> bool:
    """Whether a data key's value now names the file (or directory of files) recorded for it."""
    if not value:
        return False
    path = Path(str(value)).expanduser().resolve()
    return any(Path(f) == path or path in Path(f).parents for f in files)


def _drift(then: dict, now: Any) -> str:
    """How a data file differs from its record ('' when it does not, or when neither has a hash to compare)."""
    if now is None:
        return "is gone"
    if then.get("bytes") != now.get("bytes") or then.get("sha256") != now.get("sha256"):
        return f"changed since the run ({then.get('bytes')} → {now.get('bytes')} bytes, sha256 " \
               f"{str(then.get('sha256'))[:12]} → {str(now.get('sha256'))[:12]})"
    return ""


def _say_resumed_changes(run_dir: Path, overrides: list[str]) -> None:
    """A run resumed with changed keys (RUN/spec_changes.jsonl) ran its first steps under other values than its
    spec.yaml's last ones, which a rerun runs from step 1: said, key by key (grpo.max_steps and logging.* aside)."""
    given = {_override_key(o) for o in overrides if "=" in o}
    history: dict[str, list[tuple[int, Any, Any]]] = {}
    try:
        lines = (run_dir / SPEC_CHANGES).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            entry = json.loads(line)
            for key, change in entry["changes"].items():
                history.setdefault(key, []).append((int(entry["from_step"]), change["old"], change["new"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    said = [f"  - {key}: {hist[0][1]!r} until step {hist[0][0] - 1}, "
            + ", ".join(f"{new!r} from step {step}" for step, _, new in hist)
            for key, hist in history.items() if key not in given and key != "grpo.max_steps"
            and not key.startswith("logging.")]
    if said:
        print(f"grpo-launcher: warning: the run was resumed with changed keys ({run_dir / SPEC_CHANGES}); this rerun "
              "runs their last values from step 1:\n" + "\n".join(said), flush=True)
