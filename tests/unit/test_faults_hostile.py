"""A second hostile tester's faults (after issue 43), each real: a read-only tmpfs as Ray's temp dir, a file-size
limit (RLIMIT_FSIZE) below Ray's object store, bytes that are not UTF-8 JSON in metrics.jsonl at a resume.
Each ended in a traceback (or Ray's start-up timeout) before; now one message naming the setting or the file, and
nothing lost."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from helpers import launch, share_models

from grpo_launcher.checkpoint import CheckpointManager
from grpo_launcher.disk_full import report
from grpo_launcher.exit_codes import ExitCode
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.schema import RunSpec
from grpo_launcher.tracking import Tracker
from grpo_launcher.tracking.mlflow_tracker import CLOSE_WAIT_S
from grpo_launcher.tracking.store import store_locked
from grpo_launcher.train.loop_state import LoopState
from grpo_launcher.train.setup import trim_metrics
from unit.test_faults_at_start import ROOT_ONLY, mounted  # noqa: F401  (fixture)


def launch_to_ray(tmp_path, env: dict | None = None, preexec=None) -> tuple[subprocess.CompletedProcess, float]:
    """`python launch.py` (one step, the tiny model shared) in a subprocess: what it printed and how long it took."""
    share_models(tmp_path)
    args = [f"output_root={tmp_path}", "grpo.max_steps=1", "logging.progress=false"]
    t0 = time.monotonic()
    if preexec is None:
        run = launch(*args, cwd=tmp_path, env=env, timeout=300)
    else:
        import sys

        from helpers import LAUNCH_PY

        run = subprocess.run([sys.executable, str(LAUNCH_PY), *args], capture_output=True, text=True, cwd=tmp_path,
                             timeout=300, preexec_fn=preexec)
    return run, time.monotonic() - t0


@ROOT_ONLY
def test_a_read_only_ray_temp_dir_is_one_message_naming_ray_tmpdir(tmp_path):

    mnt = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's AF_UNIX socket paths
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)]).returncode != 0:
        mnt.rmdir()
        pytest.skip("mount -t tmpfs failed")
    try:
        run, _ = launch_to_ray(tmp_path, env={"RAY_TMPDIR": str(mnt)})
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
        shutil.rmtree(mnt, ignore_errors=True)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"Ray cannot write its temp dir {mnt}/ray (from RAY_TMPDIR): Read-only file system" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    status = json.loads((tmp_path / "tiny-grpo" / "status.json").read_text())
    assert status["state"] == "FAILED" and "RAY_TMPDIR" in status["message"]


def test_a_ray_temp_dir_too_long_for_its_sockets_is_named(tmp_path):
    """RAY_TMPDIR under a deep directory: Ray died with 'OSError: validate_socket_filename failed: AF_UNIX path
    length cannot exceed 107 bytes' and a traceback; now one line naming RAY_TMPDIR before Ray starts."""
    deep = tmp_path / ("d" * 60)
    run, _ = launch_to_ray(tmp_path, env={"RAY_TMPDIR": str(deep)})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"Ray's temp dir {deep}/ray (from RAY_TMPDIR) is" in run.stderr and "Traceback" not in run.stderr


def test_a_file_size_limit_below_the_object_store_is_named_not_a_ray_timeout(tmp_path):
    limit = 8 << 20  # 8 MiB: room for the run's own files, not for Ray's 256 MiB object store

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run, took = launch_to_ray(tmp_path, preexec=small_files)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert "ulimit -f: 8.0 MiB" in run.stderr and "cluster.object_store_memory_mb=256" in run.stderr
    assert "Traceback" not in run.stderr and "timed out during startup" not in run.stderr


def test_resume_moves_lines_that_are_not_utf8_json_aside_and_keeps_the_rest(tmp_path, capsys):

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "train/reward_mean": s / 10}) for s in (1, 2, 3, 4)]
    garbage = b'{"step": 3, "train/rew\xff\xfe\x00 a disk block of another file'
    path.write_bytes(("\n".join(good[:2]) + "\n").encode() + garbage + b"\n" + ("\n".join(good[2:]) + "\n").encode()
                     + b'{"step": 5, "tr\xc3')  # a torn last line, cut inside a UTF-8 character
    trim_metrics(path, 3)  # was: UnicodeDecodeError, the resume crashed
    assert path.read_text().splitlines() == good[:3]
    aside = tmp_path / "metrics.jsonl.unreadable"
    assert aside.read_bytes() == garbage + b"\n"
    assert f"1 line(s) that are not JSON moved to {aside}" in capsys.readouterr().out


@ROOT_ONLY
def test_a_read_only_checkpoint_dir_is_one_message_naming_the_file(tmp_path, mounted, capsys):  # noqa: F811
    """A real EROFS from a real save (the checkpoint dir remounted read-only after the first checkpoint): the
    driver's catch-all gets one message naming the file, the last checkpoint and the fix (was: a traceback)."""

    mnt = mounted(size="1m")
    spec = RunSpec(output_root=str(tmp_path))
    state = LoopState(spec, make_plan(spec), CheckpointManager(mnt / "store", spec), tracker=None, step=10)
    state.ckpt.save(10, lambda d: (d / "policy.bin").write_bytes(b"w" * 64), {}, {})
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    with pytest.raises(OSError) as info:
        state.ckpt.save(20, lambda d: (d / "policy.bin").write_bytes(b"w" * 64), {}, {})
    assert report(info.value, state, tmp_path) == ExitCode.FAILED
    err = capsys.readouterr().err
    assert f"grpo-launcher: Read-only file system: {mnt}/store/.tmp-step_000020-" in err, err
    assert f"last completed step: 10; last checkpoint: {mnt}/store/step_000010" in err
    assert "make it writable (mount read-write, or chmod), then launch the same command again: it resumes" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 3


@pytest.mark.parametrize("where", ["output_root", "logging.tracking_uri"])
def test_a_store_file_that_is_not_sqlite_is_a_config_error_naming_it(launch_here, tmp_path, where):
    """An mlflow.db overwritten with other bytes: a config error naming the file and the key before anything starts
    (was: sqlite3.DatabaseError's traceback from the start-up line, even in a dry run)."""
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 16)  # a file of another kind under its name
    more = [f"logging.tracking_uri=sqlite:///{db}"] if where == "logging.tracking_uri" else []
    run = launch_here(tmp_path, f"output_root={tmp_path}", "grpo.max_steps=1", *more)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{db} is not a SQLite database" in run.stderr and where in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "tiny-grpo" / "status.json").exists()


def test_a_locked_check_of_a_file_that_is_not_sqlite_does_not_raise(tmp_path):

    (tmp_path / "mlflow.db").write_bytes(b"not a database at all" * 100)
    assert store_locked(f"sqlite:///{tmp_path / 'mlflow.db'}") is False


def test_a_store_damaged_mid_run_is_named_and_the_close_does_not_wait_for_it(tmp_path, capfd):
    """The sqlite store's pages overwritten while the run holds it (a disk error, a copy over it): the warning names
    the damage (was: 'unreachable (MlflowException: (raised as a result of Query-invoked autoflush ...)'), and the
    end of the run does not retry for CLOSE_WAIT_S (120 s) a store no retry brings back; the metrics are kept."""


    db = tmp_path / "mlflow.db"
    tracker = Tracker(RunSpec(), f"sqlite:///{db}", tmp_path)
    tracker.log_metrics(1, {"train/reward_mean": 0.5})
    assert tracker.commit() == 1
    with open(db, "r+b") as f:  # every page but the first (the header and the schema): MLflow's tables
        f.seek(4096)
        f.write(os.urandom(db.stat().st_size - 4096))
    capfd.readouterr()
    tracker.log_metrics(2, {"train/reward_mean": 0.6})
    assert tracker.commit() == 0 and tracker.pending()
    t0 = time.monotonic()
    tracker.close("FINISHED")
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert "damaged: move it aside" in err and "database disk image is malformed" in err, err
    assert "not closed: its store is damaged" in err and took < CLOSE_WAIT_S / 4, (took, err)
