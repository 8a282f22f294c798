"""`launch.py eval`'s printed metrics: each name apart from its value, whatever the reward function is called."""

from __future__ import annotations

import json
import re

import pytest

from helpers import ROOT, launch, tiny_model


@pytest.mark.slow
def test_eval_prints_a_long_reward_name_apart_from_its_value(tmp_path):
    """val/reward/<fn>_mean over 31 characters ran into its value ('val/reward/math_verify_match_mean0', env=math):
    read as another number."""
    (tmp_path / "rewards.py").write_text("def a_rather_long_reward_name(prompt, completion, **row):\n    return 0.25\n")
    (tmp_path / "metrics").mkdir()
    val = ROOT / "data" / "reverse_val.jsonl"
    p = launch(
        "eval",
        str(tiny_model()),
        "env=dataset",
        f"env.train_path={val}",
        f"env.val_path={val}",
        f"env.reward_fn={tmp_path / 'rewards.py'}:a_rather_long_reward_name",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        f"output_root={tmp_path}",
        "--out",
        str(tmp_path / "metrics"),  # a directory: the file in it, under its default name (was IsADirectoryError)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(s for s in p.stdout.splitlines() if s.startswith("val/reward/a_rather_long_reward_name_mean"))
    assert re.fullmatch(r"val/reward/a_rather_long_reward_name_mean +0\.25", line), line
    (written,) = (tmp_path / "metrics").glob("*.reverse_val.json")
    record = json.loads(written.read_text())
    assert record["metrics"]["val/reward/a_rather_long_reward_name_mean"] == 0.25
    # what the eval ran under is in the file (an eval with other sampling wrote a record like the default's)
    assert "grpo.max_val_samples=8" in record["overrides"] and record["sampling"]["temperature"] == 1.0


def test_an_out_that_cannot_be_a_file_is_refused_before_the_eval_runs(launch_here, tmp_path):
    """Was found after the whole eval had run: a traceback, the metrics lost."""
    (tmp_path / "a_file").write_text("")
    r = launch_here(tmp_path, "eval", str(tiny_model()), "--out", str(tmp_path / "a_file" / "m.json"))
    assert r.returncode == 2 and r.stderr.startswith("config error"), r.stdout + r.stderr
    assert f"  - --out: {tmp_path / 'a_file' / 'm.json'} cannot be written as a file" in r.stderr
    assert "eval of" not in r.stdout and not (tmp_path / "outputs").exists()
