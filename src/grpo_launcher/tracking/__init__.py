"""Run tracking: MLflow (imported only when a Tracker is asked for) and the per-step training-data log."""

from __future__ import annotations

from typing import Any

from .train_data_log import FIELDS, TrainDataLog

__all__ = ["FIELDS", "TrainDataLog", "Tracker"]


def __getattr__(name: str) -> Any:
    """`from grpo_launcher.tracking import Tracker` imports mlflow only then."""
    if name == "Tracker":
        from .mlflow_tracker import Tracker

        return Tracker
    raise AttributeError(name)
