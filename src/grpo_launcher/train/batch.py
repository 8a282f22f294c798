"""The batch types moved to grpo_launcher.batch (shared by every room); re-exported here for older imports."""

from __future__ import annotations

from ..batch import Generation, TrainBatch, collate, response_logits, shard_rows

__all__ = ["Generation", "TrainBatch", "collate", "response_logits", "shard_rows"]
