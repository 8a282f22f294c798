"""Disk a run's checkpoints take, from the model's parameter count and dtypes, as the workers save them; and the probe
that refuses a launch whose output_root lacks the room (rule `checkpoint_disk_room` in preflight/budgets.py).

One checkpoint (checkpoint/manager.py layout; what a resume reads back to continue exactly):
    torch     policy/model.safetensors: the fp32 master weights (4 B/param; the worker trains in fp32, bf16 is
              autocast) + optim.pt: AdamW's m and v (8 B/param, fp32)
    megatron  policy/model.safetensors in train.precision (2 or 4 B/param) + megatron_optim_rank*.pt: every rank's
              optimizer (12 B/param with bf16: fp32 master + m + v; 8 with fp32) over the ranks that hold it
              (data-parallel replicas each save theirs); none with train.distributed_optimizer (not saved)
    + the config, generation config and tokenizer files (small_files: ~160 B per vocabulary entry).
Peak on disk: checkpoint.keep_top_k best + the latest are kept, and one more is written before the pruning, so
keep_top_k + 2 checkpoints, or as many as the run saves when fewer (grpo.max_steps / checkpoint.save_period, and
the last step). Only two of them hold the optimizer state (the latest, which a resume reads, and the one being
written): once a newer one is in place an older one keeps its weights alone (checkpoint/manager.py strip_older).
checkpoint.enabled=false saves none. `launch.py export` writes a bf16 copy of the weights on demand.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..spec.errors import Violation
from .memory_shapes import GIB, arch_of, layout_of, param_counts, rank_params
from ..spec.schema import Precision, RunSpec, TrainBackend

TOKENIZER_BYTES_PER_ENTRY = 160  # tokenizer.json (+ vocab/merges): Qwen2.5's 152k entries ~7 MB, Gemma's 256k ~34 MB


@dataclass(frozen=True)
class CheckpointBytes:
    weights: int
    optimizer: int
    small_files: int  # config, generation config, tokenizer, meta.json, manifest.json
    how: str  # the dtypes, in words

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.small_files

    @property
    def weights_only(self) -> int:
        """A kept checkpoint older than the latest: its optimizer state dropped."""
        return self.weights + self.small_files


def checkpoint_bytes(spec: RunSpec) -> CheckpointBytes:
    """The bytes one checkpoint of this spec takes (see the module doc)."""
    a = arch_of(spec)
    pc = param_counts(a)
    n = pc.total(a)
    t = spec.train
    small = 2**20 + TOKENIZER_BYTES_PER_ENTRY * a.vocab
    if t.backend != TrainBackend.megatron:
        return CheckpointBytes(4 * n, 8 * n, small, "fp32 weights + AdamW m, v (fp32)")
    bf16 = t.precision == Precision.bfloat16
    wb, ob = (2, 12) if bf16 else (4, 8)
    if t.distributed_optimizer:
        return CheckpointBytes(wb * n, 0, small, f"{t.precision.value} weights; the distributed optimizer is not saved")
    lay = layout_of(spec)
    dense, experts = rank_params(a, pc, lay)  # the most loaded rank: an upper bound for every rank
    held = int(ob * (dense + experts) * lay.world)
    master = "fp32 master + " if bf16 else ""
    return CheckpointBytes(wb * n, held, small, f"{t.precision.value} weights + every rank's optimizer ({master}Adam m, v)")


def saves(spec: RunSpec) -> int:
    """How many checkpoints a run from step 0 saves: every save_period steps and the last step."""
    c, steps = spec.checkpoint, spec.grpo.max_steps
    if not c.enabled or steps <= 0:
        return 0
    period = max(c.save_period, 1)
    return steps // period + (1 if steps % period else 0)


def peak_checkpoints(spec: RunSpec) -> int:
    return min(saves(spec), max(spec.checkpoint.keep_top_k, 0) + 2)


def peak_full(spec: RunSpec) -> int:
    """How many checkpoints at the peak hold their optimizer state: the latest and the one being written."""
    return min(peak_checkpoints(spec), 2)


def peak_bytes(spec: RunSpec) -> int:
    """Two full checkpoints (the latest + the one being written) + the other kept ones' weights."""
    if not spec.checkpoint.enabled:
        return 0
    cb, n, full = checkpoint_bytes(spec), peak_checkpoints(spec), peak_full(spec)
    return full * cb.total + (n - full) * cb.weights_only


def peak_text(spec: RunSpec) -> str:
    """'N × full + M × weights-only (...)': how the peak adds up, naming the keys."""
    c, cb, n, full = spec.checkpoint, checkpoint_bytes(spec), peak_checkpoints(spec), peak_full(spec)
    parts = f"{full} × {size(cb.total)} (the latest + one being written, with optimizer state)" if full == 2 else \
        f"1 × {size(cb.total)} (the one being written, with optimizer state)"
    if n > full:
        parts += f" + {n - full} × {size(cb.weights_only)} (weights only: the older kept ones)"
    return f"{parts}; checkpoint.keep_top_k={c.keep_top_k}, {saves(spec)} saved at checkpoint.save_period={c.save_period}"


def existing_root(path: Path) -> Optional[Path]:
    """`path`, or its nearest existing parent (the directory whose file system the run will write to)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return None


def on_disk(path: Path) -> int:
    """Bytes of the regular files below `path` (the checkpoints a resumed run already holds)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.is_dir() else 0


def room(spec: RunSpec) -> tuple[int, int, Optional[Path]]:
    """(bytes the run still needs at its peak, bytes free there, where): checkpoints already in the run dir count as
    written (they are pruned as new ones land)."""
    run_dir = Path(spec.output_root).resolve() / spec.name
    where = existing_root(run_dir)
    if where is None:
        return 0, 0, None
    try:
        free = shutil.disk_usage(where).free
        need = max(peak_bytes(spec) - on_disk(run_dir / "checkpoints"), 0)
    except OSError:  # a file system that will not say (output_root_writable names an unusable one)
        return 0, 0, None
    return need, free, where


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def report(spec: RunSpec) -> str:
    """The plan's disk line: one checkpoint, the peak, and the room under output_root."""
    head = "checkpoints on disk  : "
    if not spec.checkpoint.enabled:
        return head + "none (checkpoint.enabled=false: nothing to resume from after a stop)"
    cb = checkpoint_bytes(spec)
    need, free, where = room(spec)
    free_text = f"; {size(free)} free at {where}" if where is not None else ""
    return (head + f"{size(cb.total)} each ({cb.how}: weights {size(cb.weights)}, optimizer {size(cb.optimizer)}; "
            f"older kept ones {size(cb.weights_only)}, weights only); peak {size(peak_bytes(spec))} = {peak_text(spec)}"
            + free_text)


def room_violations(s: RunSpec) -> Iterator[Violation]:
    """output_root must hold the run's peak of checkpoints (kept + one being written) with what is there now."""
    if not s.checkpoint.enabled:
        return
    need, free, where = room(s)
    if where is None or need <= free:
        return
    cb = checkpoint_bytes(s)
    yield Violation("checkpoint_disk_room", ("checkpoint.keep_top_k", "checkpoint.save_period", "output_root"),
                    f"the run's checkpoints need {size(need)} more at their peak ({peak_text(s)}; {cb.how}) and "
                    f"{where} has {size(free)} free",
                    f"lower checkpoint.keep_top_k (each older kept one is {size(cb.weights_only)}), point "
                    "output_root at a disk with the room, or set checkpoint.enabled=false (no resume after a stop)")
