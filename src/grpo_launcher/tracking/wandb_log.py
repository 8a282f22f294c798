"""Weights & Biases beside MLflow (logging.wandb=true) through the real `wandb` package: the same metric names
(`train/reward_mean`) and step axis as MLflow, the spec as the run's config (secrets redacted).

Offline unless the environment says otherwise: with neither WANDB_MODE nor WANDB_API_KEY set, the run is written to
RUN_DIR/wandb/offline-run-<time>-<id>/ and needs no network (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it
later); WANDB_MODE (online, offline, disabled) or an API key hand the choice to wandb. The project is WANDB_PROJECT,
else logging.experiment; the entity is wandb's own (WANDB_ENTITY).

One W&B run per run dir: its id is kept in RUN_DIR/wandb/grpo-run-id, so a resume continues the same run (online:
resume="allow"; offline: each start writes one more offline-run directory with the same id). As for TensorBoard,
metrics are buffered until `commit()` (right after a checkpoint is written), and a reopened log reads back which
(key, step) pairs the run's transaction logs (run-<id>.wandb) hold and never logs one twice.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Iterator

from ..checkpoint.manager import spec_as_dict
from ..spec.schema import RunSpec
from .step_buffer import StepBuffer

WANDB_DIR = "wandb"  # under the run dir (wandb.init(dir=RUN_DIR) writes RUN_DIR/wandb/)
RUN_ID_FILE = "grpo-run-id"
# the .wandb transaction log: a 7-byte header (":W&B", magic, version), then leveldb log blocks
# (https://github.com/google/leveldb/blob/main/doc/log_format.md) of protobuf `Record`s
HEADER = b":W&B"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_mode() -> str | None:
    """'offline' unless WANDB_MODE or WANDB_API_KEY is set (then None: wandb reads the environment)."""
    if os.environ.get("WANDB_MODE", "").strip() or os.environ.get("WANDB_API_KEY", "").strip():
        return None
    return "offline"


def _chunks(path: Path) -> Iterator[bytes]:
    """The records of one .wandb file; a torn tail (a crash mid-write) ends the iteration."""
    data = path.read_bytes()
    if data[:4] != HEADER:
        return
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's trailer: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        if kind == 0 or len(body) < length:  # padding to the block's end, or a torn record
            if kind != 0:
                return
            pos += left
            continue
        pos += 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            buf = body
        elif kind == MIDDLE:
            buf += body
        elif kind == LAST:
            yield buf + body


def read_history(wandb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every logged metric in the run directories under wandb_dir (RUN_DIR/wandb): {key: [(step, value), ...]} in
    the order the starts wrote them; wandb's own `_step`, `_runtime`, `_timestamp` left out."""
    from wandb.proto import wandb_internal_pb2 as pb  # here: wandb's import is heavy, for logging.wandb only

    out: dict[str, list[tuple[int, float]]] = {}
    runs = [p for p in sorted(Path(wandb_dir).glob("*run-*")) if p.is_dir() and not p.is_symlink()]
    for path in (f for run in runs for f in sorted(run.glob("run-*.wandb"))):
        for chunk in _chunks(path):
            record = pb.Record.FromString(chunk)  # type: ignore[attr-defined]  # generated protobuf module
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or ".".join(item.nested_key)
                if not key.startswith("_"):
                    out.setdefault(key, []).append((step, float(json.loads(item.value_json))))
    return out


def run_id(wandb_dir: Path) -> str:
    """The run dir's W&B run id: read from RUN_DIR/wandb/grpo-run-id, made and kept there on the first start."""
    path = Path(wandb_dir) / RUN_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex[:8]
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new


def wandb_row(run_dir: Path) -> str:
    """The end-of-run block's W&B row: the upload command of an offline run, else the run id."""
    wandb_dir = Path(run_dir) / WANDB_DIR
    rid = run_id(wandb_dir)
    if wandb_mode() == "offline":
        return f"offline, upload with: wandb sync {wandb_dir}/offline-run-*-{rid}"
    return f"run {rid} (mode and project: WANDB_MODE / WANDB_PROJECT, else logging.experiment)"


class WandbLog(StepBuffer):
    """One run dir's W&B run: buffered metrics, logged on commit one step at a time, never a (key, step) twice."""

    def __init__(self, spec: RunSpec, run_dir: Path) -> None:
        import wandb  # here: heavy, for logging.wandb only

        from .mlflow_tracker import flat_params  # here: it imports mlflow (logging.mlflow=false runs have none)

        self.dir = Path(run_dir) / WANDB_DIR
        self._logged = {(key, step) for key, points in read_history(self.dir).items() for step, _ in points}
        mode = wandb_mode()
        # console off: our stdout stays ours; no system-stats sampler or pip/git metadata (repro/ holds those)
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, save_code=False,
                                  silent=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or spec.logging.experiment, name=spec.name,
                              id=run_id(self.dir), dir=str(run_dir), mode=mode,  # type: ignore[arg-type]
                              resume=None if mode == "offline" else "allow",  # offline: resume is ignored
                              config=flat_params(spec_as_dict(spec)), settings=settings, reinit="create_new")
        StepBuffer.__init__(self)

    def commit(self) -> int:
        """Log the buffered metrics not in the run yet, step by step in step order; returns how many."""
        buffered, self._buffer = self._buffer, []
        steps: dict[int, dict[str, float]] = {}
        for key, value, _wall, step in buffered:
            if (key, step) not in self._logged:
                steps.setdefault(step, {})[key] = value
                self._logged.add((key, step))
        for step in sorted(steps):
            self.run.log(steps[step], step=step)
        return sum(len(m) for m in steps.values())

    def close(self, status: str = "FINISHED") -> None:
        self.commit()
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        self._wait_written()

    def _wait_written(self, timeout_s: float = 30.0) -> None:
        """finish() can return before wandb's writer has every history record in the .wandb file; a resume
        right after (a requeue) reads the file to skip what is logged: wait, bounded, until it is all there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            written = {(k, s) for k, points in read_history(self.dir).items() for s, _ in points}
            if self._logged <= written:
                return
            time.sleep(0.1)
