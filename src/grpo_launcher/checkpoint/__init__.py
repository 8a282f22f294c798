"""Atomic, verified, pruned checkpoints and the resume compatibility guard."""

from .manager import (COMPAT_KEYS, CheckpointManager, CheckpointRefused, IncompatibleCheckpoint, compat_fingerprint,
                      load_meta, verify_checkpoint)

__all__ = ["COMPAT_KEYS", "CheckpointManager", "CheckpointRefused", "IncompatibleCheckpoint", "compat_fingerprint",
           "load_meta", "verify_checkpoint"]
