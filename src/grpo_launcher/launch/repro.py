"""Reproducibility: what a run dir records about the code and packages that ran, and `launch.py rerun`.

    RUN_DIR/spec.yaml                 the resolved spec (written by rundir.prepare)
    RUN_DIR/repro/git.json            commit, branch, dirty flag, untracked files, the command line
    RUN_DIR/repro/uncommitted.diff    `git diff HEAD --binary` of the code that ran (tracked files)
    RUN_DIR/repro/pip-freeze.txt      every installed distribution, `name==version`
    RUN_DIR/repro/user_code/          copies of the user's reward / Env files named in the spec
    RUN_DIR/repro/data.json           the data files: size, mtime, sha256 (files up to 256 MiB)

    python launch.py rerun RUN_DIR [key=value ...]   the same spec again, as a new run RUN_NAME-rerunN
                                                     (name=... to choose; the same name resumes that run)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

REPRO = "repro"
HASH_LIMIT = 256 * 2**20
REPO = Path(__file__).resolve().parents[3]


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> dict:
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain") or ""
    untracked = [line[3:] for line in status.splitlines() if line.startswith("?? ")]
    return {"repo": str(REPO), "commit": commit, "branch": (_git("rev-parse", "--abbrev-ref", "HEAD") or "").strip(),
            "dirty": any(not line.startswith("?? ") for line in status.splitlines()), "untracked": untracked}


def pip_freeze() -> str:
    """`pip freeze`-like, from the installed distributions' metadata (no subprocess, no network)."""
    seen = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            direct = dist.read_text("direct_url.json")
            url = json.loads(direct).get("url") if direct else None
            editable = direct and json.loads(direct).get("dir_info", {}).get("editable")
            seen[name.lower()] = f"-e {url}" if editable else f"{name}=={dist.version}"
    return "\n".join(sorted(seen.values(), key=str.lower)) + "\n"


def user_files(spec) -> list[Path]:
    from ..envs.rewards import reward_refs
    from ..envs.usercode import is_file_ref, is_ref, split_ref

    refs = [ref for _, ref, _ in reward_refs(spec.env)] + ([spec.env.name] if is_ref(spec.env.name) else [])
    out = []
    for ref in refs:
        head, _ = split_ref(ref)
        if is_file_ref(head) and Path(head).expanduser().is_file():
            out.append(Path(head).expanduser().resolve())
        elif not is_file_ref(head):
            mod = sys.modules.get(head)
            if mod is not None and getattr(mod, "__file__", None) and "site-packages" not in mod.__file__:
                out.append(Path(mod.__file__).resolve())
    return sorted(set(out))


def data_files(spec) -> dict:
    out = {}
    for key in ("train_path", "val_path"):
        path = getattr(spec.env, key)
        if not path or not Path(path).expanduser().exists():
            continue
        p = Path(path).expanduser().resolve()
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        out[f"env.{key}"] = {str(f): _file_info(f) for f in files}
    return out


def _file_info(f: Path) -> dict:
    st = f.stat()
    info = {"bytes": st.st_size, "mtime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime))}
    if st.st_size <= HASH_LIMIT:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        info["sha256"] = h.hexdigest()
    return info


def write_repro(spec, run_dir: Path, argv: Optional[list[str]] = None) -> Path:
    """Record the code, packages, user files and data of this launch under RUN_DIR/repro/ (the last launch's;
    earlier launches of a resumed run are listed in repro/launches.jsonl)."""
    from .rundir import write_atomic

    out = Path(run_dir) / REPRO
    out.mkdir(parents=True, exist_ok=True)
    git = git_state()
    git["command"] = list(sys.argv if argv is None else argv)
    git["python"] = sys.version.split()[0]
    git["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_atomic(out / "git.json", json.dumps(git, indent=1) + "\n")
    write_atomic(out / "uncommitted.diff", _git("diff", "HEAD", "--binary") or "")
    write_atomic(out / "pip-freeze.txt", pip_freeze())
    write_atomic(out / "data.json", json.dumps(data_files(spec), indent=1) + "\n")
    code = out / "user_code"
    shutil.rmtree(code, ignore_errors=True)
    for f in user_files(spec):
        code.mkdir(exist_ok=True)
        shutil.copy2(f, code / f.name)
    with open(out / "launches.jsonl", "a") as fh:
        fh.write(json.dumps({k: git[k] for k in ("time", "commit", "dirty", "command")}) + "\n")
    return out


def log_to_mlflow(tracker, run_dir: Path) -> None:
    """The same record on the MLflow run: spec.yaml and repro/ as artifacts, the commit as a tag."""
    if tracker is None:
        return
    try:
        repro = Path(run_dir) / REPRO
        if (Path(run_dir) / "spec.yaml").exists():
            tracker.log_artifact(Path(run_dir) / "spec.yaml")
        if repro.is_dir():
            tracker.log_artifact(repro, REPRO)
            git = json.loads((repro / "git.json").read_text())
            tracker.set_tag("grpo.git_dirty", str(git.get("dirty")))
    except Exception as exc:  # noqa: BLE001 - tracking must not stop a run
        print(f"grpo-launcher: WARNING: repro files not logged to MLflow: {exc}", file=sys.stderr)


# ------------------------------------------------------------------ launch.py rerun RUN_DIR


def rerun(args: list[str]) -> int:
    """`launch.py rerun RUN_DIR [key=value ...]`: the run's resolved spec again, validated, as a new run."""
    import argparse

    ap = argparse.ArgumentParser(prog="launch.py rerun", description=rerun.__doc__)
    ap.add_argument("run_dir", type=Path, help="a run directory (holding spec.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value changes (name=... picks the new run's name)")
    ns = ap.parse_args(args)
    spec_file = ns.run_dir / "spec.yaml"
    if not spec_file.is_file():
        print(f"error: {ns.run_dir} is not a run dir (no spec.yaml)", file=sys.stderr)
        return 2
    from ..plan import make_plan
    from ..spec.errors import ConfigError
    from . import execute

    try:
        spec = rerun_spec(spec_file, ns.overrides)
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        return 2
    _say_code_drift(ns.run_dir / REPRO / "git.json")
    print(f"grpo-launcher: rerunning {ns.run_dir} as '{spec.name}'", flush=True)
    return execute(spec, make_plan(spec))


def rerun_spec(spec_file: Path, overrides: list[str]):
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


def record_launch(spec, plan, state) -> None:
    """After a launch is accepted (never before a refusal): RUN_DIR/repro/, and the same on the MLflow run."""
    try:
        write_repro(spec, plan.run_dir)
    except OSError as exc:
        print(f"grpo-launcher: WARNING: could not record {plan.run_dir / REPRO}: {exc}", file=sys.stderr)
        return
    log_to_mlflow(getattr(state, "tracker", None), plan.run_dir)
