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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

LIMIT_ENV = "GRPO_USER_CODE_TIMEOUT_S"
DEFAULT_LIMIT_S = 60.0
_FIRE = signal.SIGINT  # sent to the main thread when a limited call overruns (chained to the previous handler)
REFIRE_S = 1.0  # a call that swallowed the interruption is interrupted again this often

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

    On the main thread (pre-flight, a Ray actor's task): fn runs here; a watchdog thread interrupts it with a
    signal (SIGINT, the previous handler kept for any other SIGINT), so Python-level loops, sleeps and waits end;
    fn's own signal.alarm timers (math-verify's) are left alone. Elsewhere fn runs in a daemon thread that is
    abandoned at the limit (a thread cannot be stopped). A C call that holds the GIL is not interrupted."""
    if seconds is None or seconds <= 0:
        return fn(*args, **kwargs)
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(_FIRE)
            return _on_main_thread(seconds, previous, fn, args, kwargs)
        except _NoSignals:
            pass
    return _in_helper_thread(seconds, fn, args, kwargs)


class _NoSignals(Exception):
    pass


class _Interrupt(BaseException):
    """Raised into fn by the watchdog's signal (a BaseException: fn's `except Exception` does not swallow it)."""

    def __init__(self, token: object):
        super().__init__("time limit")
        self.token = token


@dataclass
class _Watch:
    done: bool = False
    sent: int = 0
    seen: int = 0


def _on_main_thread(seconds: float, previous: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
    token, w, finished, lock = object(), _Watch(), threading.Event(), threading.Lock()

    def handler(signum: int, frame: Any) -> None:
        if w.sent > w.seen:  # ours
            w.seen += 1
            if not w.done:
                raise _Interrupt(token)
            return
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt

    def watchdog(main_id: int) -> None:
        wait = seconds
        while not finished.wait(wait):
            with lock:
                if w.done:
                    return
                w.sent += 1
                signal.pthread_kill(main_id, _FIRE)
            wait = REFIRE_S

    try:
        signal.signal(_FIRE, handler)
    except (ValueError, OSError) as exc:  # not the main interpreter
        raise _NoSignals() from exc
    threading.Thread(target=watchdog, args=(threading.get_ident(),), daemon=True, name="user-code-limit").start()
    try:
        return fn(*args, **kwargs)
    except _Interrupt as exc:
        if exc.token is not token:
            raise  # an enclosing limit's
        raise TimeLimitExceeded(seconds) from None
    finally:
        w.done = True  # first: a signal still on its way is swallowed from here on
        finished.set()
        with lock:
            pass  # the watchdog has sent its last signal
        deadline = time.monotonic() + 1.0
        while w.seen < w.sent and time.monotonic() < deadline:
            time.sleep(0.001)  # let the handler take it (a signal is handled between bytecodes and in sleeps)
        signal.signal(_FIRE, previous)


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
