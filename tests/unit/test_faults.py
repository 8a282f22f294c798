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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_launcher.checkpoint import CheckpointManager, CheckpointRefused, verify_checkpoint
from grpo_launcher.checkpoint.manager import MANIFEST, META
from grpo_launcher.spec.schema import CheckpointSpec, RunSpec

from helpers import ROOT, share_models, wait_until

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
    for p in mgr.complete():
        (p / "optim.pt").unlink()
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


# ------------------------------------------------------------------ kill at every phase boundary of a save

MINI_LOOP = r"""
import sys
from pathlib import Path
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.train.setup import resume_or_start

spec = load_spec(sys.argv[1:])
plan = make_plan(spec)
plan.run_dir.mkdir(parents=True, exist_ok=True)
state = resume_or_start(spec, plan)
for step in range(state.step + 1, spec.grpo.max_steps + 1):
    state.log(step, {"train/x": float(step), "train/y": 2.0 * step})
    if step % spec.checkpoint.save_period == 0 or step == spec.grpo.max_steps:
        state.save_checkpoint(step, lambda d: (d / "policy.bin").write_bytes(b"w" * 64), {"train/x": float(step)})
state.finish("FINISHED")
print("done at", state.step)
"""
PHASES = ["after:payload", "after:meta", "after:manifest", "after:fsync", "after:rename", "after:prune",
          "after:commit"]


def mlflow_steps(uri: str, name: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("h12-faults")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, key))


@pytest.mark.slow
@pytest.mark.parametrize("phase", [p if p == "after:rename" else pytest.param(p, marks=pytest.mark.extended)
                                   for p in PHASES])  # make test: the phase whose checkpoint is in place, unfinished
def test_kill_at_every_save_phase_then_resume_logs_each_step_once(tmp_path, phase):
    name = f"h12-kill-{phase.split(':')[1]}"
    args = [f"output_root={tmp_path}", f"name={name}", "grpo.max_steps=6", "checkpoint.save_period=2", "grpo.val_period=2",
            "logging.experiment=h12-faults", "logging.progress=false"]
    env = dict(os.environ, GRPO_FAULT_AT=f"{phase}@4")
    first = subprocess.run([PY, "-c", MINI_LOOP, *args], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    env.pop("GRPO_FAULT_AT")
    second = subprocess.run([PY, "-c", MINI_LOOP, *args], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "done at 6" in second.stdout, second.stderr[-2000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for key in ("train/x", "train/y"):
        assert mlflow_steps(uri, name, key) == [1, 2, 3, 4, 5, 6], (phase, key, second.stdout)
    resumed_from = re.search(r"resuming from step_(\d+)", second.stdout)
    visible = phase in ("after:rename", "after:prune", "after:commit")  # step 4's checkpoint was in place
    assert resumed_from and int(resumed_from.group(1)) == (4 if visible else 2), second.stdout
    if phase in ("after:rename", "after:prune"):
        assert "replayed" in second.stdout  # its metrics came from the checkpoint, not from a second run


# ------------------------------------------------------------------ the real driver, real signals


def run_cmd(tmp_path: Path, name: str, steps: int, *extra: str) -> list[str]:
    share_models(tmp_path)
    return [PY, "-u", str(ROOT / "launch.py"), f"output_root={tmp_path}", f"name={name}", f"grpo.max_steps={steps}",
            "checkpoint.save_period=1000", "grpo.val_period=0", "grpo.val_at_end=false", "checkpoint.metric=train/reward_mean",
            "logging.experiment=h12-faults", "logging.progress=true", *extra]


@pytest.mark.slow
@pytest.mark.extended  # make test: test_golden_run.py stops a run with SIGTERM (launch.py cancel) and resumes it
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 3)],
                         ids=["SIGTERM", "SIGINT", "SIGUSR1"])
def test_driver_signal_after_ray_init_saves_and_exits_with_its_code(tmp_path, sig, code):
    name = f"h12-sig-{sig.name.lower()}"
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(run_cmd(tmp_path, name, 40), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    try:
        m = wait_until(lambda: re.search(r"^step (\d+)/40", log.read_text(), re.M) or proc.poll() is not None,
                       900, "the first step")  # Ray start-up on a loaded 2-core machine: minutes
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(sig)  # the driver's pid only (Ray's processes are not signalled)
        rc = proc.wait(timeout=600)
        text = log.read_text()
        assert rc == code, text[-3000:]
        stopped = int(re.search(rf"stopped after step (\d+) \({sig.name}\); checkpoint saved", text).group(1))
        assert stopped >= int(m.group(1)) and stopped < 40
        ckpts = sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir())
        assert ckpts == [f"step_{stopped:06d}"], ckpts
        assert verify_checkpoint(tmp_path / name / "checkpoints" / ckpts[0]) is None
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "KILLED" and summary["step"] == stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the resumed run (fewer steps left) starts at stopped + 1, and MLflow has each step once
    total = stopped + 2
    again = subprocess.run(run_cmd(tmp_path, name, total), capture_output=True, text=True, cwd=ROOT, timeout=1200,
                           start_new_session=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from step_{stopped:06d}" in again.stdout
    steps = mlflow_steps(f"sqlite:///{tmp_path / 'mlflow.db'}", name, "train/reward_mean")
    assert steps == list(range(1, total + 1))


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
