"""Atomic, pruned checkpoints and the resume compatibility guard."""

from .manager import COMPAT_KEYS, CheckpointManager, IncompatibleCheckpoint, compat_fingerprint, load_meta

__all__ = ["COMPAT_KEYS", "CheckpointManager", "IncompatibleCheckpoint", "compat_fingerprint", "load_meta"]
