"""env=math: verifiable math from rows {"question": ..., "answer": ...} (env.prompt_key / answer_key; any file
env=dataset reads: envs/dataset.py), graded as a math grader does: math-verify parses the completion's final
answer (`\\boxed{}` first, then LaTeX, then a plain expression: `\\frac{1}{2}`, `1/2`, `.5`, `1,000`, signs,
percentages, e-notation) and compares it with the row's answer symbolically and numerically; a reasoning model's
answer is what follows its last `</think>` (a `<think>` never closed: no answer). A DatasetEnv with this default
reward.

    reward = 1.0 if verify(parse(answer), parse(completion)) else 0.0

The answer cell may be a number (27, 0.5), or text: `1/2`, `1,000`, `2/3`, `\\frac{1}{2}`, `$x^2+1$`, `(3, -2)`,
a worked solution whose answer is boxed (MATH's `solution`) or follows `####` (GSM8K's `answer`), or a list of
such strings (OlympiadBench's `final_answer`) or numbers ([1, 2]): its answers, in any order. Real-world shapes and
verdicts: benchmarks/math_grading.py (benchmarks/results/environments.md). Each grade runs under GRADE_TIMEOUT_S
(math-verify's own signal.alarm timeouts are off: they fail off the main thread; our bound,
usercode.call_with_limit, works in a Ray actor and in threads); one that runs over scores 0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import lru_cache
from typing import Any

from .dataset import DatasetEnv, answer_text
from .rewards import NUMBER  # noqa: F401  (kept importable from here)
from .usercode import TimeLimitExceeded, call_with_limit

GRADE_TIMEOUT_S = 5.0  # one completion's parse + comparison
# math-verify compares numbers rounded to 6 decimal places (and a difference of expressions chopped to 0): every two
# numbers below 1e-6 are equal to it (1.6e-19 = 1.7e-19, 1e-7 = 0), and past ~1e9 a float's 15 digits differ from
# the exact integer (6.02e23 ≠ 6.02 \times 10^{23}). Where the larger of the two lies outside [SMALL, LARGE), two
# single numbers are compared by their relative difference instead.
SMALL, LARGE, RELATIVE = 1e-3, 1e8, 1e-6
EXACT_DECIMAL = 1e-12  # a decimal equals an exact answer up to its binary representation (0.1 for 1/10)
THINK_START, THINK_END = "<think>", "</think>"  # a reasoning model's thinking (Qwen3, DeepSeek-R1): the answer follows
_EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
# a number in e-notation inside a text (1e21, 2.5E-3): not part of a word or a longer number (x1e2, 0x1e5, 1.2.3e4)
_E_NUMBER = re.compile(r"(?<![\w.\\])(\d+\.?\d*|\.\d+)[eE]([-+]?\d+)(?![\w.])")
EXPANDED_EXPONENT = 400  # e-notation up to 10^±400 is written out (1e21 → 1000...0); beyond, as m \times 10^{n}
_LATEX_HINTS = ("\\", "^", "{", "_")
# a number as a cell holds it: 1,234 / 1 234 / .5 / 12.5% / 2/3 (read as a number, not as a list or a product)
_NUMBER_CELL = re.compile(r"[-+]?(?:\d{1,3}(?:[, ]\d{3})+|\d+)?(?:\.\d+)?%?|[-+]?\d+/\d+")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # prose: a word of two letters or more (not a \command)
_DOLLAR = re.compile(r"(?<!\\)\$")
# a cell that stands for no answer: n/a, none, null, nan, tbd, unknown, ?, --, ...
_PLACEHOLDER = re.compile(r"\s*(?:n/?a|null|none|nan|tbd|unknown|[?\-_.\u2013\u2014]*)\s*", re.I)  # a math delimiter, not an escaped dollar sign (\$18.90)
# a bare answer (the whole completion): digits, separators, brackets, signs, the imaginary unit: (3, -2), 1, 2, 6-5i
_BARE = re.compile(r"[\d\s.,/()\[\]+\-%^*i]*\d[\d\s.,/()\[\]+\-%^*i]*")
_SIDE_BY_SIDE = re.compile(r"\d\s+\d")
_SPACED_NUMBERS = re.compile(r"[-+]?\d+(?:\.\d+)?(?:\s+[-+]?\d+(?:\.\d+)?)+")  # `1 2`: two answers, not 1·2 or 12
_THIN_SEPARATOR = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")  # 1\,234 (a LaTeX thousands separator)
_ANSWER_WORDS = re.compile(r"\\text\{\s*(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*(?::\s*)?\}", re.I)  # in a box
_BOX_GROUPS = re.compile(r"\\boxed\{\s*([-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?)\s*\}")  # \boxed{1 000 000}
# `the answer is 5 or 6` (no box): math-verify reads its first value, 5, so a hedge scored as a hit; read as both
_NUM = r"\$?([-+]?\d(?:[\d.,/]*\d)?)(?:\s*\\?%)?\$?"  # (a percentage too: `answer is 20% or 30%`)
# ... `answer is either 5 or 6`, `Answer: 5 (or possibly 6)`, `answer is 5, or maybe 6`
_HEDGED = re.compile(r"answer\s*(?:is|=|:)\s*(?::\s*)?(?:either\s+)?" + _NUM
                     + r"\s*,?\s*\(?\s*or\s+(?:possibly\s+|maybe\s+|perhaps\s+)?" + _NUM, re.I)
_ANSWER_IS = re.compile(r"answer\s*(?:is|=|:)", re.I)
# a number a completion rules out: `is not 6`, `isn't 6`, `not equal to 6`, `cannot be 6`, `can't be 6`, `≠ 6`,
# `\neq 6`, `not \frac{1}{2}` (no stated answer: `The answer is 5. Note that the answer is not 6.` was read as 6)
_NEGATED = re.compile(r"(?:\bnot|n't|\bcannot|\u2260|\\neq?(?![A-Za-z]))(?:\s+(?:be|equals?)\b)?(?:\s+to\b)?"
                      r"\s*(\$)?\s*[-+\u2212]?(?:\d(?:[\d.,/]*\d)?|\\(?:[dt]?frac|sqrt)\s*(?:\{[^{}]*\}\s*){1,2})"
                      r"(?(1)\s*\$)", re.I)
# a list in square brackets, [1, 2] (for a list cell of numbers: as_tuple)
_SQUARE_LIST = re.compile(r"\[([^\[\]]*,[^\[\]]*)\]")
# \left( ... \right): a delimiter's size, no part of the answer (math-verify reads it only between $...$)
_SIZED = re.compile(r"\\(?:left|right)\s*(?=[\[\]()])")
# a box that holds one number, \boxed{-2}, \boxed{1.5}, \boxed{\frac{1}{2}}: a list's members boxed one by one
_NUMBER_BOX = re.compile(r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?|[-+]?\\[dt]?frac\{\d+\}\{\d+\})\s*\}")
# a statement that ends the text with a bracketed answer, `So the point is (3, -2).`, `x = [1, 2]`
_STATED_GROUP = re.compile(r"(?:\b(?:is|are)|=|:)\s*(\([^()]*\)|\[[^\[\]]*\])\s*\.?\s*$")
# a final enumeration in prose, `The roots are x = 1 and x = 2.`, `are 1, 2, or 3`, `$x = 1$ or $x = 2$`: math-verify
# read its last number (2 scored for [1, 2]'s `1 and 2`), and its own `$a$ and $b$` reading misses an Oxford comma;
# members are numbers, each with an optional `x =` (x_1 =), split by `, ` (not 1,000), the last by `and`/`or`
_VARIABLE = r"([A-Za-z])(?:_\{?\d\}?)?\s*="  # `x =`, `x_1 =`, `x_{2} =` (group 1: its letter)
_MEMBER = rf"\$?(?:{_VARIABLE}\s*)?[-+]?\d+(?:\.\d+)?(?:/\d+)?\$?"
_MEMBER_SEP = r"(?:\s*,(?=[\s$])\s*(?:(?:and|or)\s+)?|\s+(?:and|or)\s+)"
_ENUMERATION = re.compile(rf"(?<!\S)({_MEMBER}(?:{_MEMBER_SEP}{_MEMBER})+)\s*\.?\s*$")
ENUMERATION_REACH = 300  # an enumeration of answers is short: only the text's last 300 characters are searched
_OPERAND = re.compile(r"[\d+\-*/=^(<>]\s*$")  # what ends an expression's left side: `2 + 3 and 5` is no enumeration
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
# **72**, __72__ (and a whole completion *72*): Markdown emphasis, not 2·3·4 (2*3*4) or a subscript (a_1 + a_2)
_WRAPPED = re.compile(r"(\*\*|__)([^*_\n]+?)\1|^\s*\*([^*\n]+)\*\s*$")
_ESCAPED_DOLLAR = re.compile(r"\\\$(?=\s*\d)")  # \$72: a currency sign, not a LaTeX delimiter
_MINUS_DOLLAR = re.compile(r"(?<![\w$])-\s*\$(?=\d)")  # -$5 (a loss): the sign of 5 dollars, not a delimiter
_BOX_SPACED = re.compile(r"\\boxed\{\s*(" + _SPACED_NUMBERS.pattern + r")\s*\}")  # \boxed{1 2}: the list 1, 2
_BOX_STOP = re.compile(r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\.\s*\}")  # \boxed{10.}
# a percentage as an answer states it: 20\%, 20%, 20 \text{%}; its number is group 1
_PERCENT = r"([-+]?\d+(?:\.\d+)?)\s*(?:\\%|%|\\text\{\s*\\?%\s*\})"
_BOXED_PERCENT = re.compile(r"\\boxed\{\s*" + _PERCENT + r"\s*\}")
_STATED_PERCENT = re.compile(r"answer\s+is\s*(?::\s*)?\$?" + _PERCENT, re.I)
_BARE_PERCENT = re.compile(r"\s*\$?" + _PERCENT + r"\$?\.?\s*")
_HASHES = re.compile(r"####\s*(\S[^\n]*)?")  # GSM8K's answer line: what follows the first `####`, to the line's end
_VULGAR = {"½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "⅕": "1/5", "⅖": "2/5", "⅗": "3/5", "⅘": "4/5",
           "⅙": "1/6", "⅚": "5/6", "⅛": "1/8", "⅜": "3/8", "⅝": "5/8", "⅞": "7/8"}
_UNICODE = str.maketrans({"\u2212": "-", "\u03c0": "\\pi ", "\u221a": "\\sqrt",  # − π √ as a model types them,
                          "\u221e": "\\infty ", "\u00b0": "^\\circ ", "\u00d7": "*", "\u00b7": "*",  # ∞ ° × ·
                          "\u3000": " ", **{chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)},  # full width
                          **{k: " " + v for k, v in _VULGAR.items()}})  # (１２，１．５) and ½ (1½: a mixed number)
# superscript digits as a model types them, 10⁸, cm², 10⁻³: a power (math-verify read 10⁸ as 10)
_SUPERSCRIPT = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u2079\u207b]+")
_SUPER_DIGITS = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b", "0123456789-")
_SYNONYMS = {"\\varnothing": "\\emptyset", "\\degree": "^\\circ"}  # LaTeX math-verify reads only the other way
_SYNONYM = re.compile(r"\\(?:varnothing|degree)(?![A-Za-z])")
# a unit squared or cubed outside \text, `25 cm^2`: math-verify drops `\text{ cm}^2` and a bare `cm`, but read this as
# 25·c·m² (one-letter units, m, are left: a variable)
_UNIT_POWER = re.compile(r"(?<=[\d\s])(cm|mm|km|ft|in|yd|units?)\s*\^\s*(\{[23]\}|[23])(?![\w^])")
# a mixed number as plain text, `1 1/2` (a proper fraction after a whole number): math-verify read 1, so `1` scored
# for the answer `1 1/2` and `1 1/2` never for `3/2`; `1\frac{1}{2}` it reads as 3/2 already
_GIVES_NUMBER = re.compile(r"[^.\n]{0,40}?\d")  # an `answer is` followed by a number within its sentence
_SPACED_DEGREE = re.compile(r"\^\s*\{\s+\\circ\s*\}|\^\s*\{\\circ\s+\}")
_END_STOP = re.compile(r"(?<=\d)\.$")
# `the answer is - 4` (after `is`, `:`, `=`, `$` or at the start; never `5 - 4`): -4 (math-verify read no number)
# an en dash typed as a minus sign (`–5`, `x = –3`): not between two numbers (`3–5`, `3 –5`: a range)
_DASH_MINUS = re.compile(r"(?<![\w)\]}])(?<!\d )\u2013(?=\d)")
# `1.5 x 10^3` as typed: the letter x as a times sign before a power of ten
_X_TIMES_TEN = re.compile(r"(?<=\d)\s*[xX]\s*(?=10\s*\^)")
_SPACED_MINUS = re.compile(r"(?:^|(?<=\bis )|(?<=[:=$])|(?<=[:=$] ))-\s+(?=\d)")
_MIXED = re.compile(r"(?<![\d.,/]\s)(?<![\d.,/])(\d{1,30})\s+(\d{1,30})/(\d{1,30})(?![\d/]|\.\d)")
# a repeating decimal: 0.\overline{3}, 0.1\overline{6}; 0.(3) (a digit before the point: not `eq.(3)`); 0.3\dot{3},
# 0.\dot{1}4285\dot{7} (a dot over the period's first and last digit); 0.333..., 0.1666\ldots (the period: repeating_period);
# at most 30 digits either side of the point (a longer run is left as written)
_OVERLINE = re.compile(r"(?<![\d.])(\d{0,30})\.(\d{0,30})\\(?:overline|bar)\s*\{(\d{1,12})\}")
_PAREN_PERIOD = re.compile(r"(?<![\d.])(\d{1,30})\.(\d{0,30})\((\d{1,12})\)")
_DOTTED = re.compile(r"(?<![\d.])(\d{0,30})\.(\d{0,30})\\dot\s*\{?(\d)\}?(?:(\d{0,10})\\dot\s*\{?(\d)\}?)?")
_ELLIPSIS = re.compile(r"(?<![\d.])(\d{0,30})\.(\d{2,30})\s*(?:\.{3}|\u2026|\\[lc]?dots\b)")
# a unit after the final answer's number: 5 km, 5\text{ km}, 5\mathrm{km}, 12.5\%, 90^\circ, 3 cm^2 (group 1 or 2; the
# exponent group 3); `sep` is what stands between the number and a word (none: 5km, but 5i, 2x are no unit)
_UNIT_TAIL = re.compile(r"\d(?P<sep>(?:\s|\\[,;:! ]|~)*)(?:\\(?:text|mathrm|textrm|mbox)\s*\{([^{}]{1,40})\}"
                        r"|([A-Za-z]{1,20}|\\?[%$]|\u00b0|\^\s*\{?\s*\\circ\s*\}?))(\^\s*\{?\d\}?)?$")
_TAIL_END = re.compile(r"(?:\s|\.|\*|(?<!\\)\$)+$")  # a sentence's full stop, Markdown emphasis, a math delimiter
# one unit's spellings (lower case); any other unit is compared as written, less a plural s. No conversion between
# units: `5000 m` for the answer `5 km` is still wrong (as `5 km` for `5 m` is)
_UNIT_SPELLINGS = {
    "m": ("meter", "meters", "metre", "metres"), "km": ("kilometer", "kilometers", "kilometre", "kilometres"),
    "cm": ("centimeter", "centimeters", "centimetre", "centimetres"), "s": ("sec", "secs", "second", "seconds"),
    "min": ("mins", "minute", "minutes"), "h": ("hr", "hrs", "hour", "hours"), "kg": ("kilogram", "kilograms"),
    "g": ("gram", "grams"), "l": ("liter", "liters", "litre", "litres"), "ml": ("milliliter", "milliliters"),
    "$": ("\\$", "dollar", "dollars"), "cent": ("cents", "\u00a2"), "%": ("\\%", "percent"),
    "\u00b0": ("degree", "degrees", "^\\circ", "^ \\circ", "\\circ"), "in": ("inch", "inches"), "ft": ("foot", "feet"),
    "lb": ("lbs", "pound", "pounds"), "yd": ("yds", "yard", "yards"), "rad": ("radian", "radians"),
}
_UNITS = {spelling: unit for unit, spellings in _UNIT_SPELLINGS.items() for spelling in (unit, *spellings)}
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
# a choice letter as a cell or a statement writes it: C, (C), C), C., \text{(C)}, \textbf{C}, **C**, $C$ (upper case
# A-J only: `a 5`, `I think` are no letter); what may follow it: the end, or `)`, `.`, `:` and the option's text
_CHOICE = re.compile(r"\(?([A-J])(?:\)|[.:](?=\s|$)|(?=\s*$))")
_CHOICE_WRAPPERS = re.compile(r"\\text(?:bf|rm)?\s*\{|[{}$*]|\b(?:option|choice)\s+", re.I)
_YES_NO = ("yes", "no", "true", "false")  # an answer cell that is one of these words: graded as that word
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_WORDS = re.compile(r"[A-Za-z]{3,9}(?:[\s-]+[A-Za-z]{3,9}){0,7}")  # an answer in words: `twenty-one`, `one hundred`
_ONES = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                    "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}


def math_verify_match(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the completion's final answer equals the row's answer as math-verify grades it, else 0.0."""
    if answer is None or not isinstance(completion, str):
        return 0.0
    many = number_list(answer)
    if many:
        completion = as_tuple(completion)
    try:
        return 1.0 if call_with_limit(GRADE_TIMEOUT_S, grade, gold_text(answer), completion, many) else 0.0
    except TimeLimitExceeded:
        return 0.0


def gold_text(answer: Any) -> str:
    """The answer cell as text; a list of strings or numbers (OlympiadBench's final_answer, ["$\\frac{1}{2}$"]) as its
    one answer, or several as one list: strings as the set of a question's answers, in any order ($x, y$: OlympiadBench
    grades them so), numbers (number_list) as a tuple ($(1, 2)$, graded in any order: in_any_order), so that each
    counts as often as the cell holds it; its JSON text [1, 2] reads as an interval."""
    scalar = (str, int, float)
    if isinstance(answer, list) and answer and all(isinstance(a, scalar) and not isinstance(a, bool) for a in answer):
        texts = [answer_text(a) for a in answer]
        items = ", ".join(t.strip().strip("$") for t in texts)
        return texts[0] if len(texts) == 1 else f"$({items})$" if number_list(answer) else f"${items}$"
    return answer_text(answer)


def number_list(answer: Any) -> bool:
    """The answer cell is a JSON list of two numbers or more, [1, 2]: a question's answers (roots, solutions), graded
    in any order as a multiset (in_any_order: [2, 1] scores, [1, 1] needs two 1s, [1, 2, 3] and [1] do not)."""
    return (isinstance(answer, list) and len(answer) > 1
            and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in answer))


def as_tuple(completion: str) -> str:
    """A list the completion writes in square brackets ([1, 2], \\boxed{[1, 2]}) as the tuple (1, 2): math-verify
    reads [1, 2] as the closed interval from 1 to 2 (and [2, 1] as a tuple). For a number_list cell only: an answer
    cell `[1, 2]` as text is an interval, and `(1, 2)` is not it."""
    return _SQUARE_LIST.sub(r"(\1)", joined_boxes(_SIZED.sub("", completion)))


def joined_boxes(completion: str) -> str:
    """A list's members boxed one by one, `\\boxed{1} and \\boxed{1}`, as one box of their tuple, \\boxed{(1, 1)}:
    math-verify reads several boxes as a set, so the answer [1, 1] (a double root) never scored. Only where every box
    of the final answer holds one number; the text between them is dropped. For a number_list cell only."""
    head, sep, tail = completion.rpartition(THINK_END)
    boxes = list(_NUMBER_BOX.finditer(tail))
    if len(boxes) < 2 or tail.count("\\boxed") != len(boxes):
        return completion
    joined = "\\boxed{(" + ", ".join(m.group(1) for m in boxes) + ")}"
    return head + sep + tail[:boxes[0].start()] + joined + tail[boxes[-1].end():]


def grade(gold: str, completion: str, any_order: bool = False) -> bool:
    """math-verify's verdict for the completion against the gold answer text (no time bound of its own); a
    completion whose unit differs from the gold's is wrong (units_differ), one that answers with a percentage is
    graded by percent_verdict, one that answers in words (`seven`) as that number (worded_number). any_order: a
    number_list cell's tuple, its members in any order (in_any_order)."""
    completion = unnegated(gold, completion)
    if units_differ(gold, completion):
        return False
    stated = completion_percent(completion)
    if stated is not None:
        return percent_verdict(gold, stated)
    letter = choice_letter(final_answer(gold), whole=True)
    if letter is not None and "\\boxed" not in final_part(completion).replace("\\fbox", "\\boxed"):
        return stated_letter(completion) == letter
    if yes_no(gold) is not None:
        return yes_no(completion) == yes_no(gold)
    worded = worded_number(completion)
    if worded is not None and not _WORD.search(gold):  # a gold in words (`four`, `\\text{one}`, `7 apples`): graded
        return graded(gold, f"\\boxed{{{worded}}}")  # by its text, as before
    number = percent_number(gold)  # a percentage cell: its value (0.05) or, as a gold 50% takes 50, its number (5.0)
    if graded(gold, completion, any_order) or (number is not None and graded(number, completion)):
        return True
    periodic = ellipses_as_fractions(completion)  # `0.333...`: 1/3, or 0.333 cut short; either reading scores
    return periodic != completion and graded(gold, periodic, any_order)


def choice_letter(text: str, whole: bool = False) -> str | None:
    """The choice letter a text is (whole: `C`, `(C)`, `\\text{(C)}`) or begins with (`(C) 42`, `C) 42`, `C. 42`),
    else None."""
    text = _CHOICE_WRAPPERS.sub("", text).strip()
    found = _CHOICE.match(text)
    return found.group(1) if found and (not whole or text.strip("() .") == found.group(1)) else None


def stated_letter(completion: str) -> str | None:
    """The letter a completion without a box states as its answer, in its last `answer is` (`The answer is (C).`,
    `Answer: C) 42`): math-verify reads no letter there (0 for a right one) and read `C is wrong, the answer is (D)`
    as C. A letter the completion only is (`C`, `(C)`) counts too; any other text states none."""
    text = final_part(completion)
    said = list(_ANSWER_IS.finditer(text))
    return choice_letter(stated_value(text, said[-1]) if said else text, whole=not said)


def unnegated(gold: str, completion: str) -> str:
    """A completion without a box less the numbers it rules out (`the answer is not 6`, `isn't 6`, `cannot be 6`,
    `≠ 6`: _NEGATED): none is a stated answer (`The answer is 5. Note that the answer is not 6.` answered 6). In a
    box, or for an answer that holds a negation itself (`x \\neq 6`), a negation is the answer's own."""
    answer = final_part(completion)  # (a box while thinking is none)
    if "\\boxed" in answer or "\\fbox" in answer or _NEGATED.search(final_answer(gold)):
        return completion
    return _NEGATED.sub("", completion)


def final_answer(text: str) -> str:
    """The text of a completion's (or answer cell's) final answer: its last box's content, else what follows its
    GSM8K `####` on that line, else what follows its last `answer is` to the sentence's end, else the whole text
    (after a reasoning model's last `</think>`)."""
    text = tagged_answer(final_part(text)).replace("\\fbox", "\\boxed")
    if "\\boxed" in text:
        return box_content(text[text.rfind("\\boxed") + len("\\boxed"):])
    if "####" in text:
        line = _HASHES.search(text)
        return (line.group(1) or "").strip() if line else ""
    said = list(_ANSWER_IS.finditer(text))
    return stated_value(text, said[-1]) if said else text.strip()


def stated_value(text: str, said: re.Match) -> str:
    """What an `answer is` (`answer:`, `answer =`) in the text states: what follows it to its sentence's end."""
    return _SENTENCE_END.split(text[said.end():].lstrip(" \t\n:*"), maxsplit=1)[0].strip()


def box_content(rest: str) -> str:
    """What a `\\boxed` holds, given the text after it: `{...}` (braces balanced; unclosed: the rest) or `\\boxed 5`."""
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return rest.split()[0] if rest.split() else ""
    end = closing_brace(rest)
    return rest[1:end].strip() if end is not None else rest[1:].strip()


def closing_brace(text: str) -> int | None:
    """Where the brace that opens `text` closes (braces balanced), None where it never does."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return i
    return None


def answer_unit(answer: str) -> str | None:
    """The unit after a final answer's number (`5 km`, `5\\text{ km}`, `5 \\mathrm{~cm}`, `12\\%`, `90^{ \\circ }`,
    `3 cm^2`, `4 \\text{ in.}`) as its one spelling in _UNIT_SPELLINGS (`5 meters` and `5 m`: m), else None: a unit
    not in the table (`square units`, `mph`, a variable: `3 y`) is not judged, so it never fails an answer."""
    tail = _TAIL_END.sub("", answer[-200:])  # only the tail: an answer may be a long text
    found = _UNIT_TAIL.search(tail)
    if found is None:
        return None
    text, symbol, power = found.group(2), found.group(3), found.group(4) or ""
    unit = (text if text is not None else symbol).lower().replace("{", "").replace("}", "").replace("~", " ")
    unit = " ".join(unit.replace("\\,", " ").replace("\\ ", " ").split()).rstrip(".")
    unit = _UNITS.get(unit) or _UNITS.get(unit[:-1] if unit.endswith("s") else "")
    return None if unit is None else unit + "".join(power.replace("{", "").replace("}", "").split())


def units_differ(gold: str, completion: str) -> bool:
    """Both the answer cell and the completion's final answer name a known unit, and not the same one:
    `\\boxed{5 km}` (or `5\\text{ km}`) for the answer `5 m` scored 1 (math-verify drops units). No known unit on
    either side: graded as before (`\\boxed{5}` for `5 m`, `\\boxed{10 \\text{ cm}}` for 10)."""
    want, got = answer_unit(final_answer(gold)), answer_unit(final_answer(completion))
    return want is not None and got is not None and want != got


def yes_no(text: str) -> str | None:
    """The word of a final answer that is only `yes`, `no`, `true` or `false` in any case and wrapping (`Yes`, `The
    answer is yes.`, `\\boxed{No.}`, `\\text{No}`, `**Yes**`), lower case, else None: math-verify compared only the same
    text in a box (`\\boxed{no}`), so `The answer is no.` scored 0 for the answer `No`."""
    word = _TEXT_WRAPPER.sub(r"\1", final_answer(text)).strip(" \t\n$*.!:").lower()
    return word if word in _YES_NO else None


def worded_number(completion: str) -> int | None:
    """The number a completion's whole final answer writes in words (`\\boxed{seven}`, `The answer is seven.`,
    `twenty-one`, `one hundred`; each scored 0: math-verify reads s·e·v·e·n), else None. A word in prose is no
    answer: `I tried seven ways. The answer is 8.` answers 8."""
    answer = _TEXT_WRAPPER.sub(r"\1", final_answer(completion)).strip(" \t\n$*.!:")
    return words_value(answer) if _WORDS.fullmatch(answer) else None


def words_value(text: str) -> int | None:
    """`seven` 7, `twenty-one` 21, `two thousand three hundred and five` 2305 (up to 9999), else None."""
    words = [w for w in re.split(r"[\s-]+", text.lower()) if w and w != "and"]
    total = 0
    for name, scale in (("thousand", 1000), ("hundred", 100)):
        if len(words) >= 2 and words[1] == name and 0 < _ONES.get(words[0], 0) < 10:
            total, words = total + _ONES[words[0]] * scale, words[2:]
    if not words:
        return total or None
    if len(words) == 1 and words[0] in _ONES:
        rest = _ONES[words[0]]
    elif len(words) == 1 and words[0] in _TENS:
        rest = _TENS[words[0]]
    elif len(words) == 2 and words[0] in _TENS and 0 < _ONES.get(words[1], 0) < 10:
        rest = _TENS[words[0]] + _ONES[words[1]]
    else:
        return None
    return None if total and not rest else total + rest


def completion_percent(completion: str) -> str | None:
    """The number of a completion whose final answer is a percentage (its last box, else `the answer is 20%` or
    the bare `20%`), else None."""
    text = final_part(completion)
    boxes = list(_BOXED_PERCENT.finditer(text)) if "\\boxed" in text else []
    if "\\boxed" in text:
        last = text[text.rfind("\\boxed"):]
        return boxes[-1].group(1) if boxes and last.startswith(boxes[-1].group(0)) else None
    stated = list(_STATED_PERCENT.finditer(text))
    if stated and any(m.start() > stated[-1].start() for m in _ANSWER_IS.finditer(text)):
        return None  # `the answer is 20%. Wait: the answer is 30`: the later answer stands
    hedge = _HEDGED.match(text, stated[-1].start()) if stated else None
    if hedge and hedge[1] != hedge[2]:
        return None  # `the answer is 20% or 30%`: a hedge (unhedged), not the percentage 20
    bare = _BARE_PERCENT.fullmatch(text)
    return stated[-1].group(1) if stated else bare.group(1) if bare else None


def percent_verdict(gold: str, number: str) -> bool:
    """A completion answering `number`%: against a gold percentage, the two percentages' numbers (20% is not
    0.2%: math-verify read `\\boxed{0.2\\%}` as 0.2, which a gold 20% also reads as); against a plain gold, its
    value (20% = 0.2) or its number (50% for the answer 50, as a gold 50% takes 50)."""
    gold_number = _BARE_PERCENT.fullmatch(gold)
    if gold_number is not None:
        return graded(gold_number.group(1), f"\\boxed{{{number}}}")
    value = format(Decimal(number) / 100, "f")
    return graded(gold, f"\\boxed{{{value}}}") or graded(gold, f"\\boxed{{{number}}}")


def graded(gold: str, completion: str, any_order: bool = False) -> bool:
    """math-verify's verdict, numbers far from 1 compared by their relative difference (any_order: in_any_order)."""
    from math_verify import verify  # here: it imports sympy (seconds), and pre-flight imports this module

    from sympy import Set, Tuple  # (the same: math-verify's own dependency)

    target = gold_parsed(gold)
    one = bool(target) and not isinstance(target[0], (Set, Tuple))  # one value: the last box is the answer
    got = completion_parsed(completion, last_box=one)
    if any_order:
        target, got = tuple(in_any_order(target)), in_any_order(got)
    verdict = bool(target) and bool(verify(list(target), got, timeout_seconds=None))
    (a, exact_a), (b, exact_b) = (one_number(x) for x in (target, got))
    if a is None or b is None or (exact_a and exact_b):  # two integers or fractions: math-verify compares exactly
        return verdict
    if exact_a:  # an exact answer (integer, fraction, surd, π) and a decimal: the decimal must be that number, not
        # within math-verify's 6 places (0.333333 for 1/3) or a relative 1e-6 (100000000.0 for 100000007: a hack)
        return bool(abs(a - b) <= EXACT_DECIMAL * max(abs(a), 1))
    scale = max(abs(a), abs(b))
    if SMALL <= scale < LARGE:
        return verdict
    return bool(abs(a - b) <= RELATIVE * scale)


def in_any_order(parsed: Any) -> list:
    """A parsed list's members sorted (math-verify's own sort key), as one tuple: a tuple, a set as written (its
    duplicates kept: `\\boxed{1, 1}` is the set {1}, written with two) or an open interval ((1, 2), as math-verify reads a pair); so a
    number_list cell ([1, 2]) is graded in any order, each member as often as it holds it. Anything else as it is."""
    from math_verify.grader import sort_key  # (the same)
    from sympy import FiniteSet, Interval, Tuple, ordered  # (the same)

    first = parsed[0] if parsed else None
    if isinstance(first, Interval) and first.left_open and first.right_open:
        members = [first.start, first.end]
    elif isinstance(first, Tuple):
        members = list(first.args)
    elif isinstance(first, FiniteSet):
        members = list(getattr(first, "_unsorted_args", first.args))
    else:
        return list(parsed)
    return [Tuple(*ordered(members, keys=sort_key, default=False)), *parsed[1:]]


def one_number(parsed: Any) -> tuple[Any, bool]:
    """(the parsed answer's value when it is one real number: a sympy Float of 30 digits, else None; whether it is
    exact: no float in it)."""
    from sympy import Basic, Float

    first = parsed[0] if parsed else None
    if not isinstance(first, Basic) or not first.is_number or first.has(Float("nan")):
        return None, False
    try:
        value = first.evalf(30)
    except Exception:  # noqa: BLE001  (sympy's evaluation of an odd expression: no number, math-verify decides)
        return None, False
    return (value if isinstance(value, Float) and value.is_finite else None), not first.atoms(Float)


def boxed_numbers(text: str) -> str:
    """A number in a box as a model writes it: `\\boxed{1 000 000}` (digit groups; math-verify reads 1·0·0), other
    numbers side by side as a list (`\\boxed{1 2}`: 1, 2, as an answer cell `1 2` reads) and `\\boxed{10.}` (a
    sentence's full stop; read as the text '10.') as the number."""
    text = _BOX_GROUPS.sub(lambda m: "\\boxed{" + m.group(1).replace(" ", "") + "}", text)
    text = _BOX_SPACED.sub(lambda m: "\\boxed{" + ", ".join(m.group(1).split()) + "}", text)
    return _BOX_STOP.sub(r"\\boxed{\1}", text)


def completion_parsed(completion: str, last_box: bool = False) -> list:
    """The completion's final answer as math-verify parses it (after a reasoning model's last `</think>`; numbers in
    e-notation written out: e_notation). A completion that is only a bare answer ((3, -2),
    1, 2) reads as an answer cell does; one whose last \\boxed{ never closes (cut off at max_new_tokens) has none;
    one in GSM8K's format (no box) by what follows its first `####` on that line (`####72`; not a number the model
    wrote after it, running on into a new question)."""
    from math_verify import parse  # (the same)

    text = e_notation(normalized(tagged_answer(final_part(completion))))
    text = text.replace("\\fbox", "\\boxed")  # math-verify reads \fbox's content, not its anchor
    text = boxed_numbers(_ANSWER_WORDS.sub("", text))  # \boxed{\text{The answer is } 5}: the words are no part
    if unclosed_box(text):  # of the answer
        return []
    if last_box and text.count("\\boxed") > 1:  # `\boxed{3} ... wait, \boxed{4}` read as the set {3, 4}: for a
        text = text[text.rfind("\\boxed"):]  # one-value answer the last box is the model's final one
    if "####" in text and "\\boxed" not in text:  # GSM8K's format: its answer line, not a run-on's last number
        line = _HASHES.search(text)
        text = (line.group(1) or "").strip() if line else ""
    elif "\\boxed" not in text:
        text = enumerated(latex_stated(stated_bare(last_stated(text))), one=last_box)
    text = unhedged(text)
    answer = _END_STOP.sub("", text.strip())  # `1/2.`: a sentence's full stop (math-verify found no number)
    if bare(answer):
        return list(gold_parsed(answer))
    got = parse(text, parsing_timeout=None)
    return percentages_read(text, got) if "\\%" in text else got


def percentages_read(text: str, got: list) -> list:
    """A completion with `\\%` as its numbers: math-verify 0.9 leaves `\\boxed{50\\%}` a string (50, as it reads
    `$50\\%$`), and read `\\boxed{20\\% \\text{ or } 30\\%}` (or `20\\%, 30\\%`) as its last value, 30: a hedge scored 1
    for the answer 30%; read without the signs, it is the list 20, 30, as `\\boxed{20 \\text{ or } 30}` is."""
    from math_verify import parse  # (the same)
    from sympy import Set, Tuple  # (the same)

    plain = parse(text.replace("\\%", ""), parsing_timeout=None)
    if all(isinstance(x, str) for x in got):
        return plain
    many = bool(plain) and isinstance(plain[0], (Set, Tuple)) and not (got and isinstance(got[0], (Set, Tuple)))
    return plain if many else got


def last_stated(text: str) -> str:
    """A completion with no box that states its answer more than once, from the last statement on: math-verify read
    `Answer: 5. Actually the answer is 7` as 5 (its `Answer:` first), so a retracted answer scored. Only a
    statement that gives a number counts (`I hope this answer is helpful` is none)."""
    said = [m for m in _ANSWER_IS.finditer(text) if _GIVES_NUMBER.match(text, m.end())]
    return text[said[-1].start():] if len(said) > 1 else text


def stated_bare(text: str) -> str:
    """The last statement's answer where it is a bare one (`The answer is (3, -2).`, `Answer: [1, 2]`; with no
    `answer is`, a bracketed one ending the text: `So the point is (3, -2).`), read as a whole completion that is
    only that answer is (bare); math-verify took its last number (-2, 2). Else the text."""
    said = [m for m in _ANSWER_IS.finditer(text) if _GIVES_NUMBER.match(text, m.end())]
    group = None if said else _STATED_GROUP.search(text)
    answer = stated_value(text, said[-1]) if said else group.group(1) if group else ""
    return answer if bare(answer) else text


def latex_stated(text: str) -> str:
    """The last statement's answer (or the whole text) where it is LaTeX with no `$` around it (`The answer is
    \\pi.`, `\\sqrt{2}/2`) as math, `$\\pi$`: math-verify reads LaTeX outside `$...$` only as a plain \\frac, so each
    scored 0. Not where it holds prose (`\\frac{1}{3} because ...`) or a percentage (percent_verdict reads those)."""
    said = list(_ANSWER_IS.finditer(text))
    answer = (stated_value(text, said[-1]) if said else text.strip()).rstrip(". ")
    if "\\" not in answer or any(c in answer for c in "$%\n") or _WORD.search(answer):
        return text
    return f"${answer}$"


def enumerated(text: str, one: bool = False) -> str:
    """A text that ends with an enumeration of numbers (_ENUMERATION: `The roots are x = 1 and x = 2.`) as that
    list, `$x = 1, x = 2$` (`1, 2` with no variable: a bare answer), which math-verify reads as a set: a number_list
    cell [1, 2] scored 0 for it, and a one-value answer 2 scored 1. Members that name two variables (`a = 3 and
    b = 2`: a question's unknowns, not its answers) leave the text as it is, and so, for a one-value answer (one),
    do members that say one value twice (`1/2 or 0.5`; `x = 1 and x = 1` is [1, 1]'s double root)."""
    from math_verify import verify  # (the same)

    start = max(len(text) - ENUMERATION_REACH, 0)
    found = _ENUMERATION.search(text, start)
    if found is None or _OPERAND.search(text, 0, found.start()) or len(set(re.findall(_VARIABLE, found[1]))) > 1:
        return text
    members = [m.strip(" $") for m in re.split(_MEMBER_SEP, found[1])]
    values = [list(gold_parsed(m)) for m in members]
    if one and all(verify(values[0], v, timeout_seconds=None) for v in values[1:]):
        return text
    listed = ", ".join(members)
    return listed if "=" not in listed else f"${listed}$"


def tagged_answer(text: str) -> str:
    """The last `<answer>...</answer>` (R1-Zero's template) as the final answer; math-verify found no number in
    `<answer>72</answer>` (touching the tags) and such runs were rewarded 0."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found and "\\boxed" not in text else text


def unhedged(text: str) -> str:
    """`The answer is 5 or 6` (no box; the text's last `answer is`) as both values, `5, 6`: a one-value answer then
    fails (math-verify read 5, and a hedge scored as a hit); `1/2 or 0.5` (one value twice) as the first."""
    from math_verify import verify  # (the same)

    last = list(_HEDGED.finditer(text)) if "\\boxed" not in text else []
    if not last or any(m.start() > last[-1].start() for m in _ANSWER_IS.finditer(text)):
        return text
    a, b = last[-1].groups()
    return a if verify(list(gold_parsed(a)), list(gold_parsed(b)), timeout_seconds=None) else f"{a}, {b}"


def final_part(completion: str) -> str:
    """What follows a reasoning model's last `</think>`: the answer it gives, not one it tried while thinking
    (`<think>maybe \\boxed{3}</think> The answer is 4` scored for 3). A `<think>` never closed (cut off at
    max_new_tokens while thinking) gives no answer, as an unclosed \\boxed{ does; no tags: the whole completion."""
    if completion.rfind(THINK_START) > completion.rfind(THINK_END):
        return ""
    return completion.rsplit(THINK_END, 1)[1] if THINK_END in completion else completion


def bare(text: str) -> bool:
    """The completion is only an answer: (3, -2), 2, 1, 6-5i, 1 000, `1 2` (the list 1, 2, as the answer cell reads);
    not other numbers side by side (`1 2+3`)."""
    return bool(_BARE.fullmatch(text)) and (not _SIDE_BY_SIDE.search(text) or bool(_NUMBER_CELL.fullmatch(text))
                                            or bool(_SPACED_NUMBERS.fullmatch(text)))


def normalized(text: str) -> str:
    """Unicode minus, π and √ as LaTeX, full-width forms and vulgar fractions (½) as ASCII, a mixed number (`1 1/2`)
    as its fraction; 1\\,234's thin-space separator dropped; Markdown emphasis around an answer (**72**) and an
    escaped currency sign (\\$72, -$5) dropped; an en dash before a number as a minus (–5, not 3–5), `1.5 x 10^3`'s x
    as *; ∞ and ° as LaTeX, × and · as *, superscripts (10⁸) as powers,
    \\varnothing and \\degree as \\emptyset and ^\\circ, `cm^2` as `\\text{ cm}^2`; a repeating decimal as its fraction
    (repeating_decimals)."""
    text = _WRAPPED.sub(lambda m: m.group(2) or m.group(3), _SIZED.sub("", text))
    text = _ESCAPED_DOLLAR.sub("", _MINUS_DOLLAR.sub("-", text))
    text = _X_TIMES_TEN.sub("*", _DASH_MINUS.sub("-", text))
    text = _SPACED_MINUS.sub("-", repeating_decimals(text.translate(_UNICODE)))
    text = _SUPERSCRIPT.sub(_power, text)
    text = _UNIT_POWER.sub(r"\\text{ \1}^\2", _SYNONYM.sub(lambda m: _SYNONYMS[m[0]], text))
    text = _SPACED_DEGREE.sub(r"^{\\circ}", text)  # 90^{ \circ }: math-verify read no number
    return _MIXED.sub(_improper, _THIN_SEPARATOR.sub("", text))


def _power(m: re.Match) -> str:
    """Superscript digits as a power: `^8` (plain text reads it too), `^{12}`, `^{-3}`."""
    digits = m[0].translate(_SUPER_DIGITS)
    return f"^{digits}" if len(digits) == 1 else f"^{{{digits}}}"


def repeating_decimals(text: str) -> str:
    """A repeating decimal as its exact fraction: `0.\\overline{3}`, `0.(3)`, `0.3\\dot{3}`, `0.333...`,
    as \\frac{1}{3} (each scored 0 for 1/3: math-verify read 0, or 0.333); `0.333` (no mark of a period) stays a
    finite decimal, wrong for 1/3 (EXACT_DECIMAL); `0.333...` is read both ways (ellipses_as_fractions)."""
    if "." not in text:
        return text
    text = _OVERLINE.sub(lambda m: as_fraction(*m.groups()), text)
    text = _PAREN_PERIOD.sub(lambda m: as_fraction(*m.groups()), text)
    return _DOTTED.sub(lambda m: as_fraction(m[1], m[2], m[3] + (m[4] or "") + (m[5] or "")), text)


def ellipses_as_fractions(text: str) -> str:
    """Decimals written out to an ellipsis (`0.333...`, `0.1666\\ldots`) as the fractions their digits repeat; a
    second reading beside the decimal as written (grade): `0.44...` is 4/9 to one grader and 0.44 cut short to
    another (an answer 0.44 scored 0 when only the period counted)."""
    return _ELLIPSIS.sub(_ellipsis, text) if "." in text else text


def _ellipsis(m: re.Match) -> str:
    """`0.1666...`: the digits' period (repeating_period) as the repeating part; none (`3.14159...`): as written."""
    found = repeating_period(m[2])
    return as_fraction(m[1], *found) if found else m[0]


def repeating_period(digits: str) -> tuple[str, str] | None:
    """(the digits before the period, the period) for decimals written out to an ellipsis: the shortest lead, then
    the shortest period, that the digits after the lead repeat at least twice (`333`: '', '3'; `1666`: '1', '6';
    `142857142857`: '', '142857'); None where no period repeats (`14159`)."""
    for lead in range(len(digits) - 1):
        tail = digits[lead:]
        for size in range(1, len(tail) // 2 + 1):
            if tail == (tail[:size] * (len(tail) // size + 1))[: len(tail)]:
                return digits[:lead], tail[:size]
    return None


def as_fraction(whole: str, fixed: str, period: str) -> str:
    """`whole.fixed(period)` as LaTeX `\\frac{p}{q}` (an integer as itself: 0.(9) is 1)."""
    k = len(fixed)
    value = int(whole or 0) + Fraction(int(fixed or 0), 10**k) + Fraction(int(period), (10 ** len(period) - 1) * 10**k)
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _improper(m: re.Match) -> str:
    """`1 1/2` as 3/2 (a mixed number); `1 3/2` or `1 0/2` (no proper fraction) as written."""
    whole, num, den = (int(g) for g in m.groups())
    return f"{whole * den + num}/{den}" if 0 < num < den else m.group(0)


def e_notation(text: str) -> str:
    """Numbers in e-notation as math reads them: math-verify reads `1e21` as 1·e·21 (Euler's e), so a completion
    `\\boxed{1e21}` never matched the answer 1e21. Written out up to EXPANDED_EXPONENT (1e21 → 1000...0, 2.5e-3 →
    0.0025), beyond it as `m \\times 10^{n}` (1e999999999 is not written out: a billion digits)."""
    def expand(m: re.Match) -> str:
        mantissa, exponent = m.group(1), m.group(2).lstrip("+")
        if len(exponent.lstrip("-").lstrip("0")) > 6 or abs(int(exponent)) > EXPANDED_EXPONENT:
            return f"{mantissa} \\times 10^{{{exponent}}}"
        try:
            return format(Decimal(m.group(0)), "f")
        except InvalidOperation:
            return m.group(0)
    return _E_NUMBER.sub(expand, text)


def unclosed_box(text: str) -> bool:
    """The last \\boxed{ opens a brace that the text never closes."""
    at = text.rfind("\\boxed")
    rest = text[at + len("\\boxed") :].lstrip() if at >= 0 else ""
    return rest.startswith("{") and closing_brace(rest) is None


@lru_cache(maxsize=65536)
def gold_parsed(gold: str) -> tuple:
    """The answer cell parsed as a grader parses a reference answer: a number as it is (`1,000`, `1/2`, `.5`,
    `1e3`, `1 000`), numbers side by side as a list (`1 2`: 1, 2), LaTeX or a bare expression (`\\frac12`,
    `(3, -2)`, `1, 2`, `6 - 5i`) as math, a worked solution by its last boxed answer (MATH) or the number after
    `####` (GSM8K), prose (`18 dollars`) by its last number."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse  # (the same)

    _quiet_timeout_warnings()
    text = normalized(gold).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    text = percent_cell(text)
    if _EXPONENT.fullmatch(text):
        text = e_notation(text)
    if _SPACED_NUMBERS.fullmatch(text) and not _NUMBER_CELL.fullmatch(text):  # not digit groups (1 000)
        text = ", ".join(text.split())
    text = text.replace("\\fbox", "\\boxed")
    if text.count("\\boxed") > 1:  # a worked solution (MATH's): its last box is the answer (`f(2) = \\boxed{7}, so
        text = text[text.rfind("\\boxed"):]  # g(f(2)) = \\boxed{8}` was the set {7, 8}: 8 scored 0, `7, 8` 1)
    if "\\boxed" in text or _DOLLAR.search(text):
        boxed_first = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        return tuple(parse(text, boxed_first, parsing_timeout=None))
    readings = [f"${text}$", text]  # the whole cell as math first, then as a completion is read
    if _NUMBER_CELL.fullmatch(text) or (_WORD.search(text) and not any(h in text for h in _LATEX_HINTS)):
        readings.reverse()  # a number, or prose: its (last) number first
    return tuple(parse(readings[0], parsing_timeout=None) or parse(readings[1], parsing_timeout=None))


def percent_cell(text: str) -> str:
    """A percentage answer cell (`5\\%`, `$12.5\\%$`, a solution's `\\boxed{25\\%}`) as `5%`: math-verify's expression
    reader parses it to its percentage (5·1/100), which its verify compares as 0.05, 1/20 or the number 5 (`5%` read
    so already); its LaTeX reader fails on `\\%` (the antlr 4.9.3 grammar we pin) and kept 5, so `\\boxed{0.05}`
    scored 0 for the cell `5\\%` and 1 for `5%`. Any other cell as it is."""
    found = _BARE_PERCENT.fullmatch(final_answer(text) if "\\boxed" in text else text)
    return f"{found.group(1)}%" if found else text


def percent_number(gold: str) -> str | None:
    """The number of a percentage answer cell (`5\\%`, `5%`, a solution's `\\boxed{5\\%}`: '5'), else None."""
    found = _BARE_PERCENT.fullmatch(percent_cell(gold))
    return found.group(1) if found else None


def not_math(gold: str) -> bool:
    """The answer cell is no math to the grader: a placeholder (n/a, ?, --), plain words (`four`, `yes`: math-verify
    reads f·o·u·r, so `\\boxed{4}` scores 0 and `\\boxed{ruof}` 1), or text it parses to no expression (`x=`). Such a
    row is rewarded only for the same text in \\boxed{}: pre-flight names them."""
    from sympy import Basic  # here: sympy takes seconds to import (math-verify's own dependency)

    text = gold.strip().strip("$").strip()
    if _PLACEHOLDER.fullmatch(text):
        return True
    if _WORD.search(text) and not any(c.isdigit() for c in text) and not any(h in text for h in _LATEX_HINTS):
        return True
    return not any(isinstance(x, Basic) for x in gold_parsed(gold))


def _quiet_timeout_warnings() -> None:
    """math-verify warns once that its timeouts are off and asks the caller to bound the call: ours does."""
    from math_verify import grader, parser  # (the same)

    grader.TIMEOUT_WARNING_SHOWN = parser.TIMEOUT_WARNING_SHOWN = True


class MathEnv(DatasetEnv):
    DEFAULT_REWARD = "grpo_launcher.envs.math:math_verify_match"
