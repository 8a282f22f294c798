"""The start-up line of a resumed run names the step it timed (this start's first), not step 1."""

from __future__ import annotations

import pytest

from helpers import launch, tiny_model


@pytest.mark.slow
@pytest.mark.extended  # make test-all: CI's 30 minutes (ci-rehearsals.md, 2026-12-07)
def test_a_resumed_runs_start_up_line_names_its_first_step(tmp_path):
    """The run resumed at step 2 said 'start-up 15.5 s to the end of step 1 (..., step 1 0.2)'."""
    args = [
        f"model.path={tiny_model()}",
        f"output_root={tmp_path}",
        "logging.mlflow=false",
        "grpo.val_period=1",
        "checkpoint.save_period=1",
    ]
    first = launch(*args, "grpo.max_steps=1")
    again = launch(*args, "grpo.max_steps=2")
    assert first.returncode == again.returncode == 0, (first.stderr + again.stderr)[-3000:]
    assert " s to the end of step 1 (" in first.stdout and ", step 1 " in first.stdout
    line = next(s for s in again.stdout.splitlines() if s.startswith("grpo-launcher: start-up "))
    assert " s to the end of step 2 (" in line and line.rstrip(")").rsplit(", ", 1)[1].startswith("step 2 "), line
