"""`launch.py eval|generate RUN_DIR` from another directory: the run's relative paths are its launch directory's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpo_launcher.checkpoint import CheckpointManager
from grpo_launcher.envs import make_env
from grpo_launcher.launch import eval as ev
from grpo_launcher.launch import rundir
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.tracking.repro import write_repro


def rows(answer) -> str:
    return "".join(json.dumps({"prompt": f"{i:04d}>", "answer": answer(f"{i:04d}")}) + "\n" for i in range(16))


def test_eval_of_a_run_reads_its_data_where_it_was_launched(tmp_path, monkeypatch):
    """A run launched in A with env.val_path=data/val.jsonl, evaluated from B, which has a data/val.jsonl of its own:
    eval scored B's file (other answers) as the run's val set, without a word."""
    launched, elsewhere = tmp_path / "A", tmp_path / "B"
    for d, answer in ((launched, lambda s: s[::-1]), (elsewhere, lambda s: "0")):
        (d / "data").mkdir(parents=True)
        for name in ("train", "val"):
            (d / "data" / f"{name}.jsonl").write_text(rows(answer))
    monkeypatch.chdir(launched)
    spec = load_spec(
        [
            "env=dataset",
            "env.train_path=data/train.jsonl",
            "env.val_path=data/val.jsonl",
            f"output_root={tmp_path / 'out'}",
            "name=r",
            "logging.mlflow=false",
        ]
    )
    plan = make_plan(spec)
    rundir.prepare(spec, plan)  # spec.yaml as a launch writes it
    write_repro(spec, plan.run_dir, argv=["launch.py"])  # repro/git.json: the launch directory
    CheckpointManager(plan.checkpoint_dir, spec).save(1, lambda d: (d / "policy").mkdir(), {"mlflow_run_id": None}, {})
    monkeypatch.chdir(elsewhere)
    ns = argparse.Namespace(target=str(plan.run_dir), root=Path("outputs"), step=None, overrides=[], out=Path("m.json"))
    t = ev.target(ns)
    assert [p.answer for p in make_env(t.spec).val_prompts()] == [f"{i:04d}"[::-1] for i in range(16)]
    assert ns.out == elsewhere / "m.json"  # --out stays the caller's
