"""Reproducibility: what a run dir records about the code, packages, user files and data of a launch.

    RUN_DIR/spec.yaml                 the resolved spec (written by launch/rundir.prepare)
    RUN_DIR/repro/git.json            commit, branch, dirty flag, untracked files, the command line
    RUN_DIR/repro/uncommitted.diff    `git diff HEAD --binary` of the code that ran (tracked files)
    RUN_DIR/repro/pip-freeze.txt      every installed distribution, `name==version`
    RUN_DIR/repro/user_code/          copies of the user's reward / Env files named in the spec
    RUN_DIR/repro/data.json           the data files: size, mtime, sha256 (files up to 256 MiB)
    RUN_DIR/repro/launches.jsonl      one line per launch: time, commit, command, and its data files (as data.json)

data.json and user_code/ are the run's start's (the launch that began at step 1): a resume keeps them (it overwrote
them: a resume on edited data left no record of what the first steps read), and its own data files are in its line
of launches.jsonl. launch.py rerun and a resume compare the files against them (launch/repro.py input_changes).

The driver records it once a launch is accepted (`record_launch`), on the MLflow run too; `launch.py rerun
RUN_DIR` (launch/repro.py) reads it back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..envs.rewards import reward_refs
from ..envs.usercode import is_file_ref, is_ref, split_ref
from ..runfiles import write_atomic
from ..secrets import redact_argv
from ..spec.schema import validation_on

if TYPE_CHECKING:
    from ..plan import Plan
    from ..spec.schema import RunSpec

REPRO = "repro"
HASH_LIMIT = 256 * 2**20
REPO = Path(__file__).resolve().parents[3]


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> dict[str, Any]:
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain") or ""
    untracked = [line[3:] for line in status.splitlines() if line.startswith("?? ")]
    return {"repo": str(REPO), "commit": commit, "branch": (_git("rev-parse", "--abbrev-ref", "HEAD") or "").strip(),
            "dirty": any(not line.startswith("?? ") for line in status.splitlines()), "untracked": untracked}


def pip_freeze() -> str:
    """`pip freeze`-like, from the installed distributions' metadata (no subprocess, no network)."""
    seen: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            direct = dist.read_text("direct_url.json")
            url = json.loads(direct).get("url") if direct else None
            editable = direct and json.loads(direct).get("dir_info", {}).get("editable")
            seen[name.lower()] = f"-e {url}" if editable else f"{name}=={dist.version}"
    return "\n".join(sorted(seen.values(), key=str.lower)) + "\n"


def user_files(spec: RunSpec) -> list[Path]:
    refs = [ref for _, ref, _ in reward_refs(spec.env)] + ([spec.env.name] if is_ref(spec.env.name) else [])
    out = []
    for ref in refs:
        head, _ = split_ref(ref)
        if is_file_ref(head) and Path(head).expanduser().is_file():
            out.append(Path(head).expanduser().resolve())
        elif not is_file_ref(head):
            mod = sys.modules.get(head)
            file = getattr(mod, "__file__", None) if mod is not None else None
            if file and "site-packages" not in file:
                out.append(Path(file).resolve())
    return sorted(set(out))


def data_files(spec: RunSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("train_path", "val_path") if validation_on(spec.grpo) else ("train_path",):  # val: if validating
        path = getattr(spec.env, key)
        if not path or not Path(path).expanduser().exists():
            continue
        p = Path(path).expanduser().resolve()
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        out[f"env.{key}"] = {str(f): _file_info(f) for f in files}
    return out


def _file_info(f: Path) -> dict[str, Any]:
    st = f.stat()
    info: dict[str, Any] = {"bytes": st.st_size, "mtime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime))}
    if st.st_size <= HASH_LIMIT:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        info["sha256"] = h.hexdigest()
    return info


def write_repro(spec: RunSpec, run_dir: Path, argv: Optional[list[str]] = None, resumed: bool = False) -> Path:
    """Record the code, packages, user files and data of this launch under RUN_DIR/repro/ (code and packages: the last
    launch's; data.json and user_code/: the start's, kept by a resume; every launch is a line of launches.jsonl)."""
    out = Path(run_dir) / REPRO
    out.mkdir(parents=True, exist_ok=True)
    git = git_state()
    git["command"] = redact_argv(list(sys.argv if argv is None else argv))  # a credential: RUN_DIR/.secrets.json
    git["cwd"] = os.getcwd()  # the spec's relative paths (output_root, model.path, data, reward files) are from here
    git["python"] = sys.version.split()[0]
    git["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_atomic(out / "git.json", json.dumps(git, indent=1) + "\n")
    write_atomic(out / "uncommitted.diff", _git("diff", "HEAD", "--binary") or "")
    write_atomic(out / "pip-freeze.txt", pip_freeze())
    data = data_files(spec)
    if not (resumed and (out / "data.json").is_file()):
        write_atomic(out / "data.json", json.dumps(data, indent=1) + "\n")
    code = out / "user_code"
    if not resumed:
        shutil.rmtree(code, ignore_errors=True)
    for f in user_files(spec):
        code.mkdir(exist_ok=True)
        if not (code / f.name).exists():  # a resume keeps the start's copy
            shutil.copy2(f, code / f.name)
    with open(out / "launches.jsonl", "a") as fh:
        fh.write(json.dumps({**{k: git[k] for k in ("time", "commit", "dirty", "command")}, "resumed": resumed,
                             "data": data}) + "\n")
    return out


def log_to_mlflow(tracker: Any, run_dir: Path) -> None:
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


def record_launch(spec: RunSpec, plan: Plan, state: Any) -> None:
    """After a launch is accepted (never before a refusal): RUN_DIR/repro/, and the same on the MLflow run."""
    try:
        write_repro(spec, plan.run_dir, resumed=getattr(state, "checkpoint_path", None) is not None)
    except OSError as exc:
        print(f"grpo-launcher: WARNING: could not record {plan.run_dir / REPRO}: {exc}", file=sys.stderr)
        return
    log_to_mlflow(getattr(state, "tracker", None), plan.run_dir)
