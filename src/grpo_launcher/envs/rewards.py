"""Reward functions: fn(prompt, completion, **row_columns) -> float, one or several with weights.

env.reward_fn / env.reward_fns name them ("package.module:function" or "path/to/rewards.py:function");
the built-ins below are named the same way (grpo_launcher.envs.rewards:last_number_match).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..spec.schema import EnvSpec
from .usercode import UserCodeError, describe, load_ref

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RESERVED = ("prompt", "completion")  # never passed as row columns (they are the first two arguments)


def last_number_match(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the last number in the completion equals the answer (math word problems)."""
    found = NUMBER.findall(completion)
    try:
        return 1.0 if found and float(found[-1]) == float(answer) else 0.0
    except (TypeError, ValueError):
        return 0.0


def exact_match(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the stripped completion equals the answer."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


@dataclass
class Reward:
    ref: str  # as configured
    fn: Callable[..., Any]
    weight: float
    key: str  # the config key that named it


def reward_refs(spec: EnvSpec) -> list[tuple[str, str, float]]:
    """(config key, ref, weight) for every configured reward function, in order."""
    out = [("env.reward_fn", spec.reward_fn, 1.0)] if spec.reward_fn else []
    weights = list(spec.reward_weights) + [1.0] * (len(spec.reward_fns) - len(spec.reward_weights))  # pre-flight
    out += [(f"env.reward_fns[{i}]", ref, w) for i, (ref, w) in enumerate(zip(spec.reward_fns, weights))]  # checks n
    return out


def load_rewards(spec: EnvSpec, default: Optional[str] = None) -> list[Reward]:
    """Resolve every reward function (UserCodeError naming the key when one cannot be loaded or called)."""
    refs = reward_refs(spec) or ([("env.reward_fn", default, 1.0)] if default else [])
    out = []
    for key, ref, weight in refs:
        fn = load_ref(ref, key)
        if not callable(fn):
            raise UserCodeError(f"{key}={ref}: {fn!r} is not callable")
        out.append(Reward(ref, fn, weight, key))
    return out


def signature_problem(fn: Callable, columns: list[str]) -> Optional[str]:
    """Why fn(prompt, completion, **{column: ...}) cannot be called, or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: it will be tried at the first step
    try:
        sig.bind("prompt", "completion", **{c: None for c in columns})
    except TypeError as exc:
        cols = ", ".join(columns) or "none"
        return (f"{describe(fn)} cannot be called as fn(prompt, completion, **row) with the row's columns "
                f"({cols}): {exc}; give it a **kwargs parameter")
    return None


def row_kwargs(row: dict, prompt_key: str) -> dict:
    return {k: v for k, v in row.items() if k != prompt_key and k not in RESERVED}


def score(rewards: list[Reward], prompt: Any, completion: str, row: dict, prompt_key: str, where: str) -> float:
    """The weighted sum; UserCodeError naming the function and the row when one raises or returns a non-number."""
    total = 0.0
    kwargs = row_kwargs(row, prompt_key)
    for r in rewards:
        try:
            value = r.fn(prompt, completion, **kwargs)
        except Exception as exc:  # noqa: BLE001 - user code: anything it raises is reported, with the row
            raise UserCodeError(f"reward function {r.ref} raised {type(exc).__name__}: {exc}\n"
                                f"  on the row at {where}: prompt={_short(prompt)}, completion={_short(completion)}"
                                f"{_user_frame(exc)}") from None
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserCodeError(f"reward function {r.ref} returned {value!r} (expected a finite float)\n"
                                f"  on the row at {where}: prompt={_short(prompt)}, completion={_short(completion)}")
        total += r.weight * float(value)
    return total


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _user_frame(exc: BaseException) -> str:
    tb, last = exc.__traceback__, None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    return f"\n  at {last.tb_frame.f_code.co_filename}, line {last.tb_lineno}, in {last.tb_frame.f_code.co_name}"
