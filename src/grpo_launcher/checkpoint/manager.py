"""Atomic, verified, pruned checkpoints with a resume guard.

Layout under `ckpt_dir`:
    step_000010/            a complete checkpoint (caller's files + meta.json + manifest.json)
    .tmp-step_000020-<pid>/ one being written; renamed to step_000020 only once complete
    .invalid-step_000030-*/ one that failed verification on resume (kept for inspection, never loaded)
Save order (each phase boundary is a named fault point, see `fault_point`): payload → meta.json (with the
MLflow metrics not yet committed: `pending_metrics`) → manifest.json LAST (size + sha256 of every file)
→ fsync → rename into place → prune → unlist → strip. The caller commits the metrics to MLflow after the rename;
a crash in between is repaired on resume by replaying `pending_metrics` (the tracker skips (key, step) pairs
MLflow already holds), so the step axis has every step exactly once.
Optimizer state only where a resume needs it: a resume reads the newest checkpoint's (`optim.pt`,
`megatron_optim_rank*.pt`: AdamW's m and v, and megatron's fp32 master weights), so once a newer checkpoint is in
place the older kept ones lose theirs. "unlist": each older manifest is replaced atomically (temp file beside the
checkpoints, fsync, rename) by one that moves those files from `files` to `dropped` ("optimizer": false); "strip":
the files are deleted. A dropped file may be there or not (nothing else may differ), so a crash at any point leaves
every checkpoint verifying; a resume from one finishes its strip first, and the workers start a fresh optimizer.
Resume (`resume_point`) verifies the newest checkpoint against its manifest (sizes, hashes, meta.json
readable and naming its own step, every `*.pt` loadable with `torch.load(weights_only=True)`: a pickle
that would run code is refused, not loaded), falls back to the newest valid one with a message naming
what was wrong, and refuses a checkpoint beyond `grpo.max_steps`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from ..secrets import REDACTED, is_secret_key, redact_value, redacted_tree
from ..spec.schema import RunSpec

META = "meta.json"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"
INVALID_PREFIX = ".invalid-"
FAULT_ENV = "GRPO_FAULT_AT"  # tests: SIGKILL this process at the named phase boundary (see fault_point)
SAVE_PHASES = ("payload", "meta", "manifest", "fsync", "rename", "prune", "unlist", "strip")
# The optimizer state files the policy workers write (policy/torch_policy.py, policy/megatron_policy.py save()).
OPTIMIZER_FILE = re.compile(r"optim\.pt|megatron_optim_rank\d+\.pt")
# Spec fields a resumed run must share with the checkpoint (a trailing "." = the whole section).
COMPAT_KEYS = (
    "model.",
    "train.backend",
    "train.precision",
    "train.tensor_parallel_size",
    "train.pipeline_parallel_size",
    "train.context_parallel_size",
    "train.expert_parallel_size",
    "grpo.num_generations_per_prompt",
    "grpo.seed",  # the data's shuffle order per epoch and the default run's tiny model (the KL reference) derive from it
    "env.name",
)
MISSING = "<missing>"
# Keys that say where and how a run is launched, not what it trains: not a spec change on resume.
NOT_A_CHANGE = ("name", "output_root", "dry_run", "checkpoint.resume")
SPEC_CHANGES = "spec_changes.jsonl"  # RUN_DIR/: one line per resume that changed a key


class IncompatibleCheckpoint(Exception):
    """The checkpoint was written under a spec whose model/parallelism/env differs from this one."""


class CheckpointRefused(Exception):
    """No checkpoint can be resumed from as asked (e.g. its step is beyond grpo.max_steps)."""


def fault_point(name: str) -> None:
    """Die here, as a kill -9 would, when GRPO_FAULT_AT names this point (crash-order tests only).

    `GRPO_FAULT_AT=after:<phase>` kills on every save; `after:<phase>@<step>` only when saving <step>."""
    want = os.environ.get(FAULT_ENV)
    if want and want in (name, name.split("@")[0]):
        os.kill(os.getpid(), signal.SIGKILL)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def payload_files(root: Path) -> list[Path]:
    """Every regular file below `root` but the manifest, as paths relative to root (sorted)."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = Path(dirpath, name).relative_to(root)
            if rel.as_posix() != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(root: Path) -> dict:
    files = {rel.as_posix(): {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
             for rel in payload_files(root)}
    manifest = {"version": 1, "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def pickle_is_safe(path: Path) -> Optional[str]:
    """None when a torch file loads with weights_only=True (tensors and plain containers only), else why not."""
    import torch  # here: pre-flight and launch.py status import this module without torch

    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 — any refusal means: not loaded
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        why = next((ln for ln in lines if "Unsupported" in ln or "global" in ln.lower()), lines[0])
        return f"{path.name} is not plain tensor state (torch.load(weights_only=True) refused it: {why[:200]})"
    return None


def is_torch_pickle(path: Path) -> bool:
    """*.pt / *.pth, or a *.bin holding a torch zip archive or a raw pickle (HF's pytorch_model.bin)."""
    if path.suffix in (".pt", ".pth"):
        return True
    if path.suffix != ".bin":
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def verify_checkpoint(path: Path, only: str = "") -> Optional[str]:
    """None when the checkpoint dir is complete and intact, else what is wrong (one line, names the file).
    `only` (e.g. "policy/"): the files below that prefix alone are checked (export reads nothing else)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        return f"{MANIFEST} is missing (the save did not finish, or an older version wrote it)"
    try:
        manifest = json.loads(mpath.read_text())
        files = {rel: want for rel, want in manifest["files"].items() if rel.startswith(only)}
        dropped = {rel: want for rel, want in manifest.get("dropped", {}).items() if rel.startswith(only)}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    problem = files_problem(path, files, only, dropped)
    if problem:
        return problem
    try:
        meta = json.loads((path / META).read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{META} is unreadable ({type(exc).__name__}: {exc})"
    if step != step_of(path):
        return f"{META} says step {meta.get('step')!r} but the directory is {path.name}"
    for rel in sorted(files):
        if is_torch_pickle(path / rel):
            why = pickle_is_safe(path / rel)
            if why:
                return why
    return None


def files_problem(path: Path, files: dict[str, Any], only: str = "",
                  dropped: Optional[dict[str, Any]] = None) -> Optional[str]:
    """The manifest's files below `only` against the disk: each a regular file (no symlink) of its size and sha256,
    and no file (or symlink) there that the manifest lacks. A `dropped` file (optimizer state being stripped) may
    be absent; if there, it is the regular file of its size (its strip was cut short)."""
    for rel, want in sorted((dropped or {}).items()):
        f = path / rel
        if f.is_symlink() or (f.exists() and (not f.is_file() or f.stat().st_size != want.get("size"))):
            return f"{rel} was dropped from the manifest, but another file is there in its place"
    for rel, want in sorted(files.items()):
        f = path / rel
        if f.is_symlink():
            return f"{rel} is a symlink (to {os.readlink(f)}), not the file the manifest lists"
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"{rel} has {size} bytes, the manifest says {want.get('size')} (truncated or overwritten)"
        if sha256_file(f) != want.get("sha256"):
            return f"{rel} does not match its sha256 in the manifest (corrupted or modified)"
    linked_dirs = [Path(d, n).relative_to(path) for d, dirs, _ in os.walk(path) for n in dirs if Path(d, n).is_symlink()]
    extra = [r.as_posix() for r in [*payload_files(path), *linked_dirs]
             if r.as_posix().startswith(only) and r.as_posix() not in files and r.as_posix() not in (dropped or {})]
    if extra:
        return f"files not in the manifest: {', '.join(extra[:5])}"
    return None


def disk_full_message(path: Path, exc: BaseException) -> Optional[str]:
    """'no space left on device at PATH (N MiB free)' when `exc` (or the disk) says so, else None."""
    text = f"{exc!r} {exc}"
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in text \
        or (("iostream error" in text or "unexpected pos" in text or "PytorchStreamWriter" in text)
            and free is not None and free < 256 * 2**20)
    if not full:
        return None
    where = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    return f"no space left on device writing the checkpoint at {path} ({where}); free space there and resume"


def spec_as_dict(spec: RunSpec) -> dict[str, Any]:
    """The spec as plain JSON-able containers (enums as their string values)."""
    tree = OmegaConf.to_container(OmegaConf.structured(spec), resolve=True, enum_to_str=True)
    assert isinstance(tree, dict)
    return tree


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict → {dotted.key: leaf}; lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def compat_fingerprint(spec: RunSpec) -> dict[str, Any]:
    """The spec fields that must match on resume, as {dotted.key: value}."""
    def wanted(key: str) -> bool:
        return any(key == c or (c.endswith(".") and key.startswith(c)) for c in COMPAT_KEYS)

    return {k: v for k, v in flatten(spec_as_dict(spec)).items() if wanted(k)}


PATH_KEYS = ("model.path", "env.train_path", "env.val_path")  # one folder or file, however it is spelled


def same_value(key: str, before: Any, after: Any) -> bool:
    """A key's old and new values mean the same: equal, or (a path key) the same path once normalised (`my-model`,
    `my-model/`, `./my-model` and its absolute form from this directory; a hub id stays as written)."""
    if before == after:
        return True
    if key not in PATH_KEYS or not isinstance(before, str) or not isinstance(after, str):
        return False
    def norm(p: str) -> str:
        path = Path(p).expanduser()
        return str(path.resolve()) if path.exists() else os.path.normpath(p)
    return norm(before) == norm(after)


def compat_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old → new' for every key whose value differs (a key absent on one side counts)."""
    out = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, MISSING), new.get(key, MISSING)
        if not same_value(key, before, after):
            out.append(f"{key}: {before!r} → {after!r}")
    return out


def incompatibilities(meta: dict[str, Any], spec: RunSpec) -> list[str]:
    """'key: old → new' for every compat key where a checkpoint's meta.json and this spec differ."""
    new = compat_fingerprint(spec)
    # a key the checkpoint's fingerprint lacks (written before fingerprints, or before the key was one): its stored spec's
    stored = {k: v for k, v in flatten(meta.get("spec", {})).items() if k in new}
    return compat_diff({**stored, **(meta.get("compat") or {})}, new)


def spec_changes(meta: dict[str, Any], spec: RunSpec) -> dict[str, tuple[Any, Any]]:
    """{dotted.key: (checkpoint's value, this spec's)} for every key a resume changes (compat keys are refused
    before this: what is left may change mid-run and is applied from the next step)."""
    old, new = flatten(meta.get("spec", {})), flatten(redacted_tree(spec_as_dict(spec)))  # meta.json's is redacted
    out = {}
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, MISSING), new.get(key, MISSING)
        if REDACTED in (before, after) or is_secret_key(key):
            continue  # a credential (kept redacted) may change between launches
        if not same_value(key, before, after) and key not in NOT_A_CHANGE:
            out[key] = ("***", "***") if is_secret_key(key) else (redact_value(before), redact_value(after))
    return out


def record_spec_changes(run_dir: Path, meta: dict[str, Any], spec: RunSpec,
                        say: Callable[[str], None] = print) -> dict[str, tuple[Any, Any]]:
    """A resume under a changed spec: one line in RUN_DIR/spec_changes.jsonl and a message; the changes are
    returned for MLflow (Tracker.log_spec_changes)."""
    changes = spec_changes(meta, spec)
    if not changes:
        return changes
    step = int(meta["step"]) + 1
    line = {"from_step": step, "checkpoint": f"step_{int(meta['step']):06d}", "time": time.time(),
            "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()}}
    with open(Path(run_dir) / SPEC_CHANGES, "a") as fh:
        fh.write(json.dumps(line, default=str) + "\n")
    text = ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changes.items())
    say(f"grpo-launcher: resumed with changed keys, applied from step {step} (recorded in {SPEC_CHANGES}): {text}")
    return changes


def step_of(path: Path) -> int | None:
    """The step of a `step_NNNNNN` dir name, else None."""
    m = STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def fsync_tree(root: Path) -> None:
    """fsync every file below `root`, then every directory (deepest first), then `root`."""
    dirs = []
    for dirpath, _, files in os.walk(root):
        dirs.append(dirpath)
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(Path(d))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path) -> Optional[dict[str, Any]]:
    """A checkpoint dir's manifest.json, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def has_optimizer(path: Path) -> bool:
    """Whether the checkpoint's manifest lists optimizer state (a resume from it continues the optimizer exactly)."""
    manifest = read_manifest(path)
    return manifest is not None and any(OPTIMIZER_FILE.fullmatch(rel) for rel in manifest["files"])


def unlist_optimizer(path: Path, newer: str) -> bool:
    """Replace the manifest, atomically, by one that lists the optimizer files under `dropped` (the files stay until
    `strip_dropped`). True when it changed. The temp file is written beside the checkpoints (`.tmp-*`, cleaned by
    the next save), never inside one: a file the manifest lacks would make it fail verification."""
    manifest = read_manifest(path)
    if manifest is None:  # unreadable: left as it is (a resume names it)
        return False
    gone = {rel: want for rel, want in manifest["files"].items() if OPTIMIZER_FILE.fullmatch(rel)}
    if not gone:
        return False
    new = {**manifest, "files": {rel: w for rel, w in manifest["files"].items() if rel not in gone},
           "dropped": {**manifest.get("dropped", {}), **gone}, "optimizer": False,
           "optimizer_dropped": f"{newer} holds the optimizer state a resume reads; this one keeps its weights"}
    tmp = path.parent / f"{TMP_PREFIX}{MANIFEST}-{path.name}-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(new, indent=1, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MANIFEST)
    fsync_dir(path)
    return True


def strip_dropped(path: Path) -> int:
    """Delete the files the manifest lists as dropped (those still there); the bytes freed."""
    manifest = read_manifest(path)
    freed = 0
    for rel in (manifest or {}).get("dropped", {}):
        f = path / rel
        if f.is_file() and not f.is_symlink():
            freed += f.stat().st_size
            f.unlink()
    if freed:
        fsync_dir(path)
    return freed


def load_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a checkpoint dir."""
    return json.loads((Path(path) / META).read_text())


class CheckpointManager:
    """Save / find / prune / guard the checkpoints of one run."""

    def __init__(self, ckpt_dir: Path, spec: RunSpec) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.spec = spec
        self.keep_top_k = spec.checkpoint.keep_top_k
        self.metric = spec.checkpoint.metric
        self.higher_is_better = spec.checkpoint.higher_is_better
        self._said_disabled = False

    load_meta = staticmethod(load_meta)

    # ------------------------------------------------------------------ listing --
    def complete(self) -> list[Path]:
        """Checkpoints that look complete (step_* dirs holding meta.json or manifest.json), by ascending step.
        `resume_point` verifies them; this listing does not."""
        if not self.ckpt_dir.is_dir():
            return []
        found = [p for p in self.ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None
                 and ((p / META).is_file() or (p / MANIFEST).is_file())]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step."""
        done = self.complete()
        return done[-1] if done else None

    def ranked(self) -> list[Path]:
        """Complete checkpoints, best first by `checkpoint.metric`; those lacking it last; ties → newer first."""
        sign = 1.0 if self.higher_is_better else -1.0

        def key(path: Path) -> tuple[int, float, int]:
            try:
                value = load_meta(path).get("metrics", {}).get(self.metric)
            except (OSError, ValueError, AttributeError):  # unreadable meta: ranked last, never pruned first
                value = None
            if value is None or value != value:  # missing or NaN
                return (1, 0.0, -(step_of(path) or 0))
            return (0, -sign * float(value), -(step_of(path) or 0))

        return sorted(self.complete(), key=key)

    def best(self) -> Path | None:
        """The best checkpoint by `checkpoint.metric`; None when no checkpoint has that metric."""
        ranked = self.ranked()
        try:
            if not ranked or self.metric not in load_meta(ranked[0]).get("metrics", {}):
                return None
        except (OSError, ValueError, AttributeError):
            return None
        return ranked[0]

    # ------------------------------------------------------------------- saving --
    def save(self, step: int, write_fn: Callable[[Path], None], state: dict, metrics: dict[str, float],
             pending_metrics: Optional[list] = None) -> Optional[Path]:
        """write_fn(tmp_dir) writes the payload; meta.json, then manifest.json last; rename into place; prune.

        `pending_metrics` ([key, value, timestamp_ms, step] not yet in MLflow) are kept in meta.json so that
        a crash between this rename and the caller's MLflow commit is replayed on resume.
        checkpoint.enabled=false: nothing is written, not even the last step's (None; said once)."""
        if not self.spec.checkpoint.enabled:
            if not self._said_disabled:
                print(f"grpo-launcher: checkpoint.enabled=false: no checkpoint of step {step} (nor any later one) is "
                      "written; a stopped run starts over", flush=True)
                self._said_disabled = True
            return None
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.remove_stale_tmp()
        final = self.ckpt_dir / f"step_{step:06d}"
        tmp = self.ckpt_dir / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            write_fn(tmp)
            fault_point(f"after:payload@{step}")
            self.write_meta(tmp, step, state, metrics, pending_metrics)
            fault_point(f"after:meta@{step}")
            write_manifest(tmp)
            fault_point(f"after:manifest@{step}")
            fsync_tree(tmp)
            fault_point(f"after:fsync@{step}")
            self.move_into_place(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            full = disk_full_message(self.ckpt_dir, exc)
            if full:
                raise OSError(errno.ENOSPC, full) from exc
            raise
        fault_point(f"after:rename@{step}")
        self.prune()
        fault_point(f"after:prune@{step}")
        self.strip_older(final, step)
        return final

    def strip_older(self, newest: Path, step: int) -> None:
        """The kept checkpoints older than `newest` lose their optimizer state: every manifest first, then the
        files (module doc: a crash at any point leaves each one verifying)."""
        older = [p for p in self.complete() if (step_of(p) or 0) < step]
        for p in older:
            unlist_optimizer(p, newest.name)
        fault_point(f"after:unlist@{step}")
        for p in older:
            strip_dropped(p)
        fault_point(f"after:strip@{step}")

    def write_meta(self, tmp: Path, step: int, state: dict, metrics: dict[str, float],
                   pending_metrics: Optional[list] = None) -> None:
        meta = {
            "step": step,
            "state": state,
            "metrics": {k: float(v) for k, v in metrics.items()},
            "pending_metrics": [list(m) for m in (pending_metrics or [])],
            "spec": redacted_tree(spec_as_dict(self.spec)),  # a credential stays in .secrets.json (0600) only
            "compat": compat_fingerprint(self.spec),
            "run": {"name": self.spec.name, "run_dir": str(self.ckpt_dir.parent.resolve())},  # whose MLflow run
            "saved_at": time.time(),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))

    def move_into_place(self, tmp: Path, final: Path) -> None:
        """Rename tmp → final; an existing final (a step saved again after resume) is swapped out first."""
        old = None
        if final.exists():
            old = final.with_name(f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.ckpt_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def remove_stale_tmp(self) -> None:
        """Drop `.tmp-*` dirs left by crashed saves (one writer per run, so none is live here)."""
        for p in self.ckpt_dir.glob(f"{TMP_PREFIX}*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:  # a manifest's temp file (unlist_optimizer)
                p.unlink(missing_ok=True)

    def prune(self) -> list[Path]:
        """Keep the `keep_top_k` best and the latest; remove the rest. Returns what was removed."""
        keep = set(self.ranked()[: max(self.keep_top_k, 0)])
        latest = self.latest()
        if latest is not None:
            keep.add(latest)
        removed = [p for p in self.complete() if p not in keep]
        for p in removed:
            shutil.rmtree(p)
        return removed

    # ------------------------------------------------------------------- resume --
    def resume_point(self, max_steps: Optional[int] = None, say: Callable[[str], None] = print) -> Optional[Path]:
        """The newest checkpoint that verifies (None: start fresh). Invalid newer ones are moved aside to
        `.invalid-<name>-<time>` with a message naming what was wrong; a valid one beyond `max_steps`
        raises CheckpointRefused (raise grpo.max_steps, or start fresh)."""
        for path in reversed(self.complete()):
            problem = verify_checkpoint(path)
            if problem is None:
                step = step_of(path) or 0
                if max_steps is not None and step > max_steps:
                    raise CheckpointRefused(
                        f"checkpoint {path} is at step {step}, beyond grpo.max_steps={max_steps}: "
                        f"raise grpo.max_steps to continue it, or start over with checkpoint.resume=fresh")
                strip_dropped(path)  # a strip cut short: the workers read optimizer files only where listed
                return path
            dest = self.ckpt_dir / f"{INVALID_PREFIX}{path.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            os.replace(path, dest)
            say(f"grpo-launcher: WARNING: checkpoint {path} is not usable: {problem}; moved aside to {dest.name}, "
                f"falling back to the previous checkpoint")
        return None

    def check_compatible(self, path: Path) -> None:
        """Raise IncompatibleCheckpoint listing every differing compat key (old → new)."""
        diffs = incompatibilities(load_meta(path), self.spec)
        if diffs:
            lines = "\n".join(f"  {d}" for d in diffs)
            raise IncompatibleCheckpoint(
                f"checkpoint {path} was written by an incompatible spec (checkpoint → this run):\n{lines}\n"
                f"start fresh with checkpoint.resume=fresh, or pick another name= for this run"
            )

    def start_fresh(self) -> Path | None:
        """Move a non-empty ckpt_dir aside to `<ckpt_dir>.old-<YYYYmmdd-HHMMSS>` (never deleted)."""
        if not self.ckpt_dir.is_dir() or not any(self.ckpt_dir.iterdir()):
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.ckpt_dir.with_name(f"{self.ckpt_dir.name}.old-{stamp}")
        n = 1
        while dest.exists():
            dest = self.ckpt_dir.with_name(f"{self.ckpt_dir.name}.old-{stamp}-{n}")
            n += 1
        os.replace(self.ckpt_dir, dest)
        return dest
