"""grpo-launcher: compose → spec → validate → plan → execute, for GRPO post-training."""

__version__ = "0.1.0"
