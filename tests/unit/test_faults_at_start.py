"""Faults pre-flight can see are config errors before anything starts (issue 43, items 5, 6, 11): real faults, not
mocks: a truncated file, a port nothing listens on, a read-only directory, a full tmpfs.

Pre-flight and dry runs go through launch.py's main in this process (nothing started)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from helpers import launch, wait_until

QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "vocab_size": 512, "tie_word_embeddings": True}
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


# ----------------------------------------------------------------------------- model.safetensors
def model_dir(path: Path) -> Path:
    """An HF model directory (config.json, tokenizer stubs) whose model.safetensors is real and complete."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(QWEN2))
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>", "pad_token": "<p>"}))
    save_file({"embed.weight": torch.zeros(512, 64), "norm.weight": torch.ones(64)}, str(path / "model.safetensors"))
    return path


def dry_run(launch_here, tmp_path: Path, d: Path, *more: str):
    return launch_here(tmp_path, f"model.path={d}", f"output_root={tmp_path}", "train.max_total_sequence_length=64",
                       "dry_run=true", *more)


def test_complete_safetensors_passes(tmp_path, launch_here):
    run = dry_run(launch_here, tmp_path, model_dir(tmp_path / "m"))
    assert run.returncode == 0, run.stderr


def test_truncated_safetensors_is_a_config_error_naming_the_file(tmp_path, launch_here):
    d = model_dir(tmp_path / "m")
    file = d / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)  # a copy that stopped half-way
    run = dry_run(launch_here, tmp_path, d)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "config error" in run.stderr and "model.path" in run.stderr
    assert str(file) in run.stderr and "truncated" in run.stderr and "Traceback" not in run.stderr


def test_a_header_claiming_4_eib_is_a_config_error(tmp_path, launch_here):
    d = model_dir(tmp_path / "m")
    file = d / "model.safetensors"
    with open(file, "r+b") as f:
        f.write(struct.pack("<Q", 4 << 60))
    run = dry_run(launch_here, tmp_path, d)
    assert run.returncode == 2 and str(file) in run.stderr and "4,611,686,018,427,387,904" in run.stderr, run.stderr


def test_offsets_past_the_end_and_missing_shards_are_named(tmp_path):
    from grpo_launcher.preflight.safetensors_check import header_problem, missing_shards

    f = tmp_path / "x.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)  # 8 of the 16 bytes the header claims
    assert "ends at byte 16 of the data but the file holds 8" in header_problem(f)
    f.write_bytes(struct.pack("<Q", len(header)) + header[:-3] + b"   " + b"\0" * 16)
    assert "not valid JSON" in header_problem(f)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-2-of-2.safetensors"}}))
    assert missing_shards(tmp_path) == ["model-2-of-2.safetensors"]


# ----------------------------------------------------------------------------- the MLflow store
@pytest.fixture
def mounted(tmp_path):
    """mount(size, read_only=False) → a real tmpfs under tmp_path (unmounted at teardown)."""
    mounts: list[Path] = []

    def mount(size: str = "1m", read_only: bool = False, name: str = "mnt") -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]).returncode != 0:
            pytest.skip("mount -t tmpfs failed")
        mounts.append(mnt)
        (mnt / "store").mkdir()
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        return mnt

    yield mount
    for mnt in reversed(mounts):
        subprocess.run(["umount", "-l", str(mnt)])


def launch_for_real(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`python launch.py` (no dry run) in a subprocess: what it printed, and how long it took."""
    t0 = time.monotonic()
    run = launch(f"output_root={tmp_path}", "grpo.max_steps=1", *args, cwd=tmp_path, env=env, timeout=120)
    return run, time.monotonic() - t0


def test_an_unreachable_http_store_is_a_config_error_in_seconds(tmp_path):
    """MLFLOW_TRACKING_URI at a port nothing listens on: exit 2 naming the variable, before Ray or a worker."""
    run, took = launch_for_real(tmp_path, env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert "MLFLOW_TRACKING_URI" in run.stderr and "http://127.0.0.1:9" in run.stderr and "unreachable" in run.stderr
    assert "Traceback" not in run.stderr and "ray" not in run.stdout.lower() and took < 60
    assert not (tmp_path / "tiny-grpo" / "status.json").exists()  # nothing started


@ROOT_ONLY
def test_a_read_only_sqlite_store_is_a_config_error(tmp_path, mounted):
    mnt = mounted(read_only=True)
    run, took = launch_for_real(tmp_path, f"logging.tracking_uri=sqlite:///{mnt}/store/mlflow.db")
    assert run.returncode == 2 and took < 60, run.stdout[-2000:] + run.stderr[-2000:]
    assert "logging.tracking_uri" in run.stderr and f"{mnt}/store is not writable" in run.stderr, run.stderr


def test_store_problems_from_a_real_directory_port_and_file(tmp_path):
    from grpo_launcher.tracking.store import store_problem

    assert store_problem(f"sqlite:///{tmp_path}/new/dir/mlflow.db") is None  # MLflow makes the missing dirs
    (tmp_path / "f").write_text("")
    assert "is not a directory" in store_problem(f"sqlite:///{tmp_path}/f/mlflow.db")
    assert store_problem("postgresql://u:p@db.example:5432/db") is None  # left to MLflow (a cluster-only host?)
    assert "unreachable" in store_problem("http://127.0.0.1:9/prefix/")


HOLD_LOCK = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute('BEGIN EXCLUSIVE')
print('held', flush=True)
time.sleep(120)
"""


@pytest.fixture
def locked_store(tmp_path):
    """A sqlite store (tables made) that another process holds an exclusive lock on until teardown."""
    import sys

    import sqlite3

    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("create table t (x)")
    con.close()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield f"sqlite:///{db}"
    holder.kill()
    holder.wait()


def test_a_locked_store_is_said_to_buffer_at_start(tmp_path, locked_store):
    from grpo_launcher.spec.schema import LoggingSpec, RunSpec
    from grpo_launcher.tracking.store import tracking_line

    spec = RunSpec(logging=LoggingSpec(tracking_uri=locked_store))
    assert "locked by another process now: this run's metrics are buffered" in tracking_line(spec, locked_store)


# ----------------------------------------------------------------------------- a full disk
def fill(folder: Path, leave: int = 0) -> Path:
    """Take `folder`'s filesystem's space but `leave` bytes (0: write until a real ENOSPC); the filler file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        if leave:
            st = os.statvfs(folder)
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - leave)
            return filler
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == 28, exc
    finally:
        os.close(fd)
    return filler


@ROOT_ONLY
def test_metrics_line_on_a_full_disk_is_whole_or_absent_and_named(tmp_path, mounted):
    from grpo_launcher.runfiles import append_line

    mnt = mounted(size="256k")
    path = mnt / "metrics.jsonl"
    append_line(path, json.dumps({"step": 1, "train/loss": 0.5}))
    fill(mnt)
    before = path.read_bytes()
    with pytest.raises(OSError) as info:
        append_line(path, json.dumps({"step": 2, **{f"m{i}": 0.1 * i for i in range(2000)}}))  # > a page
    assert info.value.errno == 28 and f"no space left on device writing {path} (0.0 MiB free)" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one message, no chain
    assert path.read_bytes() == before  # never a torn last line
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


@ROOT_ONLY
def test_disk_full_report_is_one_message_naming_the_file(tmp_path, mounted, capsys):
    from grpo_launcher import disk_full
    from grpo_launcher.runfiles import append_line

    mnt = mounted(size="128k")
    fill(mnt)
    for write in (lambda: append_line(mnt / "metrics.jsonl", "x" * 9000), lambda: (mnt / "o.pt").write_bytes(b"0" * 9000)):
        try:
            try:
                write()
            except OSError as exc:
                raise RuntimeError("the write failed") from exc  # as a caller wraps it
        except RuntimeError as wrapped:
            assert disk_full.report(wrapped, None, mnt) == 1
    ours, python = capsys.readouterr().err.split("grpo-launcher: ")[1:]
    assert ours.startswith(f"no space left on device writing {mnt}/metrics.jsonl (0.0 MiB free)")
    assert python.startswith(f"no space left on device under {mnt} (0.0 MiB free): [Errno 28] No space left")
    assert "Traceback" not in ours + python and "no MLflow run" in ours
    assert disk_full.message(ValueError("not a disk"), mnt) is None
    worker = RuntimeError("ray::PolicyWorker.save() ...\nOSError: [Errno 28] No space left on device: '/x/y/optim.pt'")
    assert disk_full.message(worker, mnt).startswith("no space left on device writing /x/y/optim.pt (")


# ----------------------------------------------------------------------------- a second launch of a live run
def test_a_refused_duplicate_launch_does_not_print_its_plan_first(tmp_path, launch_here):
    from grpo_launcher.launch.rundir import acquire_run_lock, release_run_lock

    run_dir = tmp_path / "tiny-grpo"
    acquire_run_lock(run_dir, "local")  # held by this (live) process, as a running launch holds it
    try:
        run = launch_here(tmp_path, f"output_root={tmp_path}")
    finally:
        release_run_lock(run_dir)
    assert run.returncode == 1 and "is already in use by a local run (pid" in run.stderr, run.stdout + run.stderr
    assert "rollouts per step" not in run.stdout and "grpo-launcher: run 'tiny-grpo'" not in run.stdout, run.stdout


# ----------------------------------------------------------------------------- a worker killed for memory
@pytest.fixture
def memcg(tmp_path):
    """A real memory cgroup limited to 64 MiB under this process's own (v1 or v2): its cgroup.procs file."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory"), None)
    base = Path("/sys/fs/cgroup/memory" + v1) if v1 is not None else Path("/sys/fs/cgroup" + lines[-1].split(":", 2)[2])
    group = base / f"grpo-test-{os.getpid()}"
    try:
        group.mkdir()
        limit = group / ("memory.limit_in_bytes" if v1 is not None else "memory.max")
        limit.write_text(str(64 << 20))
    except OSError as exc:
        pytest.skip(f"no memory cgroup to make here: {exc}")
    yield group / "cgroup.procs"
    wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), 30, "the cgroup's processes to end")
    group.rmdir()


# Ray 2.60's ActorDiedError text for a worker killed by SIGKILL (read from a real `kill -9` of an actor): a copy,
# for the fast test; the slow one below makes Ray say it.
RAY_SIGKILL_TEXT = ("The actor died unexpectedly before finishing this task.\n\tclass_name: A\n\tpid: 1\nThe actor is "
                    "dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
                    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
                    "include: (1) the process was killed by the OOM killer due to high memory usage, ...")
EAT = "import os, sys\nopen(sys.argv[1], 'w').write(str(os.getpid()))\nx = bytearray(512 << 20)\nx[::4096] = b'1' * len(x[::4096])\n"


def test_a_worker_killed_by_the_oom_killer_is_named_out_of_memory(memcg):
    """A process over its memory cgroup's limit, killed by the kernel (a real OOM kill): the same Ray text then reads
    'out of memory'; without an OOM kill it says what else a SIGKILL may be."""
    import sys

    from grpo_launcher.deadlines import death_reason, oom_kills

    base = oom_kills()
    if base is None:
        pytest.skip("/proc/vmstat has no oom_kill count here")
    assert "no OOM kill on the driver's node" in death_reason(RuntimeError(RAY_SIGKILL_TEXT), base)
    eater = subprocess.run([sys.executable, "-c", EAT, str(memcg)], timeout=120)
    assert eater.returncode == -9  # SIGKILL, by the kernel
    reason = death_reason(RuntimeError(RAY_SIGKILL_TEXT), base)
    assert reason.startswith("out of memory: its process was killed (SIGKILL)") and "/proc/vmstat" in reason
    assert death_reason(RuntimeError("boom\nmore"), base) == "boom"
