"""Optimizer state only where a resume needs it (issue 43, Disk): a real run through launch.py keeps it in the newest
checkpoint alone; the older kept one holds its weights and verifies; a damaged newest falls back to it, and the run
finishes with a fresh optimizer, said in one line. The megatron worker (CPU, the test shim) loads such a checkpoint
as the torch worker does (tests/unit/test_checkpoint.py): the weights, a fresh optimizer and warm-up."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_launcher.checkpoint import verify_checkpoint
from grpo_launcher.checkpoint.manager import has_optimizer

from helpers import ROOT, share_models
from integration.test_megatron import _batch, _free_port, _megatron_spec
from unit.test_megatron import SHIM, _tiny_qwen2

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test: the golden run's checkpoints and resume;
# tests/unit/test_checkpoint.py: optimizer state in the newest checkpoint only, a fallback's "fresh optimizer" line


def run(root: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), f"output_root={share_models(root)}", "name=opt-state",
           "grpo.max_steps=4", "checkpoint.save_period=2", "checkpoint.keep_top_k=2", "grpo.val_period=2",
           "logging.mlflow=false", *extra]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=1500)


def test_only_the_newest_checkpoint_keeps_optimizer_state_and_a_fallback_starts_a_fresh_one(tmp_path):
    first = run(tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    ckpts = tmp_path / "opt-state" / "checkpoints"
    older, newest = ckpts / "step_000002", ckpts / "step_000004"
    assert sorted(p.name for p in ckpts.iterdir()) == [older.name, newest.name]
    assert not (older / "optim.pt").exists() and not has_optimizer(older) and verify_checkpoint(older) is None
    assert (newest / "optim.pt").is_file() and has_optimizer(newest) and verify_checkpoint(newest) is None
    with open(newest / "optim.pt", "r+b") as f:  # damage the newest: the resume falls back to the older one
        f.truncate(100)
    second = run(tmp_path, "grpo.max_steps=6")  # a finished run is extended (the same max_steps is refused)
    out = second.stdout
    assert second.returncode == 0, out[-3000:]
    assert f"checkpoint {newest} is not usable: optim.pt has 100 bytes" in out, out[-3000:]
    assert "resuming from step_000002 (step 2)" in out
    (line,) = [ln for ln in out.splitlines() if "fresh optimizer" in ln]
    assert "step_000002 holds the weights but no optimizer state" in line, line
    assert re.search(r"^step 3/6", out, re.M) and re.search(r"^step 6/6", out, re.M), out[-3000:]
    assert "step 2/6" not in out
    kept = sorted(ckpts.glob("step_*"))
    assert kept[-1].name == "step_000006" and has_optimizer(kept[-1]), kept
    assert all(verify_checkpoint(p) is None for p in kept)
    assert not any(has_optimizer(p) or (p / "optim.pt").exists() for p in kept[:-1]), kept


def _save_job(rank: int, world: int, spec, model_dir: str, ckpt: str, out: str, port: int) -> None:
    """Train one step and save (load=False), or load the checkpoint into a new worker (load=True)."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    if out.endswith("loaded.pt"):
        w.load(ckpt)
    else:
        b = _batch(8, 259)
        prev, _ = w.logprobs(b)
        b = b.with_(prev_logprobs=prev + 0.3)
        w.update([b], [max(local_denominator(spec.loss.aggregation.value, b.response_mask), 1.0)])
        w.save(ckpt)
    opt_state = sum(len(s) for s in w.opt.state.values())
    torch.save({"sd": w.state_dict(), "steps": w.steps, "opt_state": opt_state, "lr": w._lr()}, out)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(spec, model_dir: Path, ckpt: Path, out: Path) -> dict:
    import torch.multiprocessing as mp

    mp.start_processes(_save_job, args=(1, spec, str(model_dir), str(ckpt), str(out), _free_port()), nprocs=1,
                       start_method="spawn", join=True)
    return torch.load(out, weights_only=False)


def test_the_megatron_worker_loads_weights_only_with_a_fresh_optimizer(tmp_path):
    pytest.importorskip("megatron.core")
    spec = _megatron_spec(warmup_steps=4)
    model_dir = _tiny_qwen2(tmp_path)
    trained = _spawn(spec, model_dir, tmp_path / "full", tmp_path / "trained.pt")
    assert trained["steps"] == 1 and trained["opt_state"] > 0
    shutil.copytree(tmp_path / "full", tmp_path / "weights")
    (tmp_path / "weights" / "megatron_optim_rank0.pt").unlink()
    for name, steps in (("full", 1), ("weights", 0)):
        got = _spawn(spec, model_dir, tmp_path / name, tmp_path / f"{name}-loaded.pt")
        assert set(got["sd"]) == set(trained["sd"]), name
        assert all(torch.equal(v, trained["sd"][k]) for k, v in got["sd"].items()), name
        assert got["steps"] == steps and (got["opt_state"] > 0) == bool(steps), name
        assert got["lr"] == pytest.approx(spec.train.lr * (steps + 1) / 4), name
