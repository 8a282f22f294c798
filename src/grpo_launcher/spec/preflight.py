"""Moved to grpo_launcher/launch/preflight.py (pre-flight renders the sbatch script and writes a run dir: launch
steps); re-exported for older imports."""

from __future__ import annotations

from ..launch.preflight import (  # noqa: F401 (re-exported)
    finish,
    guarded,
    job_spec,
    preflight,
    preflight_config,
    read_back_as_the_job,
    render_job,
)
