"""Reward functions: fn(prompt, completion, **row_columns) -> float, one or several with weights.

env.reward_fn / env.reward_fns name them ("package.module:function" or "path/to/rewards.py:function");
the built-ins below are named the same way (grpo_launcher.envs.rewards:last_number_match), and so is env=math's
grader (grpo_launcher.envs.math:math_verify_match: math-verify's verdict, `\\boxed{}`, fractions, separators).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..spec.schema import EnvSpec
from .usercode import UserCodeError, describe, load_ref, split_ref

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
GROUPED_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 1,000.5 as one number
FLOAT32_MAX = 3.4028234663852886e38  # rewards and advantages are float32 tensors: past this, inf (then NaN weights)
RESERVED = ("prompt", "completion")  # never passed as row columns (they are the first two arguments)


def last_number_match(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the last number in the completion equals the answer (math word problems); thousands separators
    read as one number in both (`1,000 apples` was read as 000, and an answer cell `1,000` matched nothing)."""
    found = GROUPED_NUMBER.findall(completion)
    try:
        grouped = isinstance(answer, str) and GROUPED_NUMBER.fullmatch(answer.strip())
        want = float(answer.replace(",", "")) if grouped else float(answer)  # '1,2' is no number (1 and 2?)
        return 1.0 if found and float(found[-1].replace(",", "")) == want else 0.0
    except (TypeError, ValueError):
        return 0.0


def exact_match(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the stripped completion equals the answer as text (a string as it is, any other value as its JSON
    text: `true` for a JSON true, as the warm start and the data log show it; Python's `True` too); a whole number
    stored as a float (5.0: pandas' integer column with a missing value becomes float64) also as the integer (5).
    No answer (null) matches nothing (it matched the completion `None`)."""
    if answer is None:
        return 0.0
    got = completion.strip()
    whole = isinstance(answer, float) and answer.is_integer() and got == str(int(answer))
    texts = {str(answer).strip()} | ({_json_text(answer).strip()} if not isinstance(answer, str) else set())
    return 1.0 if got in texts or whole else 0.0


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # not a JSON value (a Parquet cell's numpy scalar, bytes): its str only
        return str(value)


@dataclass
class Reward:
    ref: str  # as configured
    fn: Callable[..., Any]
    weight: float
    key: str  # the config key that named it
    name: str = ""  # the function's name in metrics (train/reward/<name>_mean) and the train-data log


@dataclass(frozen=True)
class Scored:
    """One completion's reward: the weighted sum, each function's own value, and (env.reward_errors=zero) the
    first failure's message with its traceback (the failing function scored 0)."""

    total: float
    parts: dict[str, float] = field(default_factory=dict)  # reward function name → its unweighted value
    error: Optional[str] = None


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
    return named(out)


def named(rewards: list[Reward]) -> list[Reward]:
    """Each function's metric name: the name after the ':' of its ref, suffixed _2, _3 ... when repeated."""
    seen: dict[str, int] = {}
    for r in rewards:
        base = re.sub(r"[^A-Za-z0-9_]+", "_", split_ref(r.ref)[1] or r.key)
        seen[base] = seen.get(base, 0) + 1
        r.name = base if seen[base] == 1 else f"{base}_{seen[base]}"
    return rewards


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


def score(rewards: list[Reward], prompt: Any, completion: str, row: dict, prompt_key: str, where: str,
          on_error: str = "raise") -> Scored:
    """The weighted sum and each function's value. on_error="raise": UserCodeError naming the function and the
    row when one raises or returns a non-number; "zero": that function scores 0 and the error is kept."""
    total, parts, error = 0.0, {}, None
    kwargs = row_kwargs(row, prompt_key)
    for r in rewards:
        try:
            value = check_value(r, r.fn(prompt, completion, **kwargs), prompt, completion, where)
        except Exception as exc:  # noqa: BLE001 - user code: anything it raises is reported, with the row
            message = str(exc) if isinstance(exc, UserCodeError) else (
                f"reward function {r.ref} raised {type(exc).__name__}: {exc}\n"
                f"  on the row at {where}: prompt={_short(prompt)}, completion={_short(completion)}{_user_frame(exc)}")
            if on_error == "raise":
                raise UserCodeError(message) from None
            trace = "" if isinstance(exc, UserCodeError) else "\n" + "".join(traceback.format_exception(exc))
            error = error or message + trace
            value = 0.0
        parts[r.name] = value
        total += r.weight * value
    if not abs(total) <= FLOAT32_MAX:  # each value within range, their weighted sum not (env.reward_weights)
        raise UserCodeError(f"the weighted reward {total!r} (env.reward_weights × {parts}) is past float32's range "
                            f"(|x| ≤ {FLOAT32_MAX:.3g}): lower env.reward_weights\n  on the row at {where}")
    return Scored(total, parts, error)


def check_value(r: Reward, value: Any, prompt: Any, completion: str, where: str) -> float:
    """A reward function's return as a float; UserCodeError unless it is a finite number (a bool counts)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        value = float(value)  # numpy's float32 / int64 / bool_, Fraction, Decimal: real numbers
    if not isinstance(value, (int, float)) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise UserCodeError(f"reward function {r.ref} returned {value!r} (expected a finite float within float32's "
                            f"range, |x| ≤ {FLOAT32_MAX:.3g}: the advantages are float32)\n"
                            f"  on the row at {where}: prompt={_short(prompt)}, completion={_short(completion)}")
    return float(value)


def reward_metrics(split: str, scored: Sequence[Optional[Scored]]) -> dict[str, float]:
    """<split>/reward/<name>_mean per reward function and <split>/reward_errors (samples whose scoring failed);
    {} for envs that report no per-function values (toy, Gym, user Env classes)."""
    got = [s for s in scored if s is not None and s.parts]
    if not got:
        return {}
    out = {f"{split}/reward/{name}_mean": sum(s.parts[name] for s in got) / len(got) for name in got[0].parts}
    out[f"{split}/reward_errors"] = float(sum(s.error is not None for s in got))
    return out


def keep_first_error(run_dir: Path, scored: Sequence[Optional[Scored]]) -> None:
    """env.reward_errors=zero: the run's first failure (message and traceback) → RUN_DIR/reward_errors.txt and
    the log, once; later failures are only counted (train/reward_errors)."""
    first = next((s.error for s in scored if s is not None and s.error), None)
    path = Path(run_dir) / "reward_errors.txt"
    if first is None or path.exists():
        return
    path.write_text(first)
    print(f"grpo-launcher: a reward function failed (scored 0, env.reward_errors=zero; later failures are counted "
          f"as train/reward_errors); the first, kept in {path}:\n{first}", flush=True)


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
