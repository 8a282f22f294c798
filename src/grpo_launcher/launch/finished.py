"""Moved to grpo_launcher/finished.py (pre-flight's rule `run_name_not_finished` reads it; spec/ is below launch/);
re-exported for older imports."""

from __future__ import annotations

from ..finished import STEP_DIR, finished_problem, last_checkpoint_step  # noqa: F401 (re-exported)
