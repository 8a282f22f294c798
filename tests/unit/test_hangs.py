"""No silent hangs (issue 28): the deadline arithmetic, the hang report, the bounded stop, `status`'s phase line;
and real runs whose Ray worker is frozen with SIGSTOP (as a GPU stuck in a collective looks from outside).

Slow tier: the default tiny CPU run, then `kill -STOP` on the `ray::TorchPolicyWorker` (or `ray::EnvWorker`)
process this test's run started, found among the run's own child processes: the run ends within its deadline
with exit 4, the message and status HUNG, its last checkpoint intact; a SIGTERM during a frozen step ends the run
within deadlines.stop_grace_s. Every process started here is stopped by PID at the end (SIGCONT, then SIGKILL).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import deque

import pytest

from grpo_launcher.exit_codes import ExitCode
from grpo_launcher.spec.schema import DeadlinesSpec
from grpo_launcher.deadlines import ActorInfo, Hung, PhaseClock, deadline_s, explain, hang_report

from helpers import ROOT, wait_until

PY = sys.executable
CFG = DeadlinesSpec(factor=5.0, floor_s=10.0, first_s=600.0, window=3)


# ------------------------------------------------------------------ the arithmetic (pure functions)


def test_first_wait_gets_first_s():
    assert deadline_s([], CFG) == 600.0
    assert deadline_s([], DeadlinesSpec(first_s=5.0, floor_s=30.0)) == 30.0  # never below the floor
    assert "deadlines.first_s=600" in explain([], CFG)


def test_k_times_the_slowest_recent_wait_or_the_floor():
    assert deadline_s([1.0, 4.0, 2.0], CFG) == 20.0
    assert deadline_s([0.1, 0.2], CFG) == 10.0
    assert "5 × 4.00 s" in explain([1.0, 4.0, 2.0], CFG) and "floor_s=10" in explain([1.0], CFG)


def test_the_window_forgets_old_waits_and_disabled_means_none():
    clock = PhaseClock(CFG, None)
    for s in (50.0, 1.0, 1.0, 1.0):
        clock.record("update", s)
    assert clock.history["update"] == deque([1.0, 1.0, 1.0]) and clock.limit("update") == 10.0
    assert clock.limit("generate") == 600.0  # a phase of its own history
    assert PhaseClock(DeadlinesSpec(enabled=False), None).limit("update") is None


def test_hang_report_names_phase_actor_step_checkpoint_and_stack():
    exc = Hung("update", 13, 10.4, explain([2.0], CFG), owners=["a"])
    text = hang_report(exc, [ActorInfo("policy", 0, 4242, "node-1")], 12, "/r/checkpoints/step_000010",
                       stack=lambda a: f'Thread {a.pid} (idle)\n    update (torch_policy.py:1)')
    assert text.startswith("grpo-launcher: HUNG: phase update of step 13: no answer after 10.4 s")
    assert "policy rank 0 (pid 4242, node node-1)" in text
    assert "last completed step: 12; last checkpoint: /r/checkpoints/step_000010" in text
    assert "    Thread 4242 (idle)" in text and "deadlines.factor" in text


def test_phase_file_and_status_hung(tmp_path):
    from grpo_launcher.launch.local_status import state_for
    from grpo_launcher.launch.status import phase_line, write_status

    write_status(tmp_path, "RUNNING", event="started")
    clock = PhaseClock(CFG, tmp_path)
    clock.step = 7
    clock.mark("update", 20.0)
    wait_until(lambda: (tmp_path / "phase.json").exists(), 30, "the phase file (written within a second)")
    st = json.loads((tmp_path / "status.json").read_text())
    assert re.fullmatch(r"update \(step 7\) for \d+\.\d s, deadline 20 s", phase_line(tmp_path, st, "RUNNING"))
    clock.mark_hung("phase update of step 7: no answer after 20.1 s")
    assert state_for(ExitCode.HUNG) == "HUNG"
    st = write_status(tmp_path, "HUNG", exit_code=int(ExitCode.HUNG))
    assert st["message"] == "phase update of step 7: no answer after 20.1 s"
    assert phase_line(tmp_path, st, "HUNG") == "update (step 7): passed its deadline of 20.0 s (hung)"


def test_the_job_script_gets_the_hung_code():
    from grpo_launcher.launch.sbatch import render
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec(["cluster=local_slurm", "dry_run=true"])
    assert f"HUNG_CODE={ExitCode.HUNG:d}" in render(spec, make_plan(spec)).splitlines()
    assert '"$rc" -eq "$HUNG_CODE"' in (ROOT / "src/grpo_launcher/launch/job.sh").read_text()


STOP_CHILD = r"""
import os, signal, sys, time
from grpo_launcher.train.loop_state import StopRequest
stop = StopRequest.install(grace_s=float(sys.argv[1]))
print("ready", flush=True)
while not stop.requested:  # a step that never finishes
    signal.pause()
if sys.argv[2] == "finishes":  # the step ends within the grace: the checkpoint (here: 2 x the grace) is not cut
    stop.step_done()
    end = time.monotonic() + 2 * stop.grace_s
    while time.monotonic() < end:
        time.sleep(0.05)
    print("saved", flush=True)
    sys.exit(stop.exit_code)
while True:
    signal.pause()
"""


def test_first_stop_signal_abandons_a_stuck_step_after_the_grace():
    child = subprocess.Popen([PY, "-c", STOP_CHILD, "1.5", "stuck"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        rc = child.wait(timeout=60)
        took = time.monotonic() - t0
        err = child.stderr.read()
        assert rc == ExitCode.TERMINATED and 1.4 < took < 30, (rc, took, err)
        assert "finishing the current step (at most deadlines.stop_grace_s=1.5 s)" in err
        assert "the step did not finish within deadlines.stop_grace_s=1.5 s; abandoning it" in err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_step_that_finishes_in_the_grace_is_not_abandoned_after_it():
    child = subprocess.Popen([PY, "-c", STOP_CHILD, "0.5", "finishes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGINT)
        rc = child.wait(timeout=60)
        assert rc == ExitCode.INTERRUPTED and child.stdout.read().strip() == "saved", child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


class FakeHandle:
    def __init__(self, hex_id: str) -> None:
        self._actor_id = type("Id", (), {"hex": lambda _self: hex_id})()


def test_a_dead_actor_is_named_by_its_actor_id():
    from grpo_launcher.deadlines import died

    a, b = FakeHandle("aa"), FakeHandle("bb")
    exc = RuntimeError("The actor died unexpectedly before finishing this task.\nmore")
    exc.actor_id = "bb"  # what Ray's ActorDiedError carries
    d = died(exc, "update", 7, [a, b])
    assert d.owner is b and str(d) == "died in phase update of step 7: The actor died unexpectedly before finishing " \
                                      "this task."
    assert died(RuntimeError("x"), "score", 1, [a]).owner is a  # no id: the wait's first actor


def test_frozen_http_server_is_found_by_the_gym_probe(tmp_path):
    """GymServers' health probe over a real HTTP server process: answers, then SIGSTOP: named as frozen (its pid,
    the key), and check() raises it; a refused connection is left to check()'s pid test (not called frozen)."""
    from grpo_launcher.gym.servers import GymServerHung, GymServers, free_port

    port = free_port()
    server = subprocess.Popen([PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        gym = GymServers(inst=None, workdir=tmp_path, proc=server, head_url=f"http://127.0.0.1:{port}",
                         log_path=tmp_path / "gym.log")
        wait_until(lambda: gym.probe(5.0) is None and _answers(port), 60, "the HTTP server")
        server.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        gym.watch(0.2, 1.0)
        wait_until(lambda: gym.frozen is not None, 30, "the probe to find the frozen server")
        found_s = time.monotonic() - t0
        assert found_s < 10
        print(f"frozen HTTP server found by the Gym probe (period 0.2 s, timeout 1 s) in {found_s:.2f} s")
        with pytest.raises(GymServerHung) as info:
            gym.check()
        assert str(info.value) == (f"NeMo Gym server 'head server' (pid {server.pid}, http://127.0.0.1:{port}/health) "
                                   "gave no answer to a health probe within deadlines.health_timeout_s=1 s")
        assert info.value.actors[0].pid == server.pid and info.value.actors[0].role == "gym server"
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
    gym.stopped = True
    assert GymServers(inst=None, workdir=tmp_path, proc=server, head_url=f"http://127.0.0.1:{port}",
                      log_path=tmp_path / "gym.log").probe(1.0) is None  # refused: not frozen


def _answers(port: int) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("key,value", [("health_timeout_s", "0"), ("health_period_s", "-1"), ("engine_restarts", "-1")])
def test_bad_health_keys_are_a_config_error(launch_here, tmp_path, key, value):
    out = launch_here(tmp_path, f"deadlines.{key}={value}", "dry_run=true")
    assert out.returncode == 2 and "config error" in out.stdout + out.stderr
    assert f"deadlines.{key}: must be" in out.stdout + out.stderr
