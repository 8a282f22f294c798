"""The loop's tracker: MLflow (logging.mlflow) and the step logs beside it (logging.tensorboard, logging.wandb) behind
one object. Metric calls (log, commit, pending, replay, discard, close) go to each; the rest (run_id, experiment_id,
tags, artifacts, spec changes) is MLflow's, a no-op without it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from ..spec.schema import RunSpec
from .tensorboard_log import TB_DIR, TensorBoardLog
from .wandb_log import WandbLog


class StepLog(Protocol):
    """TensorBoardLog and WandbLog: buffered metrics, committed at each checkpoint, never a (key, step) twice."""

    def log_metrics(self, step: int, metrics: dict[str, float], wall_time: float) -> None: ...
    def commit(self) -> int: ...
    def replay(self, pending: list) -> int: ...
    def pending(self) -> list[list]: ...
    def discard(self) -> int: ...
    def close(self, status: str = "FINISHED") -> None: ...


def step_logs(spec: RunSpec, run_dir: Path) -> list[StepLog]:
    """The step logs the spec asks for, opened in the run dir (each reads back what it holds)."""
    logs: list[StepLog] = []
    if spec.logging.tensorboard:
        logs.append(TensorBoardLog(run_dir / TB_DIR))
    if spec.logging.wandb:
        logs.append(WandbLog(spec, run_dir))
    return logs


class Trackers:
    def __init__(self, mlflow: Any, logs: list[StepLog]) -> None:
        self.mlflow, self.logs = mlflow, logs

    def __getattr__(self, name: str) -> Any:  # MLflow-only calls
        if self.mlflow is not None:
            return getattr(self.mlflow, name)
        if name in ("run_id", "experiment_id"):
            return None
        return lambda *args, **kwargs: None

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.mlflow is not None:
            self.mlflow.log_metrics(step, metrics)
        now = time.time()
        for log in self.logs:
            log.log_metrics(step, metrics, now)

    def commit(self) -> int:
        sent = self.mlflow.commit() if self.mlflow is not None else 0
        return sent + sum(log.commit() for log in self.logs)

    def pending(self) -> list[list]:
        """One copy (each tracker buffered the same metrics): MLflow's, else the first step log's."""
        source = self.mlflow if self.mlflow is not None else (self.logs[0] if self.logs else None)
        return source.pending() if source is not None else []

    def replay(self, pending: list) -> int:
        sent = self.mlflow.replay(pending) if self.mlflow is not None else 0
        return sent + sum(log.replay(pending) for log in self.logs)

    def discard(self) -> int:
        dropped = self.mlflow.discard() if self.mlflow is not None else 0
        return dropped + sum(log.discard() for log in self.logs)

    def close(self, status: str = "FINISHED") -> None:
        for log in self.logs:
            log.close(status)
        if self.mlflow is not None:
            self.mlflow.close(status)
