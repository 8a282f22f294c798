"""Ctrl-C as soon as a run's plan is printed (the user sees a wrong key and stops it): the run's driver had not
installed its handler yet. The signal was lost inside the driver's imports (the run trained to its end, exit 0) or
ended in a KeyboardInterrupt traceback; now it stops the run before it trains, exit 130, in one line."""

from __future__ import annotations

import json

from helpers import interrupted, share_models


def test_ctrl_c_while_a_run_starts_stops_it(tmp_path):
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    rc, text = interrupted(["name=r", "grpo.max_steps=40", "logging.mlflow=false", f"output_root={out}"],
                           tmp_path / "run.log", "checkpoints on disk", "the run's plan", 120)
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text and "finished at step" not in text, text[-3000:]
    status = out / "r" / "status.json"
    if status.exists():  # the signal came once the run was recorded (else before it: nothing to record)
        assert json.loads(status.read_text())["state"] == "STOPPED"
