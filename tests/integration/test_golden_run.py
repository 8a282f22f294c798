"""One real run of `python launch.py`, read many ways: the default recipe on local Ray, MLflow in sqlite,
checkpoints and the train-data log; stopped midway by `launch.py cancel` and resumed by the same command.

It is `make test`'s end-to-end check of Ray + MLflow + checkpoints + stop/resume + learning. The same behaviours one
run at a time (kill -9 then resume, each signal, the default run uninterrupted) are in `make test-all`
(test_grpo_loop.py, test_faults.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, check_train_data_record, share_models, tiny_model, wait_until

pytestmark = pytest.mark.slow
NAME = "tiny-grpo"
CANCEL_AFTER = 25  # steps: past the step-20 checkpoint, so the resume skips a saved checkpoint's steps too


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> dict:
    """Run 1 (cancelled after CANCEL_AFTER steps) and run 2 (resumed to the end): outputs, exit codes, statuses."""
    root = share_models(tmp_path_factory.mktemp("golden"))
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={root}", "logging.train_data_log=true"]
    out1, out2 = root / "run1.out", root / "run2.out"
    metrics = root / NAME / "metrics.jsonl"
    with open(out1, "w") as log:  # a file, not a pipe nobody reads: the driver must never block on it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_until(lambda: len(read_lines(metrics)) >= CANCEL_AFTER or proc.poll() is not None, 900,
                   f"step {CANCEL_AFTER}")
        assert proc.poll() is None, out1.read_text()[-3000:]
        cancel = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cancel", NAME, "--root", str(root),
                                 "--timeout", "300"], capture_output=True, text=True, timeout=400)
        rc1 = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status1 = json.loads((root / NAME / "status.json").read_text())
    with open(out2, "w") as log:
        run2 = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=1500)
    return {"root": root, "run_dir": root / NAME, "cancel": cancel, "rc1": rc1, "status1": status1,
            "out1": out1.read_text(), "rc2": run2.returncode, "out2": out2.read_text()}


def mlflow_run(root: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run


def test_cancel_stops_with_a_checkpoint_and_says_cancelled(golden):
    c = golden["cancel"]
    assert c.returncode == 0 and "stopped local run" in c.stdout, c.stdout + c.stderr
    assert golden["rc1"] == 143, golden["out1"][-3000:]
    assert golden["status1"]["state"] == "CANCELLED" and golden["status1"]["exit_code"] == 143
    stopped = int(re.search(r"stopped after step (\d+) \(SIGTERM\); checkpoint saved", golden["out1"]).group(1))
    assert stopped >= CANCEL_AFTER
    assert f"resuming from step_{stopped:06d}" in golden["out2"], golden["out2"][-3000:]


def test_resumed_run_finishes_and_every_step_is_logged_once(golden):
    assert golden["rc2"] == 0, golden["out2"][-3000:]
    client, run = mlflow_run(golden["root"])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/reward_mean"))
    assert [s for s, _ in history] == list(range(1, 151))  # one MLflow run, no gap, no repeat across the stop
    steps = [json.loads(line)["step"] for line in read_lines(golden["run_dir"] / "metrics.jsonl")]
    assert steps == list(range(1, 151))
    assert run.info.status == "FINISHED" and "mlflow.source.git.commit" in run.data.tags
    assert run.data.params["grpo.num_generations_per_prompt"] == "8"
    st = subprocess.run([sys.executable, str(ROOT / "launch.py"), "status", NAME, "--root", str(golden["root"])],
                        capture_output=True, text=True, timeout=120)
    assert "COMPLETED" in st.stdout and "150/150" in st.stdout, st.stdout + st.stderr


def test_the_default_run_learns(golden):
    """The reward rises by ≥ 0.3 (last 5 steps vs first 5), across the stop and the resume."""
    rewards = [json.loads(line)["train/reward_mean"] for line in read_lines(golden["run_dir"] / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, (first, last)
    assert (golden["run_dir"] / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoints_are_complete_and_pruned(golden):
    from grpo_launcher.checkpoint import verify_checkpoint

    ckpts = sorted((golden["run_dir"] / "checkpoints").glob("step_*"))
    assert ckpts and ckpts[-1].name == "step_000150" and len(ckpts) <= 3, ckpts  # keep_top_k=2 + the latest
    assert all(verify_checkpoint(c) is None for c in ckpts)


def test_output_is_quiet(golden):
    """No third-party warning or INFO line, and none of ours, in either run's output."""
    noise = [ln for ln in (golden["out1"] + golden["out2"]).splitlines() if re.search(r"Warning|WARNING|\bINFO\b", ln)]
    assert not noise, noise


def test_train_data_log_fields_on_real_steps(golden):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_model()).eos_token_id
    logs = sorted((golden["run_dir"] / "train_data").glob("train_data_step_*.jsonl"))
    assert [int(p.stem.rsplit("_", 1)[1]) for p in logs] == list(range(1, 151))
    for path, step in ((logs[0], 1), (logs[-1], 150)):
        lines = path.read_text().splitlines()
        assert len(lines) == 16 * 8
        for rec in map(json.loads, lines):
            check_train_data_record(rec, eos, version=step - 1)  # sync GRPO: the policy of the step before
