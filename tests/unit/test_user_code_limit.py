"""User code at pre-flight runs under a time limit (issue 43, item 3): a reward function that never returns, or a
module that never finishes importing, is a config error naming the key and the function, in bounded time, where
`launch.py dry_run=true` used to hang with no message. usercode.call_with_limit is the bound."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from grpo_launcher.envs.usercode import TimeLimitExceeded, call_with_limit
from helpers import launch

LIMIT = {"GRPO_USER_CODE_TIMEOUT_S": "2"}


def spin() -> None:
    x = 0
    while True:
        x += 1


@pytest.mark.parametrize("reward, what", [
    ("def score(prompt, completion, **kw):\n    while True:\n        pass\n",
     "the reward function score(prompt, completion, **kw) in {file}:1 did not return within 2 s"),
    ("import time\nwhile True:\n    time.sleep(0.1)\n\ndef score(prompt, completion, **kw):\n    return 1.0\n",
     "importing {file} did not finish within 2 s"),
])
def test_a_reward_that_never_returns_is_a_config_error_naming_it(tmp_path, reward, what):
    (tmp_path / "rewards.py").write_text(reward)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1234>", "answer": "4321"}\n{"prompt": "5678>", "answer": "8765"}\n')
    t0 = time.monotonic()
    r = launch("env=dataset", f"env.train_path={data}", f"env.val_path={data}", "env.reward_fn=rewards.py:score",
               "dry_run=true", cwd=tmp_path, env=LIMIT, timeout=120)  # the old code hangs here: TimeoutExpired
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "config error: " in r.stderr and "  - env.reward_fn: " in r.stderr, r.stderr
    assert what.format(file=tmp_path.resolve() / "rewards.py") in r.stderr, r.stderr
    assert "GRPO_USER_CODE_TIMEOUT_S" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(0)  # pytest-timeout's own timer off: the last assertion is about ours alone
def test_a_call_past_its_limit_ends_and_the_next_runs():
    t0 = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        call_with_limit(0.3, spin)
    with pytest.raises(TimeLimitExceeded):
        call_with_limit(0.3, time.sleep, 60)
    assert time.monotonic() - t0 < 5
    assert call_with_limit(0.3, sum, [1, 2]) == 3
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # nothing left armed


def test_an_enclosing_timer_still_fires_on_time():
    """The driver's own SIGALRM timer (deadlines.stop_grace_s) is kept across limited calls and fires when due."""
    fired: list[float] = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    try:
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        for _ in range(50):
            call_with_limit(5, sum, range(100))
        while not fired and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert fired and 0.45 <= fired[0] - t0 < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_code_that_cancels_the_timer_and_hides_the_interrupt_is_still_bounded():
    """signal.alarm(0) inside the call (math-verify's own timeouts do it) and `except BaseException` around a loop:
    a watchdog re-sends the signal each second past the limit until the call gives up."""
    caught: list[str] = []

    def stubborn() -> None:
        signal.alarm(0)
        while True:
            try:
                spin()
            except BaseException as exc:  # noqa: BLE001 - the behaviour under test
                caught.append(type(exc).__name__)
                if len(caught) == 2:
                    raise

    t0 = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        call_with_limit(0.3, stubborn)
    assert len(caught) == 2 and time.monotonic() - t0 < 5


def test_off_the_main_thread_the_call_is_abandoned_at_its_limit():
    got: dict = {}

    def caller() -> None:
        try:
            call_with_limit(0.3, time.sleep, 60)
        except TimeLimitExceeded as exc:
            got["exc"] = exc
        got["value"] = call_with_limit(0.3, sum, [2, 3])

    t = threading.Thread(target=caller)
    t.start()
    t.join(10)
    assert isinstance(got.get("exc"), TimeLimitExceeded) and got["value"] == 5


def test_an_env_class_whose_module_never_finishes_importing_is_named(launch_here, tmp_path, monkeypatch):
    """env.name=envs.py:Mine: the same limit, in this process (launch.py's main), naming env.name."""
    monkeypatch.setenv("GRPO_USER_CODE_TIMEOUT_S", "1")
    (tmp_path / "envs.py").write_text("while True:\n    pass\n")
    t0 = time.monotonic()
    r = launch_here(tmp_path, "env.name=envs.py:Mine", "dry_run=true")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "  - env.name: " in r.stderr and f"importing {tmp_path.resolve() / 'envs.py'} did not finish within 1 s" \
        in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30
