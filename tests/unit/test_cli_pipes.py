"""`launch.py status|logs|cancel ... | head -1`: a reader that went away ends the subcommand quietly (exit 0, no
BrokenPipeError traceback, no 'Exception ignored' at exit); and the subcommands' own argument checks."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_launcher.launch import app
from helpers import ROOT


def a_local_run(root: Path, name: str) -> Path:
    run_dir = root / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "driver-local.log").write_text("".join(f"line {i}\n" for i in range(20000)))
    (run_dir / "status.json").write_text(json.dumps({
        "kind": "local", "name": name, "pid": 1, "host": "vm", "state": "COMPLETED", "exit_code": 0,
        "driver_log": str(run_dir / "logs" / "driver-local.log"), "max_steps": 2,
        "events": {"started": 1.0, "ended": 2.0}, "updated": "2026-01-01T00:00:00"}))
    return run_dir


class ClosedPipe:
    """sys.stdout as a pipe whose reader has gone (no file descriptor, as under pytest's capture)."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("args", [["status", "r1"], ["status"], ["status", "--json"], ["logs", "r1"]])
def test_a_closed_pipe_ends_a_subcommand_quietly(tmp_path, monkeypatch, args):
    a_local_run(tmp_path, "r1")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert app.dispatch([*args, "--root", str(tmp_path)]) == 0


def test_a_dry_run_into_a_closed_pipe_ends_quietly(tmp_path, monkeypatch):
    """`launch.py dry_run=true | head -1`: the plan's printing ends at the closed pipe, exit 0, no traceback."""
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert app.dispatch([f"output_root={tmp_path}", "dry_run=true"]) == 0


def test_launch_py_status_into_a_closed_pipe(tmp_path):
    """The real process: its stdout a pipe whose reader has closed (`| head -1` once head has its line)."""
    for i in range(30):
        a_local_run(tmp_path, f"r{i}")
    for args in (["status", "r1", "--json"], ["status"], ["logs", "r1"]):
        read, write = os.pipe()
        os.close(read)
        try:
            r = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args, "--root", str(tmp_path)],
                               stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path)
        finally:
            os.close(write)
        assert (r.returncode, r.stderr) == (0, ""), (args, r.stderr[-2000:])


def test_logs_refuses_a_negative_line_count(capsys):
    """`logs -n -5` printed the log without its first 5 lines: argparse now names the option (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        app.dispatch(["logs", "r1", "-n", "-5"])
    assert exc.value.code == 2 and "argument -n/--lines: must be ≥ 0, got -5" in capsys.readouterr().err
