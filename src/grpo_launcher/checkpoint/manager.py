"""Atomic, pruned checkpoints with a resume guard.

Layout under `ckpt_dir`:
    step_000010/            a complete checkpoint (caller's files + meta.json)
    .tmp-step_000020-<pid>/ one being written; renamed to step_000020 only once complete
A crash never leaves a half checkpoint under a `step_*` name: meta.json is written last, every file is
fsync'd, then the directory is renamed. Stale `.tmp-*` dirs are ignored by `latest` and removed by `save`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..spec.schema import RunSpec

META = "meta.json"
STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"
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
    "env.name",
)
MISSING = "<missing>"


class IncompatibleCheckpoint(Exception):
    """The checkpoint was written under a spec whose model/parallelism/env differs from this one."""


def spec_as_dict(spec: RunSpec) -> dict[str, Any]:
    """The spec as plain JSON-able containers (enums as their string values)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.structured(spec), resolve=True, enum_to_str=True)
    assert isinstance(tree, dict)
    return tree  # type: ignore[return-value]


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


def compat_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old → new' for every key whose value differs (a key absent on one side counts)."""
    out = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, MISSING), new.get(key, MISSING)
        if before != after:
            out.append(f"{key}: {before!r} → {after!r}")
    return out


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

    load_meta = staticmethod(load_meta)

    # ------------------------------------------------------------------ listing --
    def complete(self) -> list[Path]:
        """Complete checkpoints (step_* dirs holding meta.json), by ascending step."""
        if not self.ckpt_dir.is_dir():
            return []
        found = [p for p in self.ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None and (p / META).is_file()]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step."""
        done = self.complete()
        return done[-1] if done else None

    def ranked(self) -> list[Path]:
        """Complete checkpoints, best first by `checkpoint.metric`; those lacking it last; ties → newer first."""
        sign = 1.0 if self.higher_is_better else -1.0

        def key(path: Path) -> tuple[int, float, int]:
            value = load_meta(path).get("metrics", {}).get(self.metric)
            if value is None or value != value:  # missing or NaN
                return (1, 0.0, -(step_of(path) or 0))
            return (0, -sign * float(value), -(step_of(path) or 0))

        return sorted(self.complete(), key=key)

    def best(self) -> Path | None:
        """The best checkpoint by `checkpoint.metric`; None when no checkpoint has that metric."""
        ranked = self.ranked()
        if not ranked or self.metric not in load_meta(ranked[0]).get("metrics", {}):
            return None
        return ranked[0]

    # ------------------------------------------------------------------- saving --
    def save(self, step: int, write_fn: Callable[[Path], None], state: dict, metrics: dict[str, float]) -> Path:
        """write_fn(tmp_dir) writes the payload; meta.json goes last; then rename into place and prune."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.remove_stale_tmp()
        final = self.ckpt_dir / f"step_{step:06d}"
        tmp = self.ckpt_dir / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            write_fn(tmp)
            self.write_meta(tmp, step, state, metrics)
            fsync_tree(tmp)
            self.move_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def write_meta(self, tmp: Path, step: int, state: dict, metrics: dict[str, float]) -> None:
        meta = {
            "step": step,
            "state": state,
            "metrics": {k: float(v) for k, v in metrics.items()},
            "spec": spec_as_dict(self.spec),
            "compat": compat_fingerprint(self.spec),
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
            shutil.rmtree(p, ignore_errors=True)

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
    def check_compatible(self, path: Path) -> None:
        """Raise IncompatibleCheckpoint listing every differing compat key (old → new)."""
        meta = load_meta(path)
        old = meta.get("compat")
        if old is None:  # written before fingerprints existed: derive from the stored spec
            old = {k: v for k, v in flatten(meta.get("spec", {})).items() if k in compat_fingerprint(self.spec)}
        diffs = compat_diff(old, compat_fingerprint(self.spec))
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
