"""The per-step training-data log: `train_data_step_NNNNNN.jsonl`, one JSON line per sample.

Every record says which weights generated it (the same fields in the sync and the async loop): the policy
version v is the number of optimizer updates applied, step k trains from version k - 1, and
  policy_version       the version the sample's generation started on (sync: always k - 1),
  policy_version_last  the version its last token came from (= policy_version unless an in-flight weight update
                       interrupted the request and it resumed on newer weights: rollout=vllm's async engine),
  age                  (k - 1) - policy_version, what grpo.async_grpo.max_trajectory_age_steps bounds.

Each file is written as `.jsonl.partial` (one line at a time, flushed), then fsync'd and renamed to
`.jsonl`: a crash never leaves a half line in a final file, and a resumed step simply rewrites its file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

FIELDS = (
    "step",
    "agent_ref",
    "row_id",
    "answer",
    "completion",
    "content",
    "rewards",
    "reward_parts",
    "token_ids",
    "token_loss_mask",
    "sample_loss_mask",
    "advantages",
    "generation_logprobs",
    "prev_logprobs",
    "token_loss",
    "truncated",
    "policy_version",
    "policy_version_last",
    "age",
)


def check_fields(record: dict[str, Any]) -> None:
    """ValueError naming the missing and the extra keys of a record."""
    missing = [f for f in FIELDS if f not in record]
    extra = sorted(k for k in record if k not in FIELDS)
    if missing or extra:
        raise ValueError(f"train-data record: missing keys {missing}, unexpected keys {extra}; expected {FIELDS}")


def to_jsonable(value: Any) -> Any:
    """Tensors and numpy arrays → lists (via .tolist()); containers recursively; the rest unchanged."""
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def with_versions(step: int, records: Iterable[dict[str, Any]],
                  versions: Sequence[tuple[int, int]]) -> Iterator[dict[str, Any]]:
    """Each record with policy_version, policy_version_last and age; ValueError if the counts differ."""
    n = 0
    for n, record in enumerate(records, 1):
        if n > len(versions):
            raise ValueError(f"train-data step {step}: more records than policy versions ({len(versions)})")
        first, last = versions[n - 1]
        yield {**record, "policy_version": int(first), "policy_version_last": int(last), "age": step - 1 - int(first)}
    if n != len(versions):
        raise ValueError(f"train-data step {step}: {n} records, {len(versions)} policy versions")


class TrainDataLog:
    """Writes `dir/train_data_step_{step:06d}.jsonl` every `every` steps."""

    def __init__(self, dir: Path, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be ≥ 1, got {every}")
        self.dir = Path(dir)
        self.every = every

    def enabled_for(self, step: int) -> bool:
        return step % self.every == 0

    def path_for(self, step: int) -> Path:
        return self.dir / f"train_data_step_{step:06d}.jsonl"

    def write_step(self, step: int, records: Iterable[dict[str, Any]],
                   versions: Optional[Sequence[tuple[int, int]]] = None) -> Path:
        """Validate and write every record; the final name appears only once the file is complete.
        `versions`: (first, last) policy version per record, in order (None: the records carry them)."""
        if versions is not None:
            records = with_versions(step, records, versions)
        final = self.path_for(step)
        partial = final.with_name(final.name + ".partial")
        self.dir.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)  # left by a crash during this step: start the step over
        try:
            self._append(partial, records)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, final)
        return final

    @staticmethod
    def _append(partial: Path, records: Iterable[dict[str, Any]]) -> None:
        """One validated JSON line per record, flushed per line, fsync'd at the end."""
        with open(partial, "a", encoding="utf-8") as fh:
            for record in records:
                check_fields(record)
                fh.write(json.dumps(to_jsonable(record)) + "\n")
                fh.flush()
            os.fsync(fh.fileno())

    def steps(self) -> list[int]:
        """Steps with a complete (final) file, ascending; `.partial` files are not counted."""
        names = (p.name for p in self.dir.glob("train_data_step_*.jsonl"))
        return sorted(int(n[len("train_data_step_") : -len(".jsonl")]) for n in names)
