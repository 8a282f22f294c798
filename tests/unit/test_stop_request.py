"""StopRequest (train/loop_state.py) without a process: each signal's exit code, the second signal abandoning the
step. The real signals sent to a real driver are test_golden_run.py (SIGTERM) and test_faults.py (all three, in
make test-all)."""

from __future__ import annotations

import signal

import pytest

from grpo_launcher.exit_codes import ExitCode
from grpo_launcher.train.loop_state import StopRequest


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, ExitCode.REQUEUE)])
def test_first_signal_asks_for_a_stop_with_its_exit_code(sig, code):
    stop = StopRequest()
    stop.handler(sig, None)
    assert stop.requested and stop.exit_code == code and stop.reason == sig.name


def test_second_signal_abandons_the_step_with_the_first_signals_code():
    stop = StopRequest()
    stop.handler(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as exc:
        stop.handler(signal.SIGINT, None)
    assert exc.value.code == 143


def test_sigusr1_then_sigterm_still_asks_for_a_requeue():
    stop = StopRequest()
    stop.handler(signal.SIGUSR1, None)
    with pytest.raises(SystemExit) as exc:
        stop.handler(signal.SIGTERM, None)
    assert exc.value.code == ExitCode.REQUEUE


def test_a_signal_held_while_the_driver_loaded_is_a_stop_once_it_installs():
    """launch/local.py holds SIGINT/SIGTERM from the plan until the driver's handler installs; one that came after
    its last look (between that and install) is handed over, not lost (the run trained to its end, CI 2026-12-06)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = StopRequest.install(None, [signal.SIGINT])
        assert stop.installed() and stop.requested and stop.exit_code == 130
        assert not StopRequest.install(None, []).requested
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
