"""User code named in the config: "package.module:attr" or "path/to/file.py:attr" (reward functions, Env classes).

Loaded once in the driver (pre-flight, then the run), and shipped to the env Ray worker as objects:
cloudpickle sends code from outside installed packages by value, so the worker runs exactly what the
driver loaded, whatever its working directory or sys.path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Callable

_LOADED: dict[str, Any] = {}  # resolved ref (a file ref by its absolute path) → object
_SEEDED: dict[str, Any] = {}  # ref as configured → object: what the driver loaded, in an env worker


class UserCodeError(Exception):
    """User code (a reward function, an Env class) could not be loaded, or raised while the run used it."""


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
    module = _load_file(head, key) if is_file_ref(head) else _import(head, key)
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_"))
        raise UserCodeError(f"{key}={ref}: {getattr(module, '__file__', head)} defines no {attr!r} "
                            f"(it defines: {', '.join(names[:12]) or 'nothing'})")
    _LOADED[resolved] = _SEEN[ref] = obj = getattr(module, attr)
    return obj


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
