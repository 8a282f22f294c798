"""env=math grades as a math grader does (issue 42, item 5): the default reward agrees with math-verify's verdict on
each completion below (`\\boxed{\\frac{1}{2}}` vs 0.5, `1,000` vs 1000, `.5`, a check written after the boxed
answer, signs), and an answer cell that is not a plain number (`1/2`, `1,000`, `2/3`) scores for its exact answer.
The old reward (the completion's last number == float(answer)) got the rows marked `old=0` wrong.

Pre-flight calls the reward on every row with the row's own answer as the completion: a row scored 0 can never be
rewarded, and is a warning naming it (file:line), the first few shown and the rest counted."""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

import pytest
from math_verify import parse, verify

from grpo_launcher.envs import make_env
from grpo_launcher.envs.base import Prompt
from grpo_launcher.spec.compose import load_spec

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("math_grading", ROOT / "benchmarks" / "math_grading.py")
grading = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("math_grading", grading)
_spec.loader.exec_module(grading)

FRAC = r"\frac{1}{2}"
# (the row's answer cell as JSONL holds it, the completion, the grader's verdict); "old=0": the old reward gave 0
TABLE = [
    (0.5, rf"The answer is \boxed{{{FRAC}}}", 1),  # old=0
    (1000, "There are 1,000 apples.", 1),  # old=0
    (0.5, "It is .5", 1),  # old=0
    (27, r"\boxed{27}. Check: 19+8=27, and 27-8=19", 1),  # old=0: a check after the boxed answer
    (27, r"\boxed{27} (check: 27 - 8 = 19)", 1),  # old=0
    ("1/2", "1/2", 1),  # old=0: the answer cell is not a plain number
    ("1,000", "1,000", 1),  # old=0
    ("2/3", "2/3", 1),  # old=0
    ("1/2", "0.5", 1),  # old=0
    ("1,000", "1000", 1),  # old=0
    ("2/3", r"$\frac{2}{3}$", 1),  # old=0
    (FRAC, "0.5", 1),  # old=0: a LaTeX answer cell
    (0.75, r"so $\frac{3}{4}$", 1),  # old=0
    (-0.5, r"\boxed{-\frac{1}{2}}", 1),  # old=0: the sign
    (1000000, "1,000,000", 1),  # old=0
    (1000, "1 000", 1),  # old=0
    ("2\\sqrt{2}", r"$\sqrt{8}$", 1),  # old=0: symbolic equality
    (4, "x = 4", 1),
    (-4, "The answer is -4.", 1),
    (-4, "The answer is 4.", 0),  # a sign is not dropped
    (0.5, r"\boxed{-\frac{1}{2}}", 0),
    (27, "27", 1),
    (27, "19+8=27", 1),
    (27, "28", 0),
    (13, "13 apples", 1),
    (12, "The answer is 12.0", 1),
    (3, r"$3$, no: \boxed{4}", 0),  # the boxed answer is the answer
    ("2/3", "0.6667", 0),  # a rounded decimal is not the fraction
    (3.14, r"\boxed{\pi}", 0),
    (27, "", 0),
    (27, "no idea", 0),
]


def old_reward(completion: str, answer) -> float:
    """The reward env=math had (b4e6e4d): the last number of the completion == float(answer)."""
    import re

    found = re.findall(r"-?\d+(?:\.\d+)?", completion)
    try:
        return 1.0 if found and float(found[-1]) == float(answer) else 0.0
    except (TypeError, ValueError):
        return 0.0


@pytest.fixture(scope="module")
def math_env():
    return make_env(load_spec(["env=math"]))


def graded(env, answer, completion: str) -> float:
    """env.score of `completion` for a table row whose answer cell is `answer` (any JSON type)."""
    row = {"question": "q", "answer": answer}
    return env.score(Prompt(text="q", answer=str(answer), agent_ref="math", row=row, source="table"), completion)


@pytest.mark.parametrize("answer, completion, verdict", TABLE)
def test_env_math_scores_as_math_verify_grades(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


@pytest.mark.parametrize("answer, completion, verdict", TABLE)
def test_the_table_is_math_verifys_own_verdict(answer, completion, verdict):
    """The verdicts above are math-verify's, with the answer given as a grader's reference solution (\\boxed{})."""
    gold = answer if isinstance(answer, str) else json.dumps(answer)
    assert verify(parse(rf"\boxed{{{gold}}}"), parse(completion)) == bool(verdict)


def test_the_table_holds_the_issues_disagreements():
    """At least 14 rows where the old reward was wrong (the issue's count), every issue example among them."""
    wrong = [(a, c) for a, c, v in TABLE if old_reward(c, a) != v]
    assert len(TABLE) >= 23 and len(wrong) >= 14, wrong
    for answer in ("1/2", "1,000", "2/3"):
        assert (answer, answer) in wrong


def test_grading_is_bounded_in_time(monkeypatch):
    """A completion whose comparison would compute 9^(9^9) exactly (minutes in sympy) scores 0 within the grade's
    limit (math.GRADE_TIMEOUT_S, 5 s; 1 s here), on the main thread, where a Ray actor's task runs."""
    from grpo_launcher.envs import math as math_env
    from grpo_launcher.envs.math import math_verify_match

    monkeypatch.setattr(math_env, "GRADE_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    assert math_verify_match("q", r"\boxed{9^{9^{9}}}", answer=1) == 0.0
    assert time.monotonic() - t0 < 5
    assert math_verify_match("q", r"\boxed{2}", answer=2) == 1.0  # and the next one is graded as usual


def test_preflight_warns_of_rows_whose_own_answer_scores_zero(launch_here, tmp_path):
    """Rows whose answer the grader reads as no math (words, a placeholder, a typo) are named with file:line, the
    first five, then counted; answers that are fractions or have separators are not."""
    rows = [
        {"question": f"{i}+{i}=", "answer": a}
        for i, a in enumerate(
            [2, "1/2", "1,000", "2/3", "four", "n/a", r"\frac{1}{2}", "?", "x=", "--", "seven", "none", 0.5]
        )
    ]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = launch_here(tmp_path, "env=math", f"env.train_path={data}", f"env.val_path={data}", "dry_run=true")
    assert r.returncode == 0, r.stderr
    warning = r.stderr[r.stderr.index("warning: env.reward_fn") :]
    # the same file as env.train_path and env.val_path: its rows once (was "14 of 26" for this 13-row file)
    assert "7 of 13 rows have an answer that is no math to the grader" in warning, r.stderr
    assert f"{data}:5: answer 'four'" in warning and f"{data}:6: answer 'n/a'" in warning
    assert "... and 2 more" in warning
    for line in (1, 2, 3, 4, 7, 13):
        assert f"{data}:{line}:" not in warning
    assert "can never be rewarded" not in r.stderr and "config error" not in r.stderr


# pre-flight's answer check (issue: bare answers were said to be never rewarded): the answer cell, what pre-flight
# says of its row ("ok": nothing; "never": can never be rewarded; "text": no math to the grader, only the same text
# boxed is rewarded), and a completion that math_verify_match rewards for it (None: none of the forms is rewarded)
ANSWER_CHECK = [
    ("A", "ok", r"The answer is \boxed{A}"),  # was "never": the bare `A` scores 0 as a whole completion
    ("(A)", "ok", r"\boxed{A}"),
    ("B", "ok", r"\boxed{B}"),
    ("x^2", "ok", r"\boxed{x^2}"),  # was "never"
    ("x", "ok", r"$x$"),
    ("e", "ok", r"\boxed{e}"),
    ("1e21", "ok", r"\boxed{1e21}"),  # was "never", and \boxed{1e21} scored 0 (read as 1·e·21)
    ("1E21", "ok", "1e21"),  # was "never"
    ("2.5e-3", "ok", r"\boxed{2.5e-3}"),
    ("-1e21", "ok", "-1e21"),
    ("1e3", "ok", r"\boxed{1000}"),
    (27, "ok", "27"),
    ("1/2", "ok", "0.5"),
    (r"\frac{1}{2}", "ok", r"\boxed{\frac12}"),
    ([1, 2], "ok", r"\boxed{1, 2}"),
    (r"\infty", "ok", r"\boxed{\infty}"),
    ("four", "text", r"\boxed{four}"),
    ("n/a", "text", r"\boxed{n/a}"),
    ("?", "text", r"\boxed{?}"),
    ("x=", "text", r"\boxed{x=}"),
    ("--", "text", r"\boxed{--}"),
    ("yes", "text", r"\boxed{yes}"),
    ("none", "text", r"\boxed{none}"),
    (r"\boxed{}", "never", None),
    ("####", "never", None),
    ("$$", "never", None),
    (r"\text{}", "never", None),
]


def test_the_answer_check_agrees_with_what_the_grader_rewards(launch_here, tmp_path, monkeypatch):
    """A row is said never to be rewarded exactly when none of its answer's forms (as written, boxed, in $..$) is
    rewarded, and each row's listed completion is rewarded: no false warnings (`A`, `x^2`, `1e21`), none missed."""
    from grpo_launcher.envs import preflight
    from grpo_launcher.envs.math import math_verify_match
    from grpo_launcher.envs.preflight import answer_forms

    monkeypatch.setattr(preflight, "SHOWN_ROWS", len(ANSWER_CHECK))  # every row named, none counted

    for answer, verdict, completion in ANSWER_CHECK:
        rewarded = [math_verify_match("q", form, answer=answer) for form in answer_forms(answer)]
        assert (max(rewarded) == 0) == (verdict == "never"), (answer, rewarded)
        if completion is not None:
            assert math_verify_match("q", completion, answer=answer) == 1.0, (answer, completion)
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n"
                            for i, (a, _, _) in enumerate(ANSWER_CHECK)))
    val = tmp_path / "v.jsonl"
    val.write_text(json.dumps({"question": "v", "answer": 1}) + "\n")
    r = launch_here(tmp_path, "env=math", f"env.train_path={data}", f"env.val_path={val}", "dry_run=true")
    assert r.returncode == 0, r.stderr
    blocks = {"never": "can never be rewarded", "text": "no math to the grader"}
    for i, (answer, verdict, _) in enumerate(ANSWER_CHECK, 1):
        for name, head in blocks.items():
            block = r.stderr[r.stderr.index(head):].split("\n  (")[0] if head in r.stderr else ""
            assert (f"{data}:{i}: " in block) == (verdict == name), (answer, name, r.stderr)


# a reasoning model's completion (Qwen3, DeepSeek-R1): the answer is what follows its last </think>; a box tried while
# thinking scored as the answer (the first row scored 1 before)
THINK = [
    (3, r"<think>maybe \boxed{3}?</think> The answer is 4", 0),
    (4, r"<think>maybe \boxed{3}?</think> The answer is 4", 1),
    (4, r"<think>maybe \boxed{3}?</think> So \boxed{4}", 1),
    (5, r"the template opened it: 2+3 </think> \boxed{5}", 1),
    (5, r"<think>\boxed{5}</think>", 0),  # nothing after the thinking: no answer
    (5, r"<think>2+3 is \boxed{5}", 0),  # cut off while thinking: no answer (scored 1 before)
    (5, r"2+3 is \boxed{5}", 1),  # no tags: the whole completion
    (5, r"<think>a</think> <think>b</think> \boxed{5}", 1),
]


@pytest.mark.parametrize("answer, completion, verdict", THINK)
def test_the_answer_after_thinking_is_graded(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# e-notation: math-verify reads `1e21` as 1·e·21 (Euler's e): a lowercase one in a completion never matched (rows 1
# and 4 scored 0 before; the last one's answer was written out to a billion digits, past the grade's time limit);
# a hex literal is not a number in e-notation
E_NOTATION = [
    ("1e21", r"\boxed{1e21}", 1),
    (10**21, r"so \boxed{1E+21}", 1),
    ("2.5e-3", "0.0025", 1),
    (0.0025, r"$2.5e-3$", 1),
    ("1e21", r"\boxed{1e20}", 0),
    (100000, r"\boxed{0x1e5}", 0),
    ("1e999999999", r"\boxed{1e999999999}", 1),  # not written out: a billion digits
]


@pytest.mark.parametrize("answer, completion, verdict", E_NOTATION)
def test_e_notation_is_read_as_a_number(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# a boxed percentage: math-verify 0.9 parses `\boxed{50\%}` to the string '50\%' only, so it matched no answer cell
# but the same LaTeX (every row below scored 0 at 3ae9508); it reads as the number before the sign, as `$50\%$` does
PERCENT = [
    ("50%", r"The answer is \boxed{50\%}", 1),
    (50, r"\boxed{50\%}", 1),
    ("50\\%", r"\boxed{50\%}", 1),
    ("12.5%", r"\boxed{12.5\%}", 1),
    (12.5, r"so \boxed{12.5 \%}.", 1),
    ("50%", r"\boxed{40\%}", 0),
    (0.5, r"\boxed{40\%}", 0),
    # a percentage is its number against a gold percentage, its value or number against a plain one: 0.2\% read as
    # 0.2 matched a gold 20% (whose value is 0.2), and 20\% never matched a gold 0.2 (found by the journeys tester)
    ("20%", r"\boxed{0.2\%}", 0),
    ("20%", r"The answer is $0.2\%$", 0),
    ("20%", "0.2%", 0),
    ("20%", r"\boxed{20\%}", 1),
    ("20%", r"\boxed{0.2}", 1),
    (0.2, r"\boxed{20\%}", 1),
    (0.125, "The answer is 12.5%.", 1),
    ("20%", r"\boxed{20\%} ... wait, \boxed{30}", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", PERCENT)
def test_a_boxed_percentage_is_graded_as_its_number(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# a model that revises, or writes a number as people do: `\boxed{3} ... wait, \boxed{4}` was read as the set {3, 4}
# (0 for the answer 4), `\boxed{1 000 000}` as 1·0·0, `\boxed{10.}` as the text '10.' (each scored 0 before)
REVISED = [
    (4, "\\boxed{3}\n\nWait, actually \\boxed{4}", 1),
    (3, "\\boxed{3}\n\nWait, actually \\boxed{4}", 0),  # the last box is the answer, not any box
    ("1, 2", r"\boxed{1}, \boxed{2}", 1),  # a many-valued answer keeps every box
    ([1, 2], r"the roots are \boxed{1} and \boxed{2}", 1),
    ([1, 2], r"\boxed{2}", 0),
    (1000000, r"\boxed{1 000 000}", 1),
    (1000, r"\boxed{-1 000}", 0),
    (12, r"\boxed{1 2}", 0),  # not digit groups
    ("1, 2", r"\boxed{1 2}", 1),  # but the list 1, 2, as the answer cell `1 2` reads
    (10, r"\boxed{10.}", 1),
    (10.5, r"\boxed{10.5}", 1),
    (12, "\\boxed{\uff11\uff12}", 1),  # full-width digits
    (12, "\\boxed{\uff11\uff13}", 0),
    ("1 2", r"\boxed{1, 2}", 1),  # an answer cell of numbers side by side is their list (was 1 + 2: `3` scored)
    ("1 2", r"\boxed{3}", 0),
    ("1 2", "3", 0),
    ("1 2", "1 2", 1),
    ("-3 4.5", r"\boxed{-3, 4.5}", 1),
    ("12 345", r"\boxed{12345}", 1),  # digit groups stay one number
    # a worked solution with two boxes: its last one is the answer (was the set {7, 8}: 8 scored 0, `7, 8` 1)
    (r"We get $f(2) = \boxed{7}$, so $g(f(2)) = \boxed{8}$.", r"\boxed{8}", 1),
    (r"We get $f(2) = \boxed{7}$, so $g(f(2)) = \boxed{8}$.", r"\boxed{7, 8}", 0),
    (r"We get $f(2) = \boxed{7}$, so $g(f(2)) = \boxed{8}$.", r"\boxed{7}", 0),
    # a hedge, no box: math-verify read `5 or 6` as its first value (1 for the answer 5: a policy learns to hedge)
    (5, "The answer is 5 or 6", 0),
    (6, "The answer is 5 or 6.", 0),
    ("5, 6", "The answer is 5 or 6", 1),
    (3, "The final answer is $3$ or $4$", 0),
    ("1/2", "The answer is 1/2 or 0.5.", 1),  # one value written twice
    (4, "The answer is 3 or 4. Actually, the answer is 4.", 1),  # the last answer stated, not a hedge
    (12, "The answer is 12 or so", 1),
    (5, "The answer is either 5 or 6.", 0),
    (5, "The answer is 5 (or possibly 6).", 0),
    (5, "Answer: 5 or 6", 0),
    (5, "The answer is 5, or so I think.", 1),
]

# found by the grading tester: an exact answer against a decimal (100000000.0 scored for 100000007 and
# 479001599.5 for two integers: a learnable hack; 0.333333 for 1/3 by math-verify's 6 places), and answers a
# template or Markdown wraps (R1-Zero's <answer>72</answer>, **72**, \$72) that scored 0
EXACT_AND_WRAPPED = [
    (100000007, r"\boxed{100000000.0}", 0),
    (479001600, r"\boxed{479001599.5}", 0),
    (1000000007, r"\boxed{1.0 \times 10^9}", 0),
    (r"\frac{1}{3}", r"\boxed{0.333333}", 0),
    (r"2\pi", r"\boxed{6.283185}", 0),
    ("1/8", "0.125", 1),
    (72, r"\boxed{72.0}", 1),
    ("602214076000000000000000", r"\boxed{6.02214076e23}", 1),
    (72, "reasoning. <answer>72</answer>", 1),
    (72, "<answer>71</answer>", 0),
    (72, "**72**", 1),
    (72, "**71**", 0),
    (24, r"\boxed{2*3*4}", 1),
    ("a_1 + a_2", r"\boxed{a_1 + a_2}", 1),
    (72, r"The total is \$72.00.", 1),
    ("20%", "The answer is 20%. Wait, recompute: the answer is 30.", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", EXACT_AND_WRAPPED)
def test_exact_answers_and_wrapped_answers(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# mixed numbers and other scripts' forms: math-verify read `1 1/2` as 1 (so `1` scored for the answer 1 1/2, and
# 1 1/2 never for 3/2), ½ as nothing, full-width punctuation (1．5, 2，3) as other numbers
MIXED_AND_WIDE = [
    ("1 1/2", "The answer is 1 1/2", 1),
    ("1 1/2", "The answer is 1", 0),
    ("3/2", r"\boxed{1 1/2}", 1),
    ("3/2", "1 1/2", 1),
    ("-3/2", r"\boxed{-1 1/2}", 1),
    ("7/2", "So 3 1/2 cups. The answer is 3 1/2", 1),
    (r"2\frac{1}{4}", r"\boxed{2 1/4}", 1),
    (5, r"\boxed{1 3/2}", 0),  # no proper fraction: not a mixed number
    ("1, 2", "1 2", 1),  # whole numbers side by side stay a list
    (0.5, r"\boxed{½}", 1),
    (1.5, r"\boxed{1½}", 1),
    (1.5, r"\boxed{1．5}", 1),
    ("2, 3", r"\boxed{2，3}", 1),
    (12, r"\boxed{１２}", 1),
]


@pytest.mark.parametrize("answer, completion, verdict", MIXED_AND_WIDE)
def test_mixed_numbers_vulgar_fractions_and_full_width_forms(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# units: math-verify drops them, so `\boxed{5 km}` scored 1 for the answer `5 m` (every row marked `was 1` did); two
# units that differ make the answer wrong, the same unit spelled otherwise (m, meters) or a unit on one side only
# is graded as before (rows without a mark scored the same before). No conversion: 5000 m is not 5 km
UNITS = [
    ("5 m", r"\boxed{5 km}", 0),  # was 1
    ("5 m", r"5\text{ km}", 0),  # was 1
    ("5 m", r"\boxed{5\text{ km}}", 0),  # was 1
    ("5 m", r"\boxed{5 \mathrm{km}}", 0),  # was 1
    ("5 m", "The answer is 5 km.", 0),  # was 1
    ("5 m", "5km", 0),  # was 1
    (r"5\text{ m}", r"\boxed{5 \text{ kilometers}}", 0),  # was 1
    ("12 cm", r"\boxed{12 \text{ m}}", 0),  # was 1
    ("3 hours", r"\boxed{3 \text{ min}}", 0),  # was 1
    ("20 kg", r"\boxed{20 g}", 0),  # was 1
    (r"90^\circ", r"\boxed{90 \text{ rad}}", 0),  # was 1
    ("18 dollars", r"\boxed{18 \text{ cents}}", 0),  # was 1
    (r"25\%", r"\boxed{25 \text{ dollars}}", 0),  # was 1
    ("7 apples", r"\boxed{7 \text{ oranges}}", 1),  # units outside the table are not judged (never a false 0)
    ("5 m", r"\boxed{5 m} ... wait, \boxed{5 km}", 0),  # was 1: the last box's unit
    ("5 km", r"\boxed{5000 \text{ m}}", 0),  # no conversion between units
    ("5 m", r"\boxed{5 m}", 1),
    ("5 m", r"\boxed{5 \text{ meters}}", 1),
    ("5 m", r"\boxed{5\,\mathrm{m}}", 1),
    ("5 m", r"\boxed{5}", 1),  # a unit on one side only
    (5, r"\boxed{5 km}", 1),
    ("3 h", "The answer is 3 hours.", 1),
    (r"90^\circ", "The angle is 90 degrees.", 1),
    (r"90^\circ", r"\boxed{90^{\circ}}", 1),
    ("50%", r"\boxed{50 \text{ percent}}", 1),
    ("30 s", r"\boxed{30 \text{ seconds}}", 1),
    ("7 apples", "7 apple", 1),
    ("6 - 5i", r"\boxed{6 - 5i}", 1),  # a letter that is no unit
    ("5 m", r"\boxed{5 km} ... wait, \boxed{5 m}", 1),
]


@pytest.mark.parametrize("answer, completion, verdict", UNITS)
def test_a_different_unit_is_a_wrong_answer(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# repeating decimals: math-verify read `0.\overline{3}` as 0 and `0.333...` as 0.333 (0 for the answer 1/3 by the
# exact-decimal rule), so each row marked `was 0` scored 0; read as their exact fractions. A decimal with no mark of
# a period (`0.333`) is still not 1/3, and an ellipsis after digits that do not repeat (3.14159...) is no period
REPEATING = [
    ("1/3", r"\boxed{0.\overline{3}}", 1),  # was 0
    ("1/3", r"0.\overline{3}", 1),  # was 0
    ("1/3", r"\boxed{0.(3)}", 1),  # was 0
    ("1/3", "0.(3)", 1),  # was 0
    ("1/3", "0.333...", 1),  # was 0
    ("1/3", r"\boxed{0.333\ldots}", 1),  # was 0
    ("1/3", r"\boxed{0.3\dot{3}}", 1),  # was 0
    ("1/3", "The answer is 0.333\u2026", 1),  # was 0
    (r"\frac{1}{6}", r"\boxed{0.1\overline{6}}", 1),  # was 0
    ("1/6", "0.1666...", 1),  # was 0
    ("1/7", r"\boxed{0.\overline{142857}}", 1),  # was 0
    ("1/7", r"\boxed{0.\dot{1}4285\dot{7}}", 1),  # was 0
    ("-1/3", r"\boxed{-0.\overline{3}}", 1),  # was 0
    ("10/3", r"\boxed{3.\overline{3}}", 1),  # was 0
    (1, r"\boxed{0.\overline{9}}", 1),  # was 0
    ("0.(3)", r"\boxed{\frac{1}{3}}", 1),  # was 0: an answer cell reads so too
    ("1/3", r"\boxed{0.333}", 0),
    ("1/3", "0.333", 0),
    ("1/3", "0.3...", 0),
    ("1/3", r"\boxed{0.\overline{6}}", 0),
    ("2/3", r"\boxed{0.\overline{3}}", 0),
    (r"\pi", r"\boxed{3.14159\ldots}", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", REPEATING)
def test_a_repeating_decimal_is_its_fraction(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# a number in words as the whole final answer: math-verify read `seven` as s·e·v·e·n (each row marked `was 0`
# scored 0); a word in prose is no answer when a number answer follows, and an answer cell in words (`four`, no math
# to the grader: not_math) is still rewarded only for its own text
WORDS = [
    (7, r"\boxed{seven}", 1),  # was 0
    (7, r"\boxed{\text{seven}}", 1),  # was 0
    (7, "The answer is seven.", 1),  # was 0
    (7, "Answer: Seven", 1),  # was 0
    (12, "twelve", 1),  # was 0
    (21, "twenty-one", 1),  # was 0
    (21, r"\boxed{twenty one}", 1),  # was 0
    (100, "one hundred", 1),  # was 0
    (0, r"\boxed{zero}", 1),  # was 0
    (2305, r"\boxed{two thousand three hundred and five}", 1),  # was 0
    (9999, "nine thousand nine hundred ninety-nine", 1),  # was 0
    (8, r"\boxed{seven}", 0),
    (8, "I tried seven ways. The answer is 8.", 1),
    (7, "I tried seven ways. The answer is 8.", 0),
    (7, "seven seven", 0),
    (7, r"\boxed{seventy}", 0),
    (100, "one hundred zero", 0),
    ("four", r"\boxed{four}", 1),
    ("four", r"\boxed{4}", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", WORDS)
def test_a_number_in_words_is_that_number(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# hedged percentages: math-verify read `\boxed{30\% \text{ or } 20\%}` (or `30\%, 20\%`) as its last value and
# `answer is 20% or 30%` as a percentage 20, so a hedge scored for a one-value answer (rows marked `was 1`); read as
# both values, as `The answer is 5 or 6` is (REVISED)
PERCENT_HEDGES = [
    ("20%", r"\boxed{30\% \text{ or } 20\%}", 0),  # was 1
    ("20%", r"\boxed{30\% or 20\%}", 0),  # was 1
    ("30%", r"\boxed{20\% \text{ or } 30\%}", 0),  # was 1
    ("20%", r"\boxed{30\%, 20\%}", 0),  # was 1
    (20, r"\boxed{30\% or 20\%}", 0),  # was 1
    ("20%", "The answer is 20% or 30%", 0),  # was 1
    ("20%", r"The answer is 20\% or 30\%.", 0),  # was 1
    ("20%", r"The answer is $20\%$ or $30\%$", 0),  # was 1
    ("20%", r"\boxed{20\% \text{ or } 30\%}", 0),
    ("20%", r"\boxed{20\% or 30\%}", 0),
    ("20, 30", r"\boxed{20\% \text{ or } 30\%}", 1),  # was 0: a two-value answer
    ("20%", r"\boxed{20\% \text{ or } 20\%}", 1),  # one value twice
    ("20%", "The answer is 20% or 20%", 1),
]


@pytest.mark.parametrize("answer, completion, verdict", PERCENT_HEDGES)
def test_a_hedged_percentage_is_not_an_answer(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# found by the journeys tester: a completion that states its answer twice with no box was graded by its first
# statement (math-verify reads `Answer:` first: a retracted answer scored); `1/2.` (a full stop) and `- 4` (a spaced
# minus) read as no number
RESTATED = [
    (5, "Answer: 5. Actually the answer is 7", 0),
    (7, "Answer: 5. Actually the answer is 7", 1),
    (7, "Answer: 5\nWait, the answer is 7.", 1),
    (7, r"Answer: $5$. Actually the answer is $7$.", 1),
    (7, "Answer: 5 or 6. Hmm, the answer is 7", 1),
    (5, "The answer is 5 or 6", 0),
    ("1/2", "1/2.", 1),
    (-4, "The answer is - 4", 1),
    (-4, "Answer: - 4", 1),
    (1, "5 - 4", 1),  # an expression, not the list 5, -4
]


@pytest.mark.parametrize("answer, completion, verdict", RESTATED)
def test_the_last_stated_answer_stands_and_a_full_stop_or_spaced_minus_is_read(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# found by the grading tester against the readings above: a later `answer is` that gives no number, a mixed number
# before a full stop, a decimal cut short with an ellipsis, unit spellings (~cm, in., square units, pounds, ^{ \circ })
# and a word answer cell; and a 5,000-digit run before a fraction (an exception escaped the reward)
SECOND_PASS = [
    (72, "The answer is 72.\n\nIs there anything else? Let me know if the answer is unclear.", 1),
    (72, "**Answer: 72**\n\nThis answer is based on the total.", 1),
    (72, "The final answer is 72.\n\nNote: the answer is rounded to the nearest whole number.", 1),
    (72, "Answer: 72\n\nExplanation: so the answer is correct.", 1),
    (r"\frac{3}{2}", "The answer is 1 1/2.", 1),
    (1, "The answer is 1 1/2.", 0),
    ("3.33", r"so the answer is \$3.33...", 1),
    ("0.44", "The answer is approximately 0.44...", 1),
    (r"\frac{1}{3}", "The answer is 0.333...", 1),
    (r"\frac{4}{9}", "The answer is 0.44...", 1),
    (r"5\text{ cm}", r"\boxed{5 \mathrm{~cm}}", 1),
    (r"4\text{ inches}", r"\boxed{4 \text{ in.}}", 1),
    (r"30\text{ square units}", r"\boxed{30 \text{ units}^2}", 1),
    (r"12\text{ lb}", r"\boxed{12 \text{ pounds}}", 1),
    (r"90^\circ", r"\boxed{90^{ \circ }}", 1),
    (r"\text{one}", r"\boxed{\text{one}}", 1),
    ("2 x + 3 y", r"\boxed{3 y + 2 x}", 1),
    ("5 m", r"\boxed{5 \text{ km}}", 0),
    ("3/2", "The answer is " + "1" * 5000 + " 1/2", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", SECOND_PASS)
def test_the_new_readings_hold_on_realistic_completions(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# numbers far from 1: math-verify rounds to 6 decimal places, so every two numbers below 1e-6 were equal (and
# 1e-7 = 0), and a float's 15 digits missed the exact integer past 1e9 (6.02e23 vs 6.02 \times 10^{23})
SCALES = [
    ("9.1e-31", r"\boxed{1.67e-27}", 0),
    ("9.1e-31", r"\boxed{9.1 \times 10^{-31}}", 1),
    (r"6.626 \times 10^{-34}", r"\boxed{6.626 \times 10^{-30}}", 0),
    (r"6.626 \times 10^{-34}", r"\boxed{6.626e-34}", 1),
    ("1.6e-19", r"\boxed{1.7e-19}", 0),
    ("0.0000002", r"\boxed{0.0000003}", 0),
    ("1e-7", r"\boxed{0}", 0),
    ("1e-7", r"\boxed{0.0000001}", 1),
    ("6.02e23", r"\boxed{6.02 \times 10^{23}}", 1),
    ("602000000000000000000000", r"\boxed{6.02 \times 10^{23}}", 1),
    (r"6.02 \times 10^{23}", r"\boxed{6.02e23}", 1),
    (r"6.02 \times 10^{23}", r"\boxed{6.03e23}", 0),
    ("123456789012", r"\boxed{123456789013}", 0),  # two integers: exact, at any size
    ("123456789012", r"\boxed{123456789012}", 1),
    ("1/10000000", r"\boxed{2/10000000}", 0),
    ("1/3", r"\boxed{0.333333}", 0),  # an exact answer: a decimal must be that number (EXACT_AND_WRAPPED)
    ("0.333333", r"\boxed{0.3333333}", 1),  # between two decimals, math-verify's own rule stands
    ("1/3", r"\boxed{0.33}", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", SCALES)
def test_numbers_far_from_one_are_compared_by_relative_difference(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


@pytest.mark.parametrize("answer, completion, verdict", REVISED)
def test_the_last_box_and_a_written_number_are_the_answer(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# real-world shapes (benchmarks/math_grading.py: GSM8K's `#### 1,234`, MATH's solutions and LaTeX answers, AIME,
# OlympiadBench's lists, model outputs cut off or pathological); at 534ab89 24 of the 172 were graded wrong: plain-text
# answer cells read as their last number ((3, -2) as -2, `1, 2` as 2, `6 - 5i` as 5: false positives), `\$18.90`
# read as nothing, \fbox, a unicode minus, a cut-off `\boxed{` scored by an earlier number
@pytest.mark.parametrize(
    "source, answer, completion, verdict", grading.CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(grading.CASES, 1)]
)
def test_real_world_answer_shapes(math_env, source, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


def test_pathological_answers_are_bounded_in_time_and_memory(monkeypatch):
    """Towers of powers and huge factorials score 0 within the grade's limit (1 s here), and memory stays bounded."""
    from grpo_launcher.envs import math as math_env

    monkeypatch.setattr(math_env, "GRADE_TIMEOUT_S", 1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for completion in (r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{10})!}", r"\boxed{10^{10^{10}}}"):
        t0 = time.monotonic()
        assert math_env.math_verify_match("q", completion, answer=1) == 0.0
        assert time.monotonic() - t0 < 5, completion
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024


def test_answer_key_other_than_answer_is_graded(tmp_path, launch_here):
    """env.answer_key=solution (MATH's rows have no `answer` column): the grader reads the named column, the boxed
    answer of the solution; at 534ab89 every row scored 0 (the reward read `answer`, absent)."""
    rows = [
        {"problem": "2+3?", "solution": r"We have $2+3=\boxed{5}$.", "level": "Level 1"},
        {"problem": "half?", "solution": r"It is $\boxed{\frac{1}{2}}$, not 2.", "level": "Level 1"},
    ]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = [
        "env=math",
        f"env.train_path={data}",
        f"env.val_path={data}",
        "env.prompt_key=problem",
        "env.answer_key=solution",
    ]
    env = make_env(load_spec(keys))
    first, second = env.val_prompts()
    assert env.score(first, r"\boxed{5}") == 1 and env.score(first, r"\boxed{2}") == 0
    assert env.score(second, "0.5") == 1 and env.score(second, r"\boxed{2}") == 0
    r = launch_here(tmp_path, *keys, "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert "can never be rewarded" not in r.stderr, r.stderr


# a number a completion rules out is no stated answer: the last `answer is` with a number won, so `The answer is 5.
# Note that the answer is not 6.` answered 6 (rows marked `was` scored the other way at 7611a97)
NEGATED = [
    (5, "The answer is 5. Note that the answer is not 6.", 1),  # was 0
    (6, "The answer is 5. Note that the answer is not 6.", 0),  # was 1
    (5, "The answer is 5. The answer cannot be 6.", 1),  # was 0
    (6, "The answer is 5. The answer cannot be 6.", 0),  # was 1
    (6, "The answer is 5. Note that the answer \u2260 6.", 0),  # was 1
    (6, "x = 5, x \u2260 6", 0),  # was 1
    (5, "The answer is not 6 but 5.", 1),  # was 0
    (6, "The answer is not equal to 6; it is 5.", 0),  # was 1
    (-6, "The answer is 5. Note: the answer isn't -6.", 0),  # was 1
    (6, "Answer: 5 (the answer is NOT 6)", 0),  # was 1
    (r"5\text{ km}", "The answer is 5 km, not 5 m.", 1),  # was 0 (its unit read as m)
    (6, "The answer is $5$, not $6$.", 0),
    (5, "It can't be 6, so the answer is 5.", 1),
    (6, "The answer is 6, not 5.", 1),
    (100, "I am not 100% sure, but the answer is 100.", 1),
    (r"\frac{1}{2}", r"The answer is $\frac{1}{3}$. Note that the answer is not $\frac{1}{2}$.", 0),  # was 1
    (r"\frac{1}{3}", r"The answer is \frac{1}{3}. Note that the answer is not \frac{1}{2}.", 1),  # was 0
    (r"x \neq 6", r"\boxed{x \neq 6}", 1),  # in a box a negation is the answer's own
    (r"x \neq 6", r"The answer is $x \neq 6$.", 1),  # and for an answer that holds one
    (5, r"\boxed{6}, not 5", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", NEGATED)
def test_a_negated_number_is_no_stated_answer(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# an answer cell that is a JSON list of numbers is its answers, in any order, each as often as the cell holds it (a
# multiset: math.number_list, math.in_any_order): [1, 2] (its JSON text read as the interval from 1 to 2) scored 0 at
# 7611a97, and `\boxed{1}` 1 for [1, 1] (read as a set); at 16319d9 `[2, 1]` scored 0 (graded in order). A stated bare
# answer (`The answer is (3, -2).`) is read as a bare completion is. A list of strings (OlympiadBench): any order too
LISTS = [
    ([1, 2], "[1, 2]", 1),  # was 0
    ([1, 2], "[1,2]", 1),  # was 0
    ([1, 2], r"\boxed{[1, 2]}", 1),  # was 0
    ([1, 2], r"\boxed{\left[ 1, 2 \right]}", 1),  # was 0
    ([1, 2], "The answer is [1, 2].", 1),  # was 0
    ([1, 2], "The final answer is $[1, 2]$.", 1),  # was 0
    ([1, 2], "The answer is 1, 2.", 1),  # was 0
    ([-1, 0.5], r"\boxed{[-1, \frac{1}{2}]}", 1),  # was 0
    ([1, 2], r"\boxed{1, 2}", 1),
    ([1, 2], "(1, 2)", 1),
    ([1, 2, 3], "[1, 2, 3]", 1),
    ([2, 1], r"\boxed{2, 1}", 1),
    ([1, 2], "[2, 1]", 1),  # 0 at 16319d9 (in order)
    ([1, 2], r"\boxed{[2, 1]}", 1),  # 0 at 16319d9
    ([1, 2], r"\boxed{(2, 1)}", 1),  # 0 at 16319d9
    ([1, 2], r"\boxed{2, 1}", 1),  # 0 at 16319d9
    ([1, 2], r"\boxed{2} and \boxed{1}", 1),  # 0 at 16319d9
    ([1, 2], "The answer is 2, 1.", 1),  # was 0
    ([2, 1], "[1, 2]", 1),  # was 0
    ([1, 2, 3], "[1, 3, 2]", 1),  # 0 at 16319d9
    ([-1, 0.5], r"\boxed{\frac{1}{2}, -1}", 1),  # 0 at 16319d9
    ([1, 1], r"\boxed{1, 1}", 1),  # 0 at 16319d9 (the set {1} against two 1s): a set as written keeps both
    ([1, 1], "[1, 1]", 1),
    ([1, 1], r"\boxed{1}", 0),  # was 1: [1, 1] needs two 1s
    ([1, 2], r"\boxed{1, 2, 2}", 0),  # was 1
    ([1, 2], r"\boxed{2}", 0),
    ([1, 2], "[1]", 0),
    ([1, 2], "[1, 2, 3]", 0),
    ([1, 2], r"\boxed{[1, 2, 3]}", 0),
    (["1", "2"], r"\boxed{2, 1}", 1),  # a list of strings: any order
    ("[1, 2]", r"\boxed{[1, 2]}", 1),  # an interval as text stays one
    ("[1, 2]", r"\boxed{(1, 2)}", 0),
    ("[1, 2]", r"\boxed{[2, 1]}", 0),
    ("(3, -2)", "The answer is (3, -2).", 1),  # was 0 (read as -2)
    ("(3, -2)", "The answer is (-2, 3).", 0),  # a tuple as text stays in order
    (5, "The answer is 5, 6.", 0),  # was 1: two answers
]


@pytest.mark.parametrize("answer, completion, verdict", LISTS)
def test_a_list_of_numbers_is_graded_in_any_order(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# a period in parentheses after a decimal point, 2.2(10) = 2.2101010... = 1094/495 (as \overline), was read so
# already (math.repeating_decimals); pinned with what it must leave alone: f(10), 2(10), (1, 2), f(2.5)
PAREN_PERIODS = [
    (r"\frac{1094}{495}", r"\boxed{2.2(10)}", 1),
    (r"\frac{1094}{495}", r"\boxed{2.2\overline{10}}", 1),
    (r"\frac{1094}{495}", "The answer is 2.2(10).", 1),
    ("2.2(10)", r"\boxed{\frac{1094}{495}}", 1),
    ("2.2", r"\boxed{2.2(10)}", 0),
    ("2.21010", r"\boxed{2.2(10)}", 0),
    (22, r"\boxed{2.2(10)}", 0),  # a decimal, then a period: not 2.2 times 10 (see environments.md)
    ("f(10)", r"\boxed{f(10)}", 1),
    ("(1, 2)", r"\boxed{(1, 2)}", 1),
    ("(1.5, 2)", r"\boxed{(1.5, 2)}", 1),
    ("f(2.5)", r"\boxed{f(2.5)}", 1),
    (22, "2.2(10) = 22", 1),  # in working, the result after `=` is the answer
    (10, "Since 0.5(20) = 10, the answer is 10.", 1),
]


@pytest.mark.parametrize("answer, completion, verdict", PAREN_PERIODS)
def test_a_period_in_parentheses_is_read_only_after_a_decimal_point(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# answers written beyond a box or a stated `answer is`: the wrong verdicts of 6b8413d (each `was`)
WRITTEN = [
    ("(3, -2)", "So the point is (3, -2).", 1),  # was 0 (math-verify read -2)
    ("(2, 3)", "The coordinates are (2, 3)", 1),  # was 0
    ("[1, 2]", "The interval is [1, 2].", 1),  # was 0
    ([1, 2], "x = [1, 2]", 1),  # was 0
    ("(3, 2)", "So the point is (3, -2).", 0),
    ("(-2, 3)", "So the point is (3, -2).", 0),  # a tuple as text stays in order
    ("(1, 2)", "The interval is [1, 2].", 0),
    ("3", "The value is 3. The point is (1, 2).", 0),
    ("5", "The total is 5 (rounded).", 1),
    ("4", "We get x = 4 (since 2+2=4).", 1),
    ("(3, -2)", r"\left(3, -2\right)", 1),  # was 0: a delimiter's size outside $...$
    ("(3, -2)", r"The answer is \left(3, -2\right).", 1),  # was 0
    ([1, 2], r"\left[1, 2\right]", 1),  # was 0
    ([1, 1], r"\boxed{1} and \boxed{1}", 1),  # was 0: a double root boxed twice (math-verify's set {1})
    ([1, 2], r"\boxed{1}, \boxed{2}, \boxed{2}", 0),  # was 1: three answers for two
    ([1, 2], r"\boxed{1} and \boxed{1}", 0),
    ([1, 2], r"\boxed{1} and \boxed{x}", 0),
    ([-1, 0.5], r"\boxed{\frac{1}{2}} and \boxed{-1}", 1),
    ([1, 2], r"<think>\boxed{5}</think>\boxed{1} and \boxed{2}", 1),
    ("E", r"The answer is $\textbf{(E)}$.", 1),  # choice letters stated without a box: each was 0
    ("D", "The answer is option D.", 1),
    ("(B)", "The answer is **B**", 1),
    ("C", "<think>the answer is A</think>The answer is C", 1),
    ("A", "<think>the answer is A</think>The answer is C", 0),
    ("B", "The answer is 5.", 0),
    ("5", "The answer is B.", 0),
    ("B", "I think it is B", 0),
    ("B", "Answer: (b)", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", WRITTEN)
def test_an_answer_written_without_a_box_or_a_statement_is_read(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


# found 2026-12-07 (each `was` scored the other way at b088b80): answers stated in prose with no box, a percentage
# answer cell in LaTeX, symbols as a model types them, LaTeX outside `$...$`, yes/no cells, a GSM8K loss (-$5)
# (benchmarks/math_grading.py holds more of each)
PROSE_AND_SYMBOLS = [
    ([1, 2], "The roots are x = 1 and x = 2.", 1),  # was 0
    ([1, 2], "x = 1 or x = 2", 1),  # was 0
    ([1, 2], "The roots are 1, 2.", 1),  # was 0
    ([1, 2], "x_1 = 1 and x_2 = 2", 1),  # was 0
    ([-1, 0.5], "The solutions are x = -1 and x = 1/2.", 1),  # was 0
    ([1, 1], "The roots are x = 1 and x = 1.", 1),  # was 0: a double root
    ([1, 2, 3], "The roots are x = 1, x = 2, and x = 3.", 1),  # was 0
    ([1, 2, 3], r"$x = 1$, $x = 2$, and $x = 3$", 1),  # was 0 (math-verify's `$a$, and $b$` reading stops at it)
    ([1, 2], "x = 1 or x = 3", 0),
    ([1, 2], "The roots are x = 1, x = 2, and x = 3.", 0),
    ([1, 2], "The roots are x = 1 and x = 1.", 0),
    ([1, 2], "x = 1 and y = 2", 0),
    ("1, 2", "The roots are 1, 2.", 1),  # was 0
    (2, "The roots are 1, 2.", 0),  # was 1
    (2, "x = 1 or x = 2", 0),  # was 1: a hedge
    (1, "The roots are x = 1 and x = 1.", 1),  # one value said twice
    ("1/2", "The probability is 1/2 or 0.5.", 1),
    (2, "So a = 3 and b = 2.", 1),  # two unknowns, not two answers
    (4, "Therefore, x = 3, 4", 0),  # was 1
    (5, "2 + 3 and 5", 1),  # `3 and 5` ends an expression: no enumeration
    (7, "Adding 3 and 4 gives 7.", 1),
    (1000, "The total is 1,000.", 1),  # a thousands separator is no list
    (r"\pm 2", "x = 2 or x = -2", 1),  # was 0
    (r"5\%", r"\boxed{0.05}", 1),  # was 0
    (r"$5\%$", r"\boxed{0.05}", 1),  # was 0
    (r"50\%", r"\boxed{\frac12}", 1),  # was 0
    (r"5\%", r"\boxed{0.050}", 1),  # was 0
    (r"-5\%", r"\boxed{-0.05}", 1),  # was 0
    ("#### 25%", "0.25", 1),
    (r"5\%", r"\boxed{5}", 1),
    (r"5\%", r"\boxed{5.0}", 1),  # its number, as `5` (math-verify alone: 5.0 is not 0.05)
    (r"33.3\%", r"\boxed{0.333}", 1),  # was 0
    (r"12.5\%", r"\boxed{12.5}", 1),
    (r"12.5\%", r"\boxed{1.25}", 0),
    (r"5\%", r"\boxed{5\%}", 1),
    (r"-5\%", r"\boxed{0.05}", 0),
    (r"5\%", r"\boxed{500}", 0),
    (r"So the rate is $\boxed{25\%}$.", r"\boxed{0.5}", 0),
    (0.05, r"\boxed{5}", 0),
    ("The limit is $\\infty$.", "\\boxed{\u221e}", 1),  # was 0
    (r"30^\circ", "The angle is 30\u00b0.", 1),
    (r"30^\circ", "\\boxed{30 \u00b0}", 1),  # was 0
    (3, "2 \u00b7 3 = 6", 0),
    (6, "2 \u00b7 3", 1),  # was 0
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", 1),  # was 0
    (r"\frac{\pi}{2}", r"The answer is \frac{\pi}{2}.", 1),  # was 0
    (r"\frac{\sqrt{3}}{2}", r"Answer: \frac{\sqrt{3}}{3}", 0),
    (r"\frac{1}{3}", r"The answer is \frac{1}{3}. Note that the answer is not \frac{1}{2}.", 1),
    ("yes", "yes", 1),  # was 0
    ("Yes", "Final answer: **Yes**", 1),  # was 0
    (r"\text{yes}", r"\boxed{YES}", 1),
    ("True", r"\boxed{true}", 1),  # was 0
    ("No", r"\boxed{Yes}", 0),
    ("No", "No, it is not possible.", 0),  # no stated answer (a miss, not a false reward)
    ("Yes", r"\boxed{\text{Yes and No}}", 0),
    ("yes", "<think>no</think>Yes", 1),  # was 0
    (1, "Yes", 0),
    (-5, "-$5", 1),  # was 0
    (5, "-$5", 0),
    (-5, r"\boxed{-\$5}", 1),
    (r"\emptyset", r"\boxed{\varnothing}", 1),  # was 0
    (45, r"\boxed{45\degree}", 1),  # was 0
    (r"3 \times 10^{8}", "3\u00d710\u2078", 1),  # was 0: superscript digits
    (r"3 \times 10^{8}", "3\u00d710\u2079", 0),
    (0.001, "\\boxed{10\u207b\u00b3}", 1),  # was 0
    ("x^2 + 1", "\\boxed{x\u00b2 + 1}", 1),  # was 0
    (3, "3\u00b2 = 9", 0),
    (r"25\text{ cm}^2", "\\boxed{25 cm\u00b2}", 1),  # was 0
    (r"25\text{ cm}^2", r"\boxed{25 cm^2}", 1),  # was 0 (read as 25·c·m²)
    (25, r"\boxed{25 cm^{2}}", 1),  # was 0
    (r"4 \text{ units}^2", r"\boxed{4 units^2}", 1),  # was 0
    (r"25\text{ cm}^2", r"\boxed{25 cm^3}", 0),
    (r"25\text{ cm}^2", r"\boxed{25 ft^2}", 0),
    ("25m^2", r"\boxed{25}", 0),  # one letter: a variable, not a unit
    (-5, "The answer is \u20135.", 1),  # was 0: an en dash typed as the minus sign
    (-5, "x = \u20135", 1),  # was 0
    (-2, "The answer is 3\u20135.", 0),  # a range, not 3 - 5
    (1500, "It is 1.5 x 10^3.", 1),  # was 0: the letter x as a times sign
    (1500, r"\boxed{1.5x10^{3}}", 1),  # was 0
    (1600, "It is 1.5 x 10^3.", 0),
    (15, "1.5 x 10", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", PROSE_AND_SYMBOLS)
def test_prose_lists_percent_cells_symbols_and_words(math_env, answer, completion, verdict):
    assert graded(math_env, answer, completion) == verdict


def test_an_enumeration_is_searched_for_in_bounded_time():
    """An enumeration is searched for only in the text's last math.ENUMERATION_REACH characters: over a whole
    completion of 20,000 comma-separated numbers the search took seconds (quadratic in the run)."""
    from grpo_launcher.envs.math import enumerated

    t0 = time.monotonic()
    assert enumerated("1, " * 20000 + "x") == "1, " * 20000 + "x"
    assert enumerated("The roots are " + "1, " * 20000 + "2.").startswith("1, 1, ")
    assert enumerated("x = 1 and " * 20000 + "y").endswith("y")
    assert time.monotonic() - t0 < 1
