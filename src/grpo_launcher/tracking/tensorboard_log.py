"""TensorBoard event files beside MLflow (logging.tensorboard=true): RUN_DIR/tensorboard/, one scalar per metric, the
same names (`train/reward_mean`) and step axis as MLflow.

Like the MLflow tracker, metrics are buffered until `commit()` (right after a checkpoint is written), and a reopened
log reads back which (tag, step) pairs its event files hold already and never writes one twice: after a stop and
resume, or a crash and a resume from an older checkpoint, every step is in the event files exactly once.
`trackers.Trackers` sends the loop's metric calls to MLflow and to it.
"""

from __future__ import annotations

from pathlib import Path

from .step_buffer import StepBuffer

TB_DIR = "tensorboard"  # under the run dir


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under log_dir: {tag: [(step, value), ...]} in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # here: heavy, for logging.tensorboard only

    if not Path(log_dir).is_dir():
        return {}
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class TensorBoardLog(StepBuffer):
    """One run's event files: buffered scalars, written on commit, never a (tag, step) twice."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # here: torch, for logging.tensorboard only

        self.log_dir = Path(log_dir)
        self._logged = {(tag, step) for tag, points in read_scalars(self.log_dir).items() for step, _ in points}
        self._writer = SummaryWriter(str(self.log_dir))  # a new event file per process
        StepBuffer.__init__(self)

    def commit(self) -> int:
        """Write the buffered scalars not in the files yet; returns how many were written."""
        buffered, self._buffer = self._buffer, []
        sent = 0
        for tag, value, wall, step in buffered:
            if (tag, step) not in self._logged:
                self._writer.add_scalar(tag, value, global_step=step, walltime=wall)
                self._logged.add((tag, step))
                sent += 1
        self._writer.flush()
        return sent

    def close(self, status: str = "FINISHED") -> None:
        self.commit()
        self._writer.close()
