"""The GRPO loop for real: Ray actors, the tiny model, MLflow in sqlite, checkpoints, the train-data log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, check_train_data_record, policy_ranks, share_models, tiny_model, wait_until

from grpo_launcher.spec.compose import load_spec
from grpo_launcher.batch import Generation, collate, shard_rows

pytestmark = pytest.mark.slow


def launch(tmp_path: Path, *overrides: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={share_models(tmp_path)}", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 300) -> list[str]:
    """Read the run's output until a line contains `needle` (fails with the output if it never does)."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"never saw {needle!r}; output:\n{''.join(lines[-40:])}")


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def metric_steps(tmp_path: Path, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)), run


@pytest.mark.extended
def test_default_run_learns(tmp_path):
    """`python launch.py` with no overrides: the reward rises by ≥ 0.3 (last 5 steps vs first 5)."""
    proc = launch(tmp_path)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    history, run = metric_steps(tmp_path, "train/reward_mean")
    rewards = [v for _, v in history]
    assert [s for s, _ in history] == list(range(1, 151))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, (first, last)
    assert run.info.status == "FINISHED" and "mlflow.source.git.commit" in run.data.tags
    assert run.data.params["grpo.num_generations_per_prompt"] == "8"
    assert (tmp_path / "tiny-grpo" / "checkpoints").is_dir()
    # quiet (h15b): no third-party warning or INFO line, and none of ours, on a default run that builds the model
    noise = [ln for ln in out.splitlines() if re.search(r"Warning|WARNING|\bINFO\b", ln)]
    assert not noise, noise


@pytest.mark.extended
def test_kill_and_resume_no_gap_no_repeat(tmp_path):
    args = ["grpo.max_steps=8", "checkpoint.save_period=2", "grpo.val_period=2"]
    proc = launch(tmp_path, *args, start_new_session=True)
    wait_for_line(proc, "step 5/8")
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray processes, nothing else
    proc.wait(timeout=60)
    proc = launch(tmp_path, *args)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from step_000004" in out and "step 5/8" in out and "step 4/8" not in out
    history, _ = metric_steps(tmp_path, "train/reward_mean")
    assert [s for s, _ in history] == list(range(1, 9))  # no gap, no repeat
    lines = (tmp_path / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))  # step 5's lost line is gone


@pytest.mark.extended
def test_incompatible_checkpoint_refused(tmp_path):
    proc = launch(tmp_path, "grpo.max_steps=2", "checkpoint.save_period=2", "grpo.val_period=2")
    assert proc.wait(timeout=600) == 0
    proc = launch(tmp_path, "grpo.max_steps=4", "checkpoint.save_period=2", "grpo.val_period=2",
                  "model.ffn_hidden_size=128")
    out = finish(proc)
    assert proc.returncode == 2 and "model.ffn_hidden_size" in out and "checkpoint.resume=fresh" in out
    proc = launch(tmp_path, "grpo.max_steps=2", "checkpoint.save_period=2", "grpo.val_period=2",
                  "model.ffn_hidden_size=128", "checkpoint.resume=fresh")
    out = finish(proc)
    assert proc.returncode == 0 and "previous checkpoints moved to" in out, out[-2000:]
    run = tmp_path / "tiny-grpo"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], steps  # the first start's rows moved aside with its checkpoints, not mixed in
    (old,) = run.glob("checkpoints.old-*")
    assert (old / "metrics.jsonl").is_file() and (old / "step_000002").is_dir()


@pytest.mark.extended
def test_train_data_log_fields_on_a_real_step(tmp_path):
    proc = launch(tmp_path, "grpo.max_steps=2", "logging.train_data_log=true", "checkpoint.save_period=2",
                  "grpo.val_period=2", "rollout.max_new_tokens=5")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_model()).eos_token_id
    lines = (tmp_path / "tiny-grpo" / "train_data" / "train_data_step_000002.jsonl").read_text().splitlines()
    assert len(lines) == 16 * 8
    for rec in map(json.loads, lines):
        check_train_data_record(rec, eos, version=1)  # sync: step - 1


# ------------------------------------------------------------------ data parallel == single worker


def _batch(spec, tok, n: int = 16) -> "TrainBatch":  # noqa: F821
    g = torch.Generator().manual_seed(0)
    gens = []
    for i in range(n):
        prompt = torch.randint(3, 250, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(3, 250, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        gens.append(Generation(prompt, resp, [-1.0] * len(resp), truncated=i % 5 == 0))
    adv = torch.randn(n, generator=g)
    return collate(gens, adv, torch.tensor([0.0 if i % 5 == 0 else 1.0 for i in range(n)]), tok.pad_token_id)


@pytest.mark.parametrize("aggregation", ["token_mean", pytest.param("seq_mean_token_mean", marks=pytest.mark.extended)])
def test_two_worker_dp_update_equals_one_worker(tmp_path, aggregation):
    import ray
    from transformers import AutoTokenizer

    from grpo_launcher.policy.torch_policy import local_denominator

    spec = load_spec(["train.micro_batch_size=4", "train.global_batch_size=16", f"loss.aggregation={aggregation}",
                      "loss.kl_coef=0.1", f"output_root={tmp_path}"])
    model_dir = str(tiny_model())
    batch = _batch(spec, AutoTokenizer.from_pretrained(model_dir))
    with policy_ranks(spec, model_dir) as (single, pair):
        before = ray.get(single.state_dict.remote())
        prev, ref = ray.get(single.logprobs.remote(batch))
        batch = batch.with_(prev_logprobs=prev, ref_logprobs=ref)
        den = local_denominator(aggregation, batch.response_mask * batch.sample_mask[:, None])
        m1 = ray.get(single.update.remote([batch], [den]))
        m2 = ray.get([w.update.remote([batch.select(shard_rows(16, 2, r))], [den]) for r, w in enumerate(pair)])
        one, two_a, two_b = ray.get([single.state_dict.remote(), pair[0].state_dict.remote(),
                                     pair[1].state_dict.remote()])
    assert any(not torch.equal(before[k], one[k]) for k in one)  # the update did move the weights
    for k in one:
        torch.testing.assert_close(two_a[k], two_b[k], rtol=0, atol=0)  # ranks stay identical
        torch.testing.assert_close(two_a[k], one[k], rtol=1e-5, atol=1e-6)  # and equal the 1-worker update
    assert abs(m1["grad_norm"] - m2[0]["grad_norm"]) < 1e-4 * max(1.0, m1["grad_norm"])
    assert abs(m1["loss"] - (m2[0]["loss"] + m2[1]["loss"])) < 1e-5


@pytest.mark.extended
def test_dapo_dynamic_sampling_and_kl_run(tmp_path):
    """loss=dapo (dynamic sampling, overlong filtering, token-level loss) plus a KL reference, end to end."""
    proc = launch(tmp_path, "loss=dapo", "loss.kl_coef=0.05", "grpo.max_steps=2", "grpo.val_period=2",
                  "checkpoint.save_period=2", "rollout.max_new_tokens=4")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rounds, _ = metric_steps(tmp_path, "train/dynamic_sampling_rounds")
    kl, _ = metric_steps(tmp_path, "train/kl")
    trunc, _ = metric_steps(tmp_path, "train/truncation_rate")
    assert all(1 <= r <= 3 for _, r in rounds) and len(kl) == 2
    assert all(t > 0 for _, t in trunc)  # 4 new tokens cannot hold 4 digits + EOS: every sample truncated


@pytest.mark.extended
def test_cancel_of_a_local_run_stops_it_and_records_cancelled(tmp_path):
    """`launch.py cancel RUN` on a local run: SIGTERM, the driver checkpoints and stops, status says CANCELLED."""
    log = open(tmp_path / "launch.out", "w")  # a file, not a pipe nobody reads: the driver must never block on it
    proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={share_models(tmp_path)}",
                             "grpo.max_steps=150", "checkpoint.save_period=50", "grpo.val_period=50",
                             "logging.mlflow=false"], stdout=log, stderr=subprocess.STDOUT)
    try:
        metrics = tmp_path / "tiny-grpo" / "metrics.jsonl"
        wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, 600, "step 2")
        cancel = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cancel", "tiny-grpo", "--root",
                                 str(tmp_path), "--timeout", "300"], capture_output=True, text=True, timeout=400)
        assert cancel.returncode == 0 and "stopped local run" in cancel.stdout, cancel.stdout + cancel.stderr
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    status = json.loads((tmp_path / "tiny-grpo" / "status.json").read_text())
    assert status["state"] == "CANCELLED" and status["exit_code"] == 143, status
    assert list((tmp_path / "tiny-grpo" / "checkpoints").glob("step_*")), "the driver checkpointed on SIGTERM"
    st = subprocess.run([sys.executable, str(ROOT / "launch.py"), "status", "tiny-grpo", "--root", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert "CANCELLED" in st.stdout, st.stdout + st.stderr


# ------------------------------------------------------------------ a step with nothing to learn


@pytest.mark.extended
def test_constant_reward_steps_say_no_update_and_take_no_optimizer_step(tmp_path):
    """A reward file returning 0.0 with dynamic sampling: every group's rewards are equal after the refill cap, so
    the loss is 0 whatever the policy. The step line says so, the metrics count no optimizer step (one skipped per
    minibatch) and the equal groups, and the weights do not move (the schedule neither)."""
    (tmp_path / "zero.py").write_text("def zero(prompt, completion, **row):\n    return 0.0\n")
    proc = launch(tmp_path, "env=dataset", f"env.train_path={ROOT / 'data/reverse_train.jsonl'}",
                  f"env.val_path={ROOT / 'data/reverse_val.jsonl'}", f"env.reward_fn={tmp_path / 'zero.py'}:zero",
                  "loss.dynamic_sampling=true", "loss.dynamic_sampling_max_rounds=2", "grpo.max_steps=2",
                  "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=8",
                  "train.micro_batch_size=8", "train.logprob_batch_size=16", "train.warmup_steps=2",
                  "grpo.val_period=2", "grpo.max_val_samples=8", "grpo.val_batch_size=8", "checkpoint.save_period=2", "logging.mlflow=false")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"^step 1/2 .*\(all 4 groups had equal rewards after 2 rounds: no update\)$", out, re.M), out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/optimizer_steps"] == 0 and r["train/skipped_optimizer_steps"] == 2, r  # 16 rows / 8
        assert r["train/equal_reward_groups"] == 4 and r["train/dynamic_sampling_rounds"] == 2, r
        assert r["train/lr"] == rows[0]["train/lr"]  # no optimizer step: the warm-up does not advance
