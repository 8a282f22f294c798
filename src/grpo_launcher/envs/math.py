"""env=math: verifiable math from JSONL rows {"question": ..., "answer": ...} (env.prompt_key / answer_key),
graded as a math grader does: math-verify parses the completion's final answer (`\\boxed{}` first, then LaTeX,
then a plain expression: `\\frac{1}{2}`, `1/2`, `.5`, `1,000`, signs, percentages) and compares it with the row's
answer symbolically and numerically. A DatasetEnv with this default reward.

    reward = 1.0 if verify(parse(answer), parse(completion)) else 0.0

The answer cell may be a number (27, 0.5), or text: `1/2`, `1,000`, `2/3`, `\\frac{1}{2}`, `$x^2+1$`. Each grade
runs under GRADE_TIMEOUT_S (math-verify's own signal.alarm timeouts are off: they fail off the main thread; our
bound, usercode.call_with_limit, works in a Ray actor and in threads); one that runs over scores 0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

from .dataset import DatasetEnv, answer_text
from .rewards import NUMBER  # noqa: F401  (kept importable from here)
from .usercode import TimeLimitExceeded, call_with_limit

GRADE_TIMEOUT_S = 5.0  # one completion's parse + comparison
_EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_LATEX_HINTS = ("\\", "^", "{", "_")


def math_verify_match(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the completion's final answer equals the row's answer as math-verify grades it, else 0.0."""
    if answer is None or not isinstance(completion, str):
        return 0.0
    try:
        return 1.0 if call_with_limit(GRADE_TIMEOUT_S, grade, answer_text(answer), completion) else 0.0
    except TimeLimitExceeded:
        return 0.0


def grade(gold: str, completion: str) -> bool:
    """math-verify's verdict for the completion against the gold answer text (no time bound of its own)."""
    from math_verify import parse, verify  # here: it imports sympy (seconds), and pre-flight imports this module

    target = gold_parsed(gold)
    if not target:
        return False
    got = parse(completion, parsing_timeout=None)
    if "\\%" in completion and all(isinstance(x, str) for x in got):  # math-verify 0.9 leaves \boxed{50\%} a
        got = parse(completion.replace("\\%", ""), parsing_timeout=None)  # string: 50, as it reads $50\%$
    return bool(verify(list(target), got, timeout_seconds=None))


@lru_cache(maxsize=65536)
def gold_parsed(gold: str) -> tuple:
    """The answer cell parsed as a grader parses a reference answer: a plain number or expression as it is
    (`1,000`, `1/2`, `.5`), LaTeX (`\\frac12`, `2\\pi`, `x^2`) as math; `1e3` as the number it means."""
    from math_verify import parse  # (the same)

    _quiet_timeout_warnings()
    text = gold.strip()
    if _EXPONENT.fullmatch(text):
        try:
            text = format(Decimal(text), "f")
        except InvalidOperation:
            pass
    if "$" in text:
        return tuple(parse(text, parsing_timeout=None))
    if any(h in text for h in _LATEX_HINTS):
        return tuple(parse(f"${text}$", parsing_timeout=None))
    return tuple(parse(text, parsing_timeout=None) or parse(f"${text}$", parsing_timeout=None))


def _quiet_timeout_warnings() -> None:
    """math-verify warns once that its timeouts are off and asks the caller to bound the call: ours does."""
    from math_verify import grader, parser  # (the same)

    grader.TIMEOUT_WARNING_SHOWN = parser.TIMEOUT_WARNING_SHOWN = True


class MathEnv(DatasetEnv):
    DEFAULT_REWARD = "grpo_launcher.envs.math:math_verify_match"
