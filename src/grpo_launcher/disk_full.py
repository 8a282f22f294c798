"""A full disk (ENOSPC, EDQUOT) during a run: one message naming the file and the free space, the MLflow run ended
or left for the resume, said so; no chained tracebacks (the driver calls report() from its catch-all).

Found anywhere in the exception's chain: an OSError of ours or Python's, a worker's error that Ray re-raised in
the driver (its text holds the worker's `[Errno 28] No space left on device: 'FILE'`), a sqlite store's
"database or disk is full". A file the run cannot write (a read-only filesystem or directory: EROFS, EACCES, EPERM)
ends the same way: one message naming the file, the run's trackers ended, the resume said.
"""

from __future__ import annotations

import errno
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from .exit_codes import ExitCode
from .runfiles import free_space, no_space_message

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|database or disk is full|no space left on device")
ERRNO_FILE = re.compile(r"\[Errno (?:28|122)\] [^:\n]+: '([^'\n]+)'")


def chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and the cause Ray wraps a worker's error around (RayTaskError)."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        ray_cause = getattr(e, "cause", None)
        todo += [e.__cause__, e.__context__, ray_cause if isinstance(ray_cause, BaseException) else None]


def message(exc: BaseException, run_dir: Path) -> Optional[str]:
    """'no space left on device writing FILE (N MiB free)' when the disk is full somewhere in `exc`, else None."""
    for e in chain(exc):
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            if str(e.strerror or "").startswith("no space left on device writing"):
                return str(e.strerror)  # ours (runfiles, the checkpoint manager, status.json): file and space
            if e.filename:
                return no_space_message(Path(e.filename))
    text = "\n".join(str(e) for e in chain(exc))
    if not FULL_TEXT.search(text):
        return None
    named = ERRNO_FILE.search(text)
    if named:
        return no_space_message(Path(named.group(1)))
    first = next(line.strip() for line in text.splitlines() if FULL_TEXT.search(line))
    return f"no space left on device under {run_dir} ({free_space(run_dir)}): {first[:200]}"


def unwritable(exc: BaseException) -> Optional[str]:
    """'Read-only file system: FILE' (or 'Permission denied: FILE') when an OSError of ours or Python's in `exc` was
    refused access to a file, else None."""
    for e in chain(exc):
        if isinstance(e, OSError) and e.errno in UNWRITABLE_ERRNOS and e.filename:
            return f"{e.strerror}: {e.filename}"
    return None


def end_tracking(tracker: Any, resumable: bool) -> str:
    """The run's trackers after a full disk: buffered metrics dropped (the resume logs those steps again), the
    MLflow run marked FAILED with one try (a store on the full disk cannot take it: then left RUNNING, and the
    resume reopens it) instead of the close's minutes of retries."""
    if tracker is None:
        return "no MLflow run"
    tracker.discard()
    for log in getattr(tracker, "logs", []):  # TensorBoard / W&B beside MLflow (tracking/trackers.py)
        try:
            log.close("FAILED")
        except Exception:  # noqa: BLE001  (a step log on the full disk: its files stay as they are)
            pass
    mlflow = getattr(tracker, "mlflow", tracker)
    if mlflow is None or getattr(mlflow, "client", None) is None:
        return "no MLflow run"
    then = "the resume reopens it" if resumable else "no checkpoint holds it: a new launch starts a new MLflow run"
    try:
        mlflow.client.set_terminated(mlflow.run_id, status="FAILED")
    except Exception as exc:  # noqa: BLE001  (the store is on the full disk, or away)
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        why = next((line for line in lines if FULL_TEXT.search(line)), lines[0]).strip()[:160]
        return f"MLflow run {mlflow.run_id} left RUNNING ({why}); {then}"
    return f"MLflow run {mlflow.run_id} marked FAILED; {then}"


def report(exc: BaseException, state: Any, run_dir: Path) -> Optional[int]:
    """A full disk, or a file the run cannot write, in `exc`: the one message on stderr, trackers ended
    (end_tracking), exit code FAILED; else None (the caller goes on with its own handling)."""
    what = message(exc, Path(run_dir))
    fix = "free space there"
    if what is None:
        what, fix = unwritable(exc), "make it writable (mount read-write, or chmod)"
    if what is None:
        return None
    ckpt = state.ckpt.latest() if state is not None else None
    tracking = end_tracking(state.tracker if state is not None else None, resumable=ckpt is not None)
    print(f"grpo-launcher: {what.removesuffix('; free space there and resume')}\n  last completed step: "
          f"{state.step if state is not None else 0}; last checkpoint: {ckpt or 'none'}; {tracking}\n  {fix}, then "
          "launch the same command again: it " + ("resumes from the last checkpoint" if ckpt else
          "starts from step 1 (no checkpoint yet)"), file=sys.stderr, flush=True)
    return ExitCode.FAILED
