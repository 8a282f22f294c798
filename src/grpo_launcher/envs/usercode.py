"""User code named in the config: "package.module:attr" or "path/to/file.py:attr" (reward functions, Env classes).

Loaded once in the driver (pre-flight, then the run), and shipped to the env Ray worker as objects:
cloudpickle sends code from outside installed packages by value, so the worker runs exactly what the
driver loaded, whatever its working directory or sys.path.

Importing user code, and pre-flight's calls of it, run under a time limit (call_with_limit;
GRPO_USER_CODE_TIMEOUT_S, default 60 s): a module or function that never returns is a UserCodeTimeout
naming the key, not a silent hang.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

LIMIT_ENV = "GRPO_USER_CODE_TIMEOUT_S"
DEFAULT_LIMIT_S = 60.0
_FIRE = signal.SIGALRM  # a limited call's timer signal (the enclosing handler is kept and called for its own)
REFIRE_S = 1.0  # past the limit (and this much more), the signal is sent again this often

_LOADED: dict[str, Any] = {}  # resolved ref (a file ref by its absolute path) → object
_TIMED_OUT: dict[str, str] = {}  # resolved ref → why its import was given up (not tried again)
_SEEDED: dict[str, Any] = {}  # ref as configured → object: what the driver loaded, in an env worker


class UserCodeError(Exception):
    """User code (a reward function, an Env class) could not be loaded, or raised while the run used it."""


class TimeLimitExceeded(Exception):
    """A call_with_limit call did not return within its limit (`seconds`)."""

    def __init__(self, seconds: float):
        super().__init__(f"did not return within {seconds:g} s")
        self.seconds = seconds


class UserCodeTimeout(UserCodeError):
    """User code that did not return within the limit (pre-flight names the key and the function)."""


def user_code_limit_s() -> float:
    """The limit on one import or pre-flight call of user code: $GRPO_USER_CODE_TIMEOUT_S, else 60 s (0: none)."""
    raw = os.environ.get(LIMIT_ENV, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_LIMIT_S
    except ValueError:
        return DEFAULT_LIMIT_S


def limit_text() -> str:
    return f"{user_code_limit_s():g} s ({LIMIT_ENV} sets it)"


def call_with_limit(seconds: float | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), or TimeLimitExceeded once it has run `seconds` (None or ≤ 0: no limit).

    On the main thread (pre-flight, a Ray actor's task) fn runs here under a real-time timer (SIGALRM, delivered
    by the kernel: it also ends a long C computation that checks for signals, such as a huge integer power); an
    enclosing timer (an outer call, the driver's stop grace) is kept and re-armed. A watchdog thread re-sends
    SIGALRM past the limit in case fn's own code cancelled the timer (signal.alarm, as math-verify uses).
    Elsewhere fn runs in a daemon thread abandoned at the limit (a thread cannot be stopped)."""
    if seconds is None or seconds <= 0:
        return fn(*args, **kwargs)
    if threading.current_thread() is threading.main_thread():
        try:
            return _on_main_thread(seconds, fn, args, kwargs)
        except _NoSignals:
            pass
    return _in_helper_thread(seconds, fn, args, kwargs)


class _NoSignals(Exception):
    pass


class _Interrupt(BaseException):
    """Raised into fn by the timer's signal (a BaseException: fn's `except Exception` does not swallow it)."""

    def __init__(self, token: object):
        super().__init__("time limit")
        self.token = token


@dataclass
class _Timer:
    """One limited call's timer, and the enclosing one it displaced (re-armed when this call ends)."""

    deadline: float
    outer_handler: Any
    outer_deadline: float | None
    outer_interval: float
    done: bool = False
    outer_fired: bool = False
    pending: bool = False  # the watchdog sent a signal not yet handled
    lock: threading.Lock = field(default_factory=threading.Lock)


_EARLY = 0.005  # a timer signal this close to a deadline counts as reaching it


def _on_main_thread(seconds: float, fn: Callable, args: tuple, kwargs: dict) -> Any:
    token, finished = object(), threading.Event()
    now = time.monotonic()
    try:
        outer_handler = signal.getsignal(_FIRE)
        delay, interval = signal.getitimer(signal.ITIMER_REAL)
    except (ValueError, OSError) as exc:
        raise _NoSignals() from exc
    t = _Timer(now + seconds, outer_handler, now + delay if delay > 0 else None, interval)

    def handler(signum: int, frame: Any) -> None:
        t.pending = False
        now = time.monotonic()
        if not t.done and now >= t.deadline - _EARLY:
            raise _Interrupt(token)
        if t.outer_deadline is not None and not t.outer_fired and now >= t.outer_deadline - _EARLY:
            t.outer_fired = True
            if callable(t.outer_handler):
                t.outer_handler(signum, frame)  # the enclosing limit's (it raises its own)
        if not t.done:  # early, or the outer's: ours is still to come
            signal.setitimer(signal.ITIMER_REAL, max(t.deadline - time.monotonic(), 1e-3))

    def watchdog(main_id: int) -> None:  # only matters when fn's own code cancelled the timer
        wait = seconds + REFIRE_S
        while not finished.wait(wait):
            with t.lock:
                if t.done:
                    return
                t.pending = True
                signal.pthread_kill(main_id, _FIRE)
            wait = REFIRE_S

    try:
        signal.signal(_FIRE, handler)
    except (ValueError, OSError) as exc:  # not the main interpreter
        raise _NoSignals() from exc
    first = seconds if t.outer_deadline is None else min(seconds, max(t.outer_deadline - now, 1e-3))
    signal.setitimer(signal.ITIMER_REAL, first)
    threading.Thread(target=watchdog, args=(threading.get_ident(),), daemon=True, name="user-code-limit").start()
    try:
        return fn(*args, **kwargs)
    except _Interrupt as exc:
        if exc.token is not token:
            raise  # an enclosing limit's
        raise TimeLimitExceeded(seconds) from None
    finally:
        with t.lock:
            t.done = True  # a signal still on its way is ignored from here on; the watchdog sends no more
        finished.set()
        _restore(t)


def _restore(t: _Timer) -> None:
    """Disarm this call's timer, let a signal already sent reach this call's handler (which ignores it now), then
    give back the enclosing handler and what is left of its timer."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    deadline = time.monotonic() + 1.0
    while t.pending and time.monotonic() < deadline:
        time.sleep(0.001)  # signal handlers run in sleeps and between bytecodes
    _handlers_run_here()
    signal.signal(_FIRE, t.outer_handler)
    if t.outer_deadline is not None and not t.outer_fired:
        signal.setitimer(signal.ITIMER_REAL, max(t.outer_deadline - time.monotonic(), 1e-3), t.outer_interval)


def _handlers_run_here() -> None:
    """A Python call: the interpreter runs pending signal handlers on entering it."""


def _in_helper_thread(seconds: float, fn: Callable, args: tuple, kwargs: dict) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="user-code-call")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeLimitExceeded(seconds)
    if "error" in box:
        raise box["error"]
    return box["value"]


def is_ref(text: str) -> bool:
    """'module:attr' or 'file.py:attr' (a Windows drive letter is not a thing here)."""
    head, sep, attr = text.rpartition(":")
    return bool(sep and head and attr.isidentifier())


def split_ref(ref: str) -> tuple[str, str]:
    head, _, attr = ref.rpartition(":")
    return head, attr


def is_file_ref(head: str) -> bool:
    return head.endswith(".py") or "/" in head or os.sep in head


def load_ref(ref: str, key: str) -> Any:
    """The object a ref names; UserCodeError naming `key`, the file and the reason when it cannot be had."""
    if ref in _SEEDED:
        return _SEEDED[ref]
    if not is_ref(ref):
        raise UserCodeError(f"{key}={ref!r}: expected 'package.module:name' or 'path/to/file.py:name'")
    head, attr = split_ref(ref)
    resolved = f"{Path(head).expanduser().resolve()}:{attr}" if is_file_ref(head) else ref
    if resolved in _LOADED:
        _SEEN[ref] = _LOADED[resolved]
        return _LOADED[resolved]
    if resolved in _TIMED_OUT:
        raise UserCodeTimeout(f"{key}: {_TIMED_OUT[resolved]}")
    module = _load_module(head, key, resolved)
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_"))
        raise UserCodeError(f"{key}={ref}: {getattr(module, '__file__', head)} defines no {attr!r} "
                            f"(it defines: {', '.join(names[:12]) or 'nothing'})")
    _LOADED[resolved] = _SEEN[ref] = obj = getattr(module, attr)
    return obj


def _load_module(head: str, key: str, resolved: str) -> Any:
    """The module of a ref, imported under the user-code time limit (a timeout is remembered: never retried)."""
    load = _load_file if is_file_ref(head) else _import
    try:
        return call_with_limit(user_code_limit_s(), load, head, key)
    except TimeLimitExceeded as exc:
        what = Path(head).expanduser().resolve() if is_file_ref(head) else head
        _TIMED_OUT[resolved] = f"importing {what} did not finish within {exc.seconds:g} s (the limit on user code, " \
                               f"{LIMIT_ENV} sets it): does it run something at import time?"
        raise UserCodeTimeout(f"{key}: {_TIMED_OUT[resolved]}") from None


def _load_file(head: str, key: str):
    path = Path(head).expanduser().resolve()
    if not path.is_file():
        raise UserCodeError(f"{key}: no file {path}")
    name = f"grpo_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except _Interrupt:
        del sys.modules[name]
        raise
    except BaseException as exc:
        del sys.modules[name]
        raise UserCodeError(f"{key}: importing {path} failed: {_where(exc, path)}") from exc
    return module


def _import(head: str, key: str):
    if os.getcwd() not in sys.path and "" not in sys.path:  # like `python -m`: the cwd's modules import
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(head)
    except ModuleNotFoundError as exc:
        if exc.name and head.startswith(exc.name):
            raise UserCodeError(f"{key}: no module named {exc.name!r} (from the working directory {os.getcwd()} "
                                "or the installed packages); a file path works too: path/to/file.py:name") from exc
        raise UserCodeError(f"{key}: importing {head} failed: {type(exc).__name__}: {exc}") from exc
    except _Interrupt:
        raise
    except BaseException as exc:
        raise UserCodeError(f"{key}: importing {head} failed: {_where(exc, None)}") from exc


def _where(exc: BaseException, path: Path | None) -> str:
    """'SyntaxError: ... (rewards.py, line 3)' — the user's own frame, not ours."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    tb, line = exc.__traceback__, None
    while tb is not None:
        if path is None or Path(tb.tb_frame.f_code.co_filename) == path:
            line = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    at = f" ({line[0]}, line {line[1]})" if line else ""
    return f"{type(exc).__name__}: {exc}{at}"


_SEEN: dict[str, Any] = {}  # ref as configured → object, for this process's last loads (what a worker gets)


def loaded_snapshot(refs: list[str]) -> dict[str, Any]:
    """The objects these refs name, as loaded here (for the env worker)."""
    return {r: _SEEN[r] for r in refs if r in _SEEN}


def seed_loaded(objects: dict[str, Any]) -> None:
    _SEEDED.update(objects)


def is_local_code(obj: Any) -> bool:
    """Defined outside the installed packages and the standard library (a user's file or working dir)."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if module is None or file is None or module.__name__ == "__main__":
        return False  # __main__ is pickled by value anyway
    if module.__name__.split(".")[0] == "grpo_launcher":
        return False
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return not any(Path(file).resolve().is_relative_to(Path(r).resolve()) for r in roots)


def pickle_by_value_if_local(*objs: Any) -> None:
    """Register the modules of user code for by-value pickling (Ray's vendored cloudpickle, and the package)."""
    picklers = []
    for name in ("ray.cloudpickle", "cloudpickle"):
        try:
            picklers.append(importlib.import_module(name))
        except ImportError:
            pass
    for obj in objs:
        if is_local_code(obj):
            for pickler in picklers:
                try:
                    pickler.register_pickle_by_value(sys.modules[obj.__module__])
                except ValueError:  # already registered
                    pass


def describe(fn: Callable) -> str:
    """'score(prompt, completion, **kw) in /tmp/rewards.py:3'."""
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        sig = "(...)"
    code = getattr(fn, "__code__", None)
    where = f" in {code.co_filename}:{code.co_firstlineno}" if code else ""
    return f"{getattr(fn, '__qualname__', repr(fn))}{sig}{where}"
