"""Faults and security (issue 12), on real files, real processes and real signals.

Fast tier: checkpoint verification (truncated / missing / overwritten files, bad or missing meta.json, a step
beyond max_steps, a crafted pickle that would run code) with fallback to the newest valid checkpoint; secrets
redacted in spec.yaml / plan / MLflow params and kept in 0600 files; the per-run lock (two launches at once:
exactly one wins; a live holder is named; a dead one is taken over); disk-full messages.
Slow tier: a save killed with SIGKILL at every phase boundary, then resumed: MLflow has every step exactly once;
the real driver signalled with SIGTERM / SIGINT / SIGUSR1 after ray.init(): it checkpoints the step it was on
and exits 143 / 130 / 3, and the resumed run logs every step exactly once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_launcher.checkpoint import CheckpointManager, CheckpointRefused, verify_checkpoint
from grpo_launcher.checkpoint.manager import MANIFEST, META
from grpo_launcher.spec.schema import CheckpointSpec, RunSpec


PY = sys.executable


# ------------------------------------------------------------------ checkpoint integrity


def write_payload(d: Path) -> None:
    import torch

    (d / "policy").mkdir()
    (d / "policy" / "model.safetensors").write_bytes(os.urandom(4096))
    torch.save({"opt": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
                "sched": {"last_epoch": 3}}, d / "optim.pt")


def saved(tmp_path: Path, steps=(10, 20), keep: int = 5) -> CheckpointManager:
    mgr = CheckpointManager(tmp_path / "ckpt", RunSpec(checkpoint=CheckpointSpec(keep_top_k=keep)))
    for s in steps:
        mgr.save(s, write_payload, {"mlflow_run_id": None}, {})
    return mgr


def test_manifest_written_last_lists_sizes_and_hashes(tmp_path):
    mgr = saved(tmp_path, steps=(10,))
    path = mgr.latest()
    manifest = json.loads((path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"policy/model.safetensors", "optim.pt", META}
    assert manifest["files"]["optim.pt"]["size"] == (path / "optim.pt").stat().st_size
    assert re.fullmatch(r"[0-9a-f]{64}", manifest["files"]["optim.pt"]["sha256"])
    assert verify_checkpoint(path) is None
    assert mgr.resume_point(max_steps=100) == path


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:100])


def overwrite_256(p: Path) -> None:
    with open(p, "r+b") as f:
        f.seek(1024)
        f.write(b"\xff" * 256)  # same size: only the hash can tell


def bad_meta(p: Path) -> None:
    (p / META).write_text("{not json")


def meta_step_999(p: Path) -> None:
    meta = json.loads((p / META).read_text())
    meta["step"] = 999
    (p / META).write_text(json.dumps(meta))


@pytest.mark.parametrize("damage,expect", [
    (lambda p: truncate(p / "optim.pt"), r"optim\.pt has 100 bytes, the manifest says \d+ \(truncated"),
    (lambda p: (p / "policy" / "model.safetensors").unlink(), r"policy/model\.safetensors is missing"),
    (lambda p: overwrite_256(p / "policy" / "model.safetensors"), r"model\.safetensors does not match its sha256"),
    (lambda p: (p / MANIFEST).unlink(), r"manifest\.json is missing"),
    (lambda p: (p / META).unlink(), r"meta\.json is missing"),
    (bad_meta, r"meta\.json has 9 bytes, the manifest says \d+"),
    (meta_step_999, r"meta\.json (has \d+ bytes|does not match its sha256)"),
], ids=["truncated", "missing-file", "overwritten-256-bytes", "no-manifest", "no-meta", "bad-meta", "meta-step-999"])
def test_damaged_newest_checkpoint_falls_back_naming_the_problem(tmp_path, damage, expect):
    mgr = saved(tmp_path)
    newest = mgr.latest()
    damage(newest)
    messages: list[str] = []
    chosen = mgr.resume_point(max_steps=100, say=messages.append)
    assert chosen is not None and chosen.name == "step_000010"
    (msg,) = messages
    assert str(newest) in msg and re.search(expect, msg), msg
    assert "falling back" in msg
    assert not newest.exists() and list(mgr.ckpt_dir.glob(".invalid-step_000020-*"))  # kept aside, never loaded
    assert [p.name for p in mgr.complete()] == ["step_000010"]


def test_meta_naming_another_step_is_refused_even_with_a_matching_manifest(tmp_path):
    from grpo_launcher.checkpoint.manager import write_manifest

    mgr = saved(tmp_path, steps=(10, 20))
    meta_step_999(mgr.latest())
    write_manifest(mgr.latest())  # a consistent forgery of the manifest
    assert "meta.json says step 999 but the directory is step_000020" in verify_checkpoint(mgr.latest())


def test_step_beyond_max_steps_is_refused(tmp_path):
    mgr = saved(tmp_path, steps=(10, 20))
    with pytest.raises(CheckpointRefused, match=r"step 20, beyond grpo.max_steps=15.*checkpoint.resume=fresh"):
        mgr.resume_point(max_steps=15)
    assert mgr.resume_point(max_steps=20).name == "step_000020"  # == max_steps: the run is done, not refused


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickle_in_optim_file_never_runs(tmp_path):
    from grpo_launcher.checkpoint.manager import write_manifest

    mgr = saved(tmp_path, steps=(10, 20))
    marker = tmp_path / "pwned"
    newest = mgr.latest()
    with open(newest / "optim.pt", "wb") as f:
        pickle.dump({"opt": Payload(str(marker))}, f)
    write_manifest(newest)  # the attacker rewrote the manifest too: only the content check can stop it
    messages: list[str] = []
    chosen = mgr.resume_point(max_steps=100, say=messages.append)
    assert not marker.exists(), "the crafted pickle ran code"
    assert chosen.name == "step_000010"
    assert "optim.pt is not plain tensor state" in messages[0] and "weights_only=True" in messages[0]


def test_every_checkpoint_invalid_starts_fresh_with_messages(tmp_path):
    mgr = saved(tmp_path, steps=(10, 20))
    for p in mgr.complete():  # the weights: every checkpoint has them (only the newest keeps optim.pt)
        (p / "policy" / "model.safetensors").unlink()
    messages: list[str] = []
    assert mgr.resume_point(max_steps=100, say=messages.append) is None
    assert len(messages) == 2


def test_disk_full_names_the_path_and_free_space(tmp_path):
    import errno

    mgr = CheckpointManager(tmp_path / "ckpt", RunSpec())

    def full(d: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        mgr.save(10, full, {}, {})
    assert info.value.errno == errno.ENOSPC
    assert re.search(rf"no space left on device writing the checkpoint at {re.escape(str(mgr.ckpt_dir))} "
                     r"\(\d+\.\d MiB free\)", str(info.value))
    assert list(mgr.ckpt_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_disk_full_for_real_on_a_tiny_tmpfs(tmp_path):
    import torch

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t tmpfs failed")
    try:
        mgr = CheckpointManager(mnt / "ckpt", RunSpec())

        def big(d: Path) -> None:
            torch.save({"w": torch.zeros(1 << 20)}, d / "optim.pt")  # 4 MiB into 256 KiB

        with pytest.raises(OSError, match=rf"no space left on device writing the checkpoint at {re.escape(str(mnt))}"):
            mgr.save(10, big, {}, {})
        assert list((mnt / "ckpt").iterdir()) == []  # the partial write is gone
    finally:
        subprocess.run(["umount", str(mnt)])


# ------------------------------------------------------------------ secrets


SECRET_URI = "postgresql://mluser:hunter2-s3cret@db.example:5432/mlflow"


def test_secrets_redacted_in_spec_yaml_plan_and_params_kept_0600(tmp_path):
    from grpo_launcher.launch import rundir
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.tracking.mlflow_tracker import flat_params
    from grpo_launcher.checkpoint.manager import spec_as_dict

    spec = load_spec([f"output_root={tmp_path}", f"logging.tracking_uri={SECRET_URI}", "rollout.http_api_key=k-9a8b"])
    plan = make_plan(spec)
    assert "hunter2" not in plan.summary() and "mluser:***@db.example" in plan.summary()
    run_dir = rundir.prepare(spec, plan)
    text = (run_dir / "spec.yaml").read_text()
    assert "hunter2" not in text and "k-9a8b" not in text and "mluser:***@db.example" in text
    assert (run_dir / "spec.yaml").stat().st_mode & 0o777 == 0o600
    assert (run_dir / ".secrets.json").stat().st_mode & 0o777 == 0o600
    assert run_dir.stat().st_mode & 0o777 == 0o700 and (run_dir / "logs").stat().st_mode & 0o777 == 0o700
    back = rundir.load_spec_file(run_dir / "spec.yaml")  # what the job reads: the real values again
    assert back.logging.tracking_uri == SECRET_URI and back.rollout.http_api_key == "k-9a8b"
    params = flat_params(spec_as_dict(spec))
    assert "hunter2" not in json.dumps(params) and params["rollout.http_api_key"] == "***"


def test_secrets_redacted_in_checkpoint_meta_and_repro_command_lines(tmp_path):
    """A checkpoint's meta.json (0644) kept the whole spec, and repro/git.json + launches.jsonl the command line,
    with the credential in clear (then copied into MLflow's artifacts). Now *** there too, and a resume under the
    same credential records no change."""
    from grpo_launcher.checkpoint import CheckpointManager
    from grpo_launcher.checkpoint.manager import spec_changes
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.tracking.repro import write_repro

    over = [f"output_root={tmp_path}", f"logging.tracking_uri={SECRET_URI}", "rollout.http_api_key=k-9a8b"]
    spec = load_spec(over)
    mgr = CheckpointManager(tmp_path / "ckpt", spec)
    (tmp_path / "m").mkdir()
    mgr.write_meta(tmp_path / "m", 1, {}, {})
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert "k-9a8b" not in json.dumps(meta) and "hunter2" not in json.dumps(meta)
    assert meta["spec"]["rollout"]["http_api_key"] == "***"
    assert spec_changes(meta, spec) == {}
    out = write_repro(spec, tmp_path / "run", argv=["launch.py", *over])
    for f in ("git.json", "launches.jsonl"):
        text = (out / f).read_text()
        assert "k-9a8b" not in text and "hunter2" not in text and "rollout.http_api_key=***" in text, f


def test_http_api_key_generated_per_run():
    from grpo_launcher.secrets import with_http_api_key
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec(["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true"])
    a, b = with_http_api_key(spec), with_http_api_key(spec)
    assert len(a.rollout.http_api_key) >= 32 and a.rollout.http_api_key != b.rollout.http_api_key
    off = load_spec(["rollout=vllm", "rollout.async_engine=true", "rollout.expose_http_server=true",
                     "rollout.http_api_key=''"])
    assert with_http_api_key(off).rollout.http_api_key == ""  # explicitly none


# ------------------------------------------------------------------ the run lock


def _take(run_dir: str, barrier, out) -> None:
    from grpo_launcher.launch.rundir import RunBusy, acquire_run_lock

    barrier.wait()
    try:
        acquire_run_lock(Path(run_dir), "local")
        out.put(("won", os.getpid()))
        time.sleep(3)  # hold it (alive) while the others look
    except RunBusy as exc:
        out.put(("refused", str(exc)))


def test_two_launches_at_once_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_take, args=(str(tmp_path / "run"), barrier, out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    won = [r for r in results if r[0] == "won"]
    assert len(won) == 1, results
    for kind, msg in results:
        if kind == "refused":
            assert msg == f"a local run (pid {won[0][1]} on {os.uname().nodename})"


def test_dead_holder_is_taken_over_and_release_is_by_owner(tmp_path):
    from grpo_launcher.launch.rundir import LOCK, acquire_run_lock, read_lock, release_run_lock

    child = subprocess.Popen([PY, "-c", "pass"])
    child.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_text(json.dumps({"owner": "local", "pid": child.pid, "host": os.uname().nodename}))
    acquire_run_lock(run_dir, "local")
    assert read_lock(run_dir)["pid"] == os.getpid()
    assert (run_dir / LOCK).stat().st_mode & 0o777 == 0o600
    assert not release_run_lock(run_dir, job_id="123")  # not that job's lock
    assert release_run_lock(run_dir) and not (run_dir / LOCK).exists()


def test_a_copy_of_a_live_run_is_not_held_by_the_originals_lock(tmp_path):
    """`cp -a OUT/live OUT/livecopy` mid-run: the copy's .run.lock named the original's live pid, and a launch of the
    copy was refused ('already in use by a local run') until the original ended. This process is the live holder."""
    import shutil

    from grpo_launcher.launch.rundir import RunBusy, acquire_run_lock, live_holder, read_lock, release_run_lock

    live, copy = tmp_path / "live", tmp_path / "livecopy"
    acquire_run_lock(live, "local")
    shutil.copytree(live, copy)
    assert live_holder(read_lock(copy)) is None  # the original's holder is not the copy's
    taken = acquire_run_lock(copy, "local")  # the copy's launch takes the lock over
    assert read_lock(copy) == taken and taken["run_dir"] == str(copy.resolve())
    with pytest.raises(RunBusy):  # the original stays held by its own live run
        acquire_run_lock(live, "local")
    assert release_run_lock(copy) and release_run_lock(live)


# ------------------------------------------------------------------ the sweep's MLflow parent run


def test_sweep_parent_run_is_ended_finished_or_failed(tmp_path):
    from mlflow.tracking import MlflowClient

    from grpo_launcher.launch.sweep import end_sweep_parent_run, sweep_parent_run
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec([f"output_root={tmp_path}", "logging.experiment=h12-sweep"])
    sweep_dir = tmp_path / "multirun" / "s1"
    sweep_dir.mkdir(parents=True)
    run_id = sweep_parent_run(spec, sweep_dir)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "RUNNING"
    assert end_sweep_parent_run(spec, sweep_dir, ok=True) == "FINISHED"
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sweep_parent_run(spec, sweep_dir) == run_id  # continued (Optuna's next batch): running again
    assert client.get_run(run_id).info.status == "RUNNING"
    assert end_sweep_parent_run(spec, sweep_dir, ok=False) == "FAILED"
    assert client.get_run(run_id).info.status == "FAILED"


def test_backslash_in_a_slurm_run_dir_is_a_config_error(tmp_path):
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.spec.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_spec(["cluster=local_slurm", f"output_root={tmp_path}/a\\\\b"])
    assert any(v.rule == "slurm_log_paths" and "output_root" in v.keys for v in info.value.violations)
