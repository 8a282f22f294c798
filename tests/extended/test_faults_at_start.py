"""Faults pre-flight can see are config errors before anything starts (issue 43, items 5, 6, 11): real faults, not
mocks: a truncated file, a port nothing listens on, a read-only directory, a full tmpfs.

Pre-flight and dry runs go through launch.py's main in this process (nothing started)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import LAUNCH_PY, share_models, wait_until
from unit.test_faults_at_start import HOLD_LOCK, ROOT_ONLY, fill
from unit.test_faults_at_start import memcg, mounted  # noqa: F401  (fixtures)


@pytest.mark.slow
@pytest.mark.extended
def test_a_locked_store_is_one_warning_line_not_mlflows_traceback(tmp_path, capfd):
    """A store locked after the run opened it: the commit waits out sqlite's busy timeout (MLflow's 20 s), keeps
    the metrics and says so in one line (MLflow used to log the SQL error's 65-line traceback first)."""
    import sys

    from grpo_launcher.spec.schema import RunSpec
    from grpo_launcher.tracking import Tracker

    db = tmp_path / "mlflow.db"
    tracker = Tracker(RunSpec(), f"sqlite:///{db}", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capfd.readouterr()
        tracker.log_metrics(1, {"train/reward_mean": 0.5})
        assert tracker.commit() == 0 and tracker.pending()
    finally:
        holder.kill()
        holder.wait()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQLAlchemy database error" not in err and "[SQL:" not in err, err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert "database is locked" in line and "kept, sent at the next checkpoint" in line
    assert tracker.commit() == 1  # the lock gone: sent


def launch_then_fill(tmp_path: Path, mnt: Path, when: Path, lines: int, leave: int, *args: str):
    """`python launch.py output_root=MNT ARGS` (it passes pre-flight's disk-room rule); once `when` holds `lines`
    lines, another writer takes all of MNT's space but `leave` bytes. The launch's (rc, stdout, stderr)."""
    import sys

    proc = subprocess.Popen([sys.executable, str(LAUNCH_PY), f"output_root={mnt}", *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: when.is_file() and when.read_text().count("\n") >= lines or proc.poll() is not None,
                   timeout=400, what=f"{when} with {lines} line(s)", poll=0.05)
        assert proc.poll() is None, proc.communicate()
        fill(mnt, leave)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


@ROOT_ONLY
@pytest.mark.slow
@pytest.mark.extended
def test_a_disk_that_fills_at_the_checkpoint_ends_in_one_message(tmp_path, mounted):
    """The disk fills during start-up (after MLflow and the repro record) leaving 2 MiB: step 1 fits, its checkpoint
    (~6 MiB) does not. Before: 70 lines of chained tracebacks (a RayTaskError from the worker's save) ending in the
    ENOSPC; now one message naming the checkpoint's directory and the free space."""
    mnt = share_models(mounted(size="16m"))
    launches = mnt / "tiny-grpo" / "repro" / "launches.jsonl"
    rc, out, err = launch_then_fill(tmp_path, mnt, launches, 1, 2 << 20, "grpo.max_steps=2",
                                    "checkpoint.save_period=1", "checkpoint.metric=train/reward_mean")
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "During handling" not in err, err[-5000:]
    assert re_search(r"no space left on device writing the checkpoint at \S+ \(\d+\.\d MiB free\)", err), err
    assert "last checkpoint: none" in err and "MLflow run" in err and "free space there" in err
    lines = (mnt / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]  # whole lines only


@ROOT_ONLY
@pytest.mark.slow
@pytest.mark.extended
def test_a_disk_that_fills_between_checkpoints_ends_in_one_message_and_no_torn_line(tmp_path, mounted):
    """Another process fills output_root's disk after step 1 (before: a torn last line in metrics.jsonl, the MLflow
    run left RUNNING, 60-224 lines of tracebacks): one message naming the file and the free space."""
    mnt = share_models(mounted(size="16m"))
    metrics = mnt / "tiny-grpo" / "metrics.jsonl"
    rc, out, err = launch_then_fill(tmp_path, mnt, metrics, 1, 0, "grpo.max_steps=200", "checkpoint.save_period=100",
                                    "checkpoint.metric=train/reward_mean")
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "During handling" not in err, err[-5000:]
    assert re_search(r"no space left on device (writing|under) \S+ \(0\.0 MiB free\)", err), err[-3000:]
    assert "MLflow run" in err and ("marked FAILED" in err or "left RUNNING" in err), err[-3000:]
    assert all(json.loads(line)["step"] for line in metrics.read_text().splitlines())  # whole lines only


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


@pytest.mark.slow
@pytest.mark.extended
def test_an_actor_killed_by_the_oom_killer_reads_out_of_memory_in_the_drivers_wait(memcg):
    """A Ray actor moved into a 64 MiB memory cgroup allocates 512 MiB: the kernel kills it; the driver's wait
    (PhaseClock.get) raises ActorDied saying 'out of memory' (before: 'The actor died unexpectedly ...')."""
    import ray

    from grpo_launcher.deadlines import ActorDied, PhaseClock
    from grpo_launcher.spec.schema import DeadlinesSpec

    @ray.remote
    class Eater:
        def join(self, procs: str) -> int:
            Path(procs).write_text(str(os.getpid()))
            return os.getpid()

        def eat(self) -> int:
            x = bytearray(512 << 20)
            x[::4096] = b"1" * len(x[::4096])
            return len(x)

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        clock = PhaseClock(DeadlinesSpec(), None)
        eater = Eater.remote()
        clock.get("load", [eater.join.remote(str(memcg))], [eater])
        with pytest.raises(ActorDied, match=r"died in phase update of step 0: out of memory: .*oom_kill") as info:
            clock.get("update", [eater.eat.remote()], [eater])
        assert info.value.owner is eater
    finally:
        ray.shutdown()
