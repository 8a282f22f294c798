"""What the file-backed trackers (TensorBoard, W&B) share: metrics buffered until a commit, and the checkpoint's
pending list ([key, value, timestamp_ms, step], MLflow's layout) taken back on resume."""

from __future__ import annotations


class StepBuffer:
    def __init__(self) -> None:
        self._buffer: list[tuple[str, float, float, int]] = []  # (key, value, wall time s, step)

    def log_metrics(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self._buffer.extend((k, float(v), wall_time, int(step)) for k, v in metrics.items())

    def commit(self) -> int:
        raise NotImplementedError

    def replay(self, pending: list) -> int:
        """A checkpoint's uncommitted metrics, written if missing."""
        self._buffer = [(str(k), float(v), int(ts) / 1000, int(step)) for k, v, ts, step in pending] + self._buffer
        return self.commit()

    def pending(self) -> list[list]:
        return [[k, v, int(wall * 1000), step] for k, v, wall, step in self._buffer]

    def discard(self) -> int:
        dropped, self._buffer = len(self._buffer), []
        return dropped
