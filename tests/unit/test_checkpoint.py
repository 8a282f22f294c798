"""CheckpointManager on real files: atomic saves, pruning, the resume guard, start_fresh."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from grpo_launcher.checkpoint import CheckpointManager, IncompatibleCheckpoint, load_meta
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.schema import CheckpointSpec, RunSpec


def spec_with(**checkpoint) -> RunSpec:
    return RunSpec(checkpoint=CheckpointSpec(**checkpoint))


def write_weights(d: Path) -> None:
    (d / "model.pt").write_bytes(b"weights")


def save(mgr: CheckpointManager, step: int, metrics: dict[str, float] | None = None) -> Path:
    return mgr.save(step, write_weights, {"mlflow_run_id": "abc", "rng": [1, 2]}, metrics or {})


def names(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir())


def test_save_layout_and_meta(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with())
    path = save(mgr, 10, {"val/reward_mean": 0.5})
    assert path.name == "step_000010" and (path / "model.pt").read_bytes() == b"weights"
    meta = load_meta(path)
    assert meta["step"] == 10 and meta["state"] == {"mlflow_run_id": "abc", "rng": [1, 2]}
    assert meta["metrics"] == {"val/reward_mean": 0.5}
    hidden = mgr.spec.model.hidden_size
    assert meta["spec"]["model"]["hidden_size"] == hidden and meta["spec"]["train"]["backend"] == "torch"
    assert meta["compat"]["model.hidden_size"] == hidden and "train.lr" not in meta["compat"]
    assert names(tmp_path / "ckpt") == ["step_000010"]  # no tmp dir left behind


def test_prune_keeps_top_k_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with(keep_top_k=2))
    for step, value in [(10, 0.5), (20, 0.9), (30, 0.7), (40, 0.1)]:
        save(mgr, step, {"val/reward_mean": value})
    assert names(mgr.ckpt_dir) == ["step_000020", "step_000030", "step_000040"]
    assert mgr.best().name == "step_000020" and mgr.latest().name == "step_000040"


def test_prune_lower_is_better_and_missing_metric_ranks_last(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with(keep_top_k=1, metric="train/loss", higher_is_better=False))
    save(mgr, 10, {"train/loss": 2.0})
    save(mgr, 20, {"train/loss": 1.0})
    save(mgr, 30, {"train/reward_mean": 1.0})  # lacks the metric: kept only as the latest
    save(mgr, 40, {"train/loss": 3.0})
    assert names(mgr.ckpt_dir) == ["step_000020", "step_000040"]
    assert mgr.best().name == "step_000020"


def test_best_is_none_without_the_metric(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with())
    save(mgr, 10)
    assert mgr.best() is None and mgr.latest().name == "step_000010"


def test_failed_write_leaves_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with())
    save(mgr, 10)

    def crash(d: Path) -> None:
        (d / "model.pt").write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        mgr.save(20, crash, {}, {})
    assert names(mgr.ckpt_dir) == ["step_000010"]
    assert mgr.latest().name == "step_000010"


def test_stale_tmp_and_incomplete_dirs_are_ignored_then_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with())
    save(mgr, 10)
    stale = mgr.ckpt_dir / ".tmp-step_000020-99999"
    stale.mkdir()
    (stale / "meta.json").write_text(json.dumps({"step": 20}))
    (mgr.ckpt_dir / "step_000030").mkdir()  # no meta.json: not a complete checkpoint
    assert mgr.latest().name == "step_000010"
    save(mgr, 20)
    assert not stale.exists() and mgr.latest().name == "step_000020"


def test_resaving_a_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with())
    save(mgr, 10, {"val/reward_mean": 0.1})
    save(mgr, 10, {"val/reward_mean": 0.2})
    assert names(mgr.ckpt_dir) == ["step_000010"]
    assert load_meta(mgr.latest())["metrics"]["val/reward_mean"] == 0.2


def test_incompatible_resume_names_every_key(tmp_path):
    old = RunSpec()
    path = save(CheckpointManager(tmp_path / "ckpt", old), 10)
    new = dataclasses.replace(
        old,
        model=dataclasses.replace(old.model, hidden_size=2 * old.model.hidden_size),
        grpo=dataclasses.replace(old.grpo, num_generations_per_prompt=2 * old.grpo.num_generations_per_prompt),
    )
    with pytest.raises(IncompatibleCheckpoint) as info:
        CheckpointManager(tmp_path / "ckpt", new).check_compatible(path)
    msg = str(info.value)
    assert f"model.hidden_size: {old.model.hidden_size} → {new.model.hidden_size}" in msg
    g_old, g_new = old.grpo.num_generations_per_prompt, new.grpo.num_generations_per_prompt
    assert f"grpo.num_generations_per_prompt: {g_old} → {g_new}" in msg
    assert "checkpoint.resume=fresh" in msg and "name=" in msg


def test_a_resume_under_another_seed_is_refused(tmp_path):
    """grpo.seed orders the data of every epoch and seeds the default run's tiny model (its KL reference): at b11b41e
    a resume under another seed was a mere spec change, and epoch 1 trained some rows twice and others never. A
    checkpoint whose fingerprint predates the key is judged by its stored spec: the same seed resumes."""
    import json

    path = save(CheckpointManager(tmp_path / "ckpt", load_spec([])), 10)
    with pytest.raises(IncompatibleCheckpoint, match="grpo.seed: 0 → 1"):
        CheckpointManager(tmp_path / "ckpt", load_spec(["grpo.seed=1"])).check_compatible(path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["compat"]["grpo.seed"]  # as written before grpo.seed was a compat key
    (path / "meta.json").write_text(json.dumps(meta))
    CheckpointManager(tmp_path / "ckpt", load_spec([])).check_compatible(path)  # no raise
    with pytest.raises(IncompatibleCheckpoint, match="grpo.seed: 0 → 1"):
        CheckpointManager(tmp_path / "ckpt", load_spec(["grpo.seed=1"])).check_compatible(path)


def test_compatible_resume_accepts_changed_lr_and_steps(tmp_path):
    path = save(CheckpointManager(tmp_path / "ckpt", load_spec([])), 10)
    changed = load_spec(["train.lr=1e-5", "grpo.max_steps=50", "grpo.val_period=5"])
    CheckpointManager(tmp_path / "ckpt", changed).check_compatible(path)  # no raise


def test_a_model_folder_spelled_another_way_is_the_same_model(tmp_path, monkeypatch):
    """A resume with `model.path=my-model/` (tab completion's slash), `./my-model` or its absolute path was refused
    as an incompatible spec (`model.path: 'my-model' → 'my-model/'`), and the fix offered discards the training."""
    from helpers import tiny_model  # here: a subprocess below imports this module with tests/unit alone on its path

    monkeypatch.chdir(tmp_path)
    tiny = tiny_model()
    shutil.copytree(tiny, tmp_path / "my-model")
    path = save(CheckpointManager(tmp_path / "ckpt", load_spec(["model.path=my-model"])), 10)
    for spelled in ("my-model/", "./my-model", str(tmp_path / "my-model"), "../" + tmp_path.name + "/my-model"):
        CheckpointManager(tmp_path / "ckpt", load_spec([f"model.path={spelled}"])).check_compatible(path)
    shutil.copytree(tiny, tmp_path / "other-model")
    with pytest.raises(IncompatibleCheckpoint, match="model.path: 'my-model' → 'other-model'"):
        CheckpointManager(tmp_path / "ckpt", load_spec(["model.path=other-model"])).check_compatible(path)


def test_start_fresh_moves_aside(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", spec_with())
    assert mgr.start_fresh() is None  # nothing there yet
    save(mgr, 10)
    moved = mgr.start_fresh()
    assert moved is not None and moved.name.startswith("ckpt.old-")
    assert (moved / "step_000010" / "meta.json").is_file()
    assert not mgr.ckpt_dir.exists() and mgr.latest() is None
    save(mgr, 10)
    second = mgr.start_fresh()
    assert second != moved and moved.exists() and second.exists()  # never overwritten, never deleted


def test_a_resume_keeps_one_metrics_line_per_step(tmp_path):
    """Resuming from step 20 after a crash at step 26: the lines of steps 21-26 (lost work) and a torn last line
    go, so the resumed run's 21-26 are the only ones; the file is replaced whole, never half-written."""
    from grpo_launcher.train.setup import trim_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": k, "r": k / 10}) + "\n" for k in range(1, 27)) + '{"step": 27, "r"')
    trim_metrics(path, 20)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 21))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left behind
    trim_metrics(tmp_path / "absent.jsonl", 3)  # a run without metrics yet: nothing to do


def test_a_fresh_start_sets_aside_the_spec_change_log_with_the_other_records(tmp_path):
    from grpo_launcher.train.setup import set_aside_records

    for name in ("metrics.jsonl", "spec_changes.jsonl"):
        (tmp_path / name).write_text("{}\n")
    set_aside_records(tmp_path, tmp_path / "old")
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["metrics.jsonl", "spec_changes.jsonl"]
    assert not (tmp_path / "spec_changes.jsonl").exists()


# ------------------------------------------------------------------ optimizer state: the newest checkpoint's only


def write_full(d: Path) -> None:
    """What the workers write: weights, and optimizer files of both backends (torch's optim.pt, megatron's per rank)."""
    import torch

    (d / "policy").mkdir()
    (d / "policy" / "model.safetensors").write_bytes(b"w" * 4096)
    torch.save({"opt": {"state": {0: {"exp_avg": torch.ones(64)}}}, "sched": {"last_epoch": 3}}, d / "optim.pt")
    for rank in (0, 1):
        torch.save({"steps": 3, "opt": {"state": {}}}, d / f"megatron_optim_rank{rank}.pt")


OPTIM = ["megatron_optim_rank0.pt", "megatron_optim_rank1.pt", "optim.pt"]


def optimizer_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name in OPTIM)


def test_older_kept_checkpoints_lose_their_optimizer_state_and_still_verify(tmp_path):
    from grpo_launcher.checkpoint.manager import MANIFEST, has_optimizer, verify_checkpoint

    mgr = CheckpointManager(tmp_path / "ckpt", spec_with(keep_top_k=2))
    for step in (10, 20):
        mgr.save(step, write_full, {}, {})
    (mgr.ckpt_dir / ".tmp-manifest.json-step_000010-99999").write_text("{}")  # a strip killed before its rename
    mgr.save(30, write_full, {}, {})
    assert names(mgr.ckpt_dir) == ["step_000020", "step_000030"]  # the stale temp manifest went too
    old, new = mgr.ckpt_dir / "step_000020", mgr.ckpt_dir / "step_000030"
    assert optimizer_files(old) == [] and optimizer_files(new) == OPTIM
    assert verify_checkpoint(old) is None and verify_checkpoint(new) is None
    assert not has_optimizer(old) and has_optimizer(new)
    manifest = json.loads((old / MANIFEST).read_text())
    assert manifest["optimizer"] is False and sorted(manifest["dropped"]) == OPTIM
    assert "step_000030 holds the optimizer state" in manifest["optimizer_dropped"]
    assert sorted(manifest["files"]) == ["meta.json", "policy/model.safetensors"]
    (old / "optim.pt").write_bytes(b"x" * 10)  # a file planted where a dropped one was: refused
    assert "optim.pt was dropped from the manifest, but another file is there" in verify_checkpoint(old)


STRIP_SCRIPT = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_checkpoint import write_full
from grpo_launcher.checkpoint import CheckpointManager
from grpo_launcher.spec.schema import CheckpointSpec, RunSpec

mgr = CheckpointManager(Path(sys.argv[1]), RunSpec(checkpoint=CheckpointSpec(keep_top_k=2)))
for step in (2, 4):
    mgr.save(step, write_full, {}, {})
"""


@pytest.mark.parametrize("phase", ["after:rename", "after:prune", "after:unlist", "after:strip"])
def test_a_strip_killed_at_any_phase_leaves_both_checkpoints_verifying(tmp_path, phase):
    """SIGKILL at each phase boundary of step 4's save: both checkpoints verify; damaging step 4 falls back to step 2,
    whose strip the resume finishes (no optimizer file left where its manifest no longer lists one)."""
    import os
    import signal
    import subprocess
    import sys

    from grpo_launcher.checkpoint.manager import has_optimizer, verify_checkpoint

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, GRPO_FAULT_AT=f"{phase}@4")
    r = subprocess.run([sys.executable, "-c", STRIP_SCRIPT, str(ckpt), str(Path(__file__).parent)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    mgr = CheckpointManager(ckpt, spec_with(keep_top_k=2))
    assert [p.name for p in mgr.complete()] == ["step_000002", "step_000004"]
    assert all(verify_checkpoint(p) is None for p in mgr.complete())
    older = ckpt / "step_000002"
    assert has_optimizer(older) == (phase in ("after:rename", "after:prune"))
    assert optimizer_files(older) == ([] if phase == "after:strip" else OPTIM)
    (ckpt / "step_000004" / "optim.pt").write_bytes(b"torn")
    messages: list[str] = []
    assert mgr.resume_point(max_steps=10, say=messages.append) == older
    assert "step_000004 is not usable: optim.pt has 4 bytes" in messages[0]
    assert verify_checkpoint(older) is None
    assert optimizer_files(older) == ([] if not has_optimizer(older) else OPTIM)


def test_a_resume_from_a_checkpoint_without_optimizer_state_says_fresh_optimizer(tmp_path, capsys):
    from grpo_launcher.plan import make_plan
    from grpo_launcher.train.setup import resume_or_start

    spec = load_spec([f"output_root={tmp_path}", "name=opt", "logging.mlflow=false", "grpo.max_steps=8"])
    plan = make_plan(spec)
    plan.run_dir.mkdir(parents=True)
    mgr = CheckpointManager(plan.checkpoint_dir, spec)
    for step in (2, 4):
        mgr.save(step, write_full, {"mlflow_run_id": None}, {})
    (mgr.ckpt_dir / "step_000004" / "meta.json").write_text("{}")
    state = resume_or_start(spec, plan)
    out = capsys.readouterr().out
    assert state is not None and state.step == 2, out
    (line,) = [ln for ln in out.splitlines() if "fresh optimizer" in ln]
    assert line.startswith("grpo-launcher: step_000002 holds the weights but no optimizer state"), line
    assert "train.warmup_steps=0, starts over" in line, line


def test_the_torch_worker_loads_weights_only_with_a_fresh_optimizer(tmp_path):
    """A real TorchPolicyWorker's checkpoint after an optimizer step, its optim.pt dropped: another worker loads the
    weights bit-exactly and starts AdamW and the warm-up fresh; with optim.pt, it continues them."""
    import shutil

    import torch

    from grpo_launcher.models.tiny import build_model, build_tokenizer
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    spec = load_spec([f"output_root={tmp_path}", "logging.mlflow=false", "train.warmup_steps=4"])
    build_model(spec.model, build_tokenizer(), seed=0).save_pretrained(tmp_path / "model")
    trained = TorchPolicyWorker(spec, str(tmp_path / "model"), 0, 1)
    for p in trained.model.parameters():
        p.grad = torch.ones_like(p)
    trained.opt.step()
    trained.sched.step()
    trained.save(str(tmp_path / "full"))
    shutil.copytree(tmp_path / "full", tmp_path / "weights")
    (tmp_path / "weights" / "optim.pt").unlink()
    for name, steps in (("full", 1), ("weights", 0)):
        w = TorchPolicyWorker(spec, str(tmp_path / "model"), 0, 1)
        w.load(str(tmp_path / name))
        want = trained.model.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in w.model.state_dict().items()), name
        assert w.sched.last_epoch == steps and bool(w.opt.state) == bool(steps), name
        assert w.opt.param_groups[0]["lr"] == pytest.approx(spec.train.lr * (steps + 1) / 4), name


def test_a_megatron_distributed_optimizer_resume_says_fresh_optimizer(tmp_path):
    """Megatron's distributed optimizer state is not saved (preflight/disk.py counts none): every resume of such a
    run says it starts a fresh optimizer, even from the newest checkpoint, never silently."""
    from dataclasses import replace

    from grpo_launcher.spec.schema import TrainBackend
    from grpo_launcher.train.loop_state import distributed_optimizer_unsaved, fresh_optimizer_line

    spec = load_spec([f"output_root={tmp_path}", "name=dist", "logging.mlflow=false"])
    assert not distributed_optimizer_unsaved(spec)
    dist = replace(spec, train=replace(spec.train, backend=TrainBackend.megatron, distributed_optimizer=True))
    assert distributed_optimizer_unsaved(dist)
    line = fresh_optimizer_line(dist, tmp_path / "step_000004")
    assert "train.distributed_optimizer=true: megatron's sharded optimizer state is not saved" in line, line
    assert "fresh optimizer" in line and "fp32 master weights from the saved weights" in line, line
