"""Moved to grpo_launcher/train/gym_loop.py (GymTrainer subclasses the driver's Trainer; gym/ is below train/);
re-exported for older imports."""

from __future__ import annotations

from ..train.gym_loop import GymTrainer, endpoints, start_servers  # noqa: F401 (re-exported)
