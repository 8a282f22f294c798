"""env=math's grader on real-world answer shapes: each case (the row's answer cell as the dataset holds it, a model
completion, the verdict a careful grader gives) is scored through the env's own reward (make_env(env=math).score,
the path a run takes), timed, and printed as a markdown table; benchmarks/results/environments.md keeps it.

    python benchmarks/math_grading.py [--json out.json] [--before before.json]

--json writes the verdicts; --before adds a column with the verdicts another checkout wrote (the table before a
fix). The cases are also tests/unit/test_math_reward.py's table (it loads this file). AMBIGUOUS: shapes where two
careful graders disagree; their verdict is recorded, not asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GSM = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April "
    "and May.\n#### 72"
)
GSM_SEP = "Each costs 617 * 2 = <<617*2=1234>>1234 dollars.\n#### 1,234"
MATH_SOL = r"We have $2+3=5$ and $5 \cdot 2 = 10$, so the answer is $\boxed{10}$."
MATH_SOL_FRAC = r"The probability is $\frac{3}{6} = \boxed{\frac{1}{2}}$. Check: $\frac12 = 0.5$, and $2 \ne 3$."
PMAT = r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"
REVISED = (
    r"First guess: \boxed{3}. "
    + "Checking: 3 * 4 = 12, but the total must be 20, so 3 is too small. " * 2
    + (r"Hence the answer is \boxed{5}.")
)
LONG = "Let me think step by step. " + "We check 17 and 23 again. " * 2000 + r"So the answer is \boxed{41}."

# (source of the shape, answer cell, completion, verdict)
CASES = [
    # GSM8K: the answer cell is the worked solution ending "#### N" (openai/gsm8k's `answer` column)
    ("gsm8k", GSM, "The answer is 72.", 1),
    ("gsm8k", GSM, r"\boxed{72}", 1),
    ("gsm8k", GSM, r"\boxed{24}", 0),
    ("gsm8k", GSM, "48 + 24 = 96", 0),
    ("gsm8k", GSM_SEP, "1234", 1),
    ("gsm8k", GSM_SEP, r"\boxed{1234}", 1),
    ("gsm8k", GSM_SEP, "1235", 0),
    ("gsm8k", "#### 1,234", "1234", 1),
    ("gsm8k", "#### 1,234", "The total is 1,234.00", 1),
    ("gsm8k", "#### 1,234", "It costs $1,234.", 1),
    ("gsm8k", "#### 1,234", r"\boxed{\$1,234}", 1),
    ("gsm8k", "#### 1,234", r"\boxed{1234}", 1),
    ("gsm8k", "#### 1,234", r"\boxed{1.234}", 0),
    ("gsm8k", "#### 1,234", r"\boxed{123}", 0),
    ("gsm8k", 18, r"Janet makes \boxed{\$18} every day.", 1),
    ("gsm8k", 18, r"\boxed{18 \text{ dollars}}", 1),
    ("gsm8k", 18, "She makes $18 per day.", 1),
    ("gsm8k", 5, "5 + 3 = 8, so the answer is 8", 0),
    ("gsm8k", "18 dollars", r"\boxed{18}", 1),
    ("gsm8k", 1234, "1,234.5", 0),
    ("gsm8k", 42, "**Answer:** 42", 1),
    ("gsm8k", 42, "Final Answer: The final answer is $42$. I hope it is correct.", 1),
    # a completion in GSM8K's own format (a model tuned on it): its answer line, what follows the first `####`
    ("gsm8k-output", GSM, "48/2 = 24 in May, 48 + 24 = 72 in all.\n#### 72", 1),
    ("gsm8k-output", GSM, "####72", 1),
    ("gsm8k-output", GSM, "####\n72", 1),
    ("gsm8k-output", GSM, "#### 72 clips", 1),
    ("gsm8k-output", GSM, "#### 72\n\nQuestion: Tom has 15 apples and eats 3. How many are left?\nAnswer: 12", 1),
    ("gsm8k-output", GSM, "So 72 in all.\n#### 71", 0),
    ("gsm8k-output", GSM_SEP, "#### 1,234", 1),
    ("gsm8k-output", GSM_SEP, "#### $1,234", 1),
    ("gsm8k-output", GSM_SEP, "#### 1,235", 0),
    # MATH / MATH-500 / DeepScaleR: LaTeX answer cells
    ("math", "10", r"\boxed{10 \text{ cm}}", 1),
    ("math", r"10\text{ cm}", r"\boxed{10}", 1),
    ("math", r"5\text{ inches}", r"\boxed{5}", 1),
    ("math", r"90^\circ", r"\boxed{90}", 1),
    ("math", 90, r"\boxed{90^\circ}", 1),
    ("math", 90, r"\boxed{90^{\circ}}", 1),
    ("math", 90, "The angle is 90 degrees.", 1),
    ("math", r"90^\circ", r"\boxed{89^\circ}", 0),
    ("math", r"\$18.90", r"\boxed{18.90}", 1),
    ("math", r"\$18.90", r"\boxed{18.9}", 1),
    ("math", r"\dfrac{3}{4}", r"\boxed{\frac34}", 1),
    ("math", r"\frac{3}{4}", r"\boxed{\tfrac{3}{4}}", 1),
    ("math", r"\frac{3}{4}", r"\boxed{0.75}", 1),
    ("math", r"\frac{3}{4}", r"\boxed{3/4}", 1),
    ("math", r"\frac{3}{4}", r"\boxed{\dfrac{4}{3}}", 0),
    ("math", r"\frac{\sqrt{2}}{2}", r"\boxed{\sqrt{2}/2}", 1),
    ("math", r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{\sqrt2}{2}}", 1),
    ("math", r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}", 1),
    ("math", r"\frac{\sqrt{2}}{2}", r"\boxed{0.7071}", 0),
    ("math", r"\sqrt{\frac{3}{4}}", r"\boxed{\frac{\sqrt{3}}{2}}", 1),
    ("math", r"3\sqrt{2}", r"\boxed{\sqrt{18}}", 1),
    ("math", r"3\sqrt{2}", r"\boxed{4.24}", 0),
    ("math", r"2^{10}", r"\boxed{1024}", 1),
    ("math", r"2\pi", r"\boxed{2\pi}", 1),
    ("math", r"\frac{\pi}{3}", r"\boxed{\pi/3}", 1),
    ("math", r"4\pi", r"\boxed{4\pi \text{ cm}^2}", 1),
    ("math", r"2\pi", r"\boxed{6.28}", 0),
    ("math", r"(-\infty, 3)", r"\boxed{\left( -\infty, 3 \right)}", 1),
    ("math", r"(-\infty, 3)", r"\boxed{(-\infty, 3]}", 0),
    ("math", "[2,5)", r"\boxed{[2, 5)}", 1),
    ("math", "[2,5)", r"\boxed{(2,5)}", 0),
    ("math-500", r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \frac{\pi}{2})}", 1),
    ("math-500", r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(\frac{\pi}{2}, 3)}", 0),
    ("math", "(3, -2)", r"\boxed{\left(3, -2\right)}", 1),
    ("math", "(3, -2)", r"\boxed{(-2, 3)}", 0),
    ("math", "(3, -2)", r"\boxed{-2}", 0),
    ("math", "(3, -2)", "(3, -2)", 1),
    ("math", "(3, -2)", "-2", 0),
    ("math", 5, r"\boxed{x = 5}", 1),
    ("math", "x=5", r"\boxed{5}", 1),
    ("math", 5, r"\boxed{x = 3}. Since 5 > 3, done.", 0),
    ("math", 2, r"\boxed{2x}", 0),
    ("math", 1, r"\boxed{1+1}", 0),
    ("math", r"\frac{1}{2}", r"\boxed{\frac{1}{2}x}", 0),
    ("math", 2, r"\boxed{\sqrt{4}}", 1),
    ("math", 100, r"\boxed{10^2}", 1),
    ("math", 0, "I cannot solve this.", 0),
    ("math", 0, r"\boxed{}", 0),
    ("math", "x^2+2x+1", r"\boxed{(x+1)^2}", 1),
    ("math", 5, REVISED, 1),
    ("math", 3, REVISED, 0),
    ("math", "2, 3", r"so $x = \boxed{2}$ or $x = \boxed{3}$", 1),
    ("math", 3, r"so $x = \boxed{3}$ or $x = \boxed{5}$", 0),
    ("math", 5, r"\boxed 5", 1),
    ("math", 6, r"\boxed 5", 0),
    ("math", 5, r"\fbox{5}", 1),
    ("math", r"\frac{1}{2}", r"\boxed{\text{The answer is } \frac{1}{2}}", 1),
    ("math", -3, "\\boxed{\u22123}", 1),
    ("math", -3, "The answer is \u22123.", 1),
    ("math", 3, "\\boxed{\u22123}", 0),
    ("math", 3, "The answer is \u22123.", 0),
    ("math", r"-\frac{1}{2}", r"\boxed{-0.5}", 1),
    ("math", -2, r"\boxed{2}", 0),
    ("math", r"25\%", r"\boxed{25}", 1),
    ("math", r"10\%", r"\boxed{10\%}", 1),
    ("math", 1234, r"\boxed{1\,234}", 1),
    ("math", 10000, r"\boxed{10,\!000}", 1),
    ("math", r"10,\!000", r"\boxed{10000}", 1),
    ("math", 10000, r"\boxed{10{,}000}", 1),
    ("math", r"\sqrt{2}", "\\boxed{\u221a2}", 1),
    ("math", r"2\pi", "\\boxed{2\u03c0}", 1),
    ("math", 25, r"\boxed{25\%}", 1),
    ("math", r"1.5 \times 10^{6}", r"\boxed{1500000}", 1),
    ("math", 1500000, r"\boxed{1.5 \times 10^6}", 1),
    ("math", r"6.02 \times 10^{23}", r"\boxed{6.02\times10^{23}}", 1),
    ("math", r"6.02 \times 10^{23}", r"\boxed{6.02\times10^{22}}", 0),
    ("math", "1.5e6", "1500000", 1),
    ("math", r"\{1,2\}", r"\boxed{\{2, 1\}}", 1),
    ("math", r"\{1,2\}", r"\boxed{\{1, 3\}}", 0),
    ("math", "1, 2", r"\boxed{2, 1}", 1),
    ("math", "1, 2", r"\boxed{1}", 0),
    ("math", 1, r"\boxed{1, 2}", 0),
    ("math", "1, 2", r"\boxed{2}", 0),
    ("math", "1, 2", "2, 1", 1),
    ("math", 2, "1, 2", 0),
    ("math", "2, 3, 4", r"\boxed{4}", 0),
    ("math", PMAT, r"\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}", 1),
    ("math", PMAT, r"\boxed{\begin{pmatrix} 1 & 2 \\ 4 & 3 \end{pmatrix}}", 0),
    ("math", r"\begin{pmatrix} 2 \\ -1 \end{pmatrix}", r"\boxed{\begin{pmatrix} 2 \\ -1 \end{pmatrix}}", 1),
    ("math", r"6 - 5i", r"\boxed{6-5i}", 1),
    ("math", r"6 - 5i", r"\boxed{6+5i}", 0),
    ("math", r"6 - 5i", r"\boxed{5}", 0),
    ("math", "[2,5)", r"\boxed{5}", 0),
    ("math", r"\infty", r"\boxed{\infty}", 1),
    ("math", 3, r"\boxed{3.0001}", 0),
    ("math", 1000000, r"\boxed{1000001}", 0),
    ("math", 100, r"\boxed{100.4}", 0),
    ("math", r"\frac{1}{3}", r"\boxed{0.333}", 0),
    ("math", r"\text{(B)}", r"\boxed{\text{(B)}}", 1),
    ("math", r"\text{(B)}", r"\boxed{B}", 1),
    ("math", r"\text{(B)}", r"\boxed{(B)}", 1),
    ("math", r"\text{(B)}", r"\boxed{\text{(C)}}", 0),
    ("math", r"\text{(B)}", r"\boxed{C}", 0),
    ("math", "(C)", r"\boxed{C}", 1),
    ("math", r"\text{Evelyn}", r"\boxed{\text{Evelyn}}", 1),
    ("math", r"\text{Evelyn}", r"\boxed{\text{Bob}}", 0),
    ("math", "Yes", r"\boxed{\text{Yes}}", 1),
    ("math", "Yes", r"\boxed{\text{No}}", 0),
    ("math", r"\text{no}", r"\boxed{No}", 1),
    ("math-500", r"\$32,\!348", r"\boxed{32348}", 1),
    ("math-500", r"\$32,\!348", r"\boxed{\$32,348}", 1),
    ("math-500", r"\$32,\!348", r"\boxed{32,347}", 0),
    ("math-500", r"x \in [-2,7]", r"\boxed{[-2, 7]}", 1),
    ("math-500", r"x \in [-2,7]", r"\boxed{(-2, 7)}", 0),
    ("math-500", "p - q", r"\boxed{p-q}", 1),
    ("math-500", "p - q", r"\boxed{q-p}", 0),
    ("math-500", r"3\sqrt{13}", r"\boxed{\sqrt{117}}", 1),
    ("math-500", r"-\frac{1}{2}, \frac{1}{3}", r"\boxed{\frac13, -\frac12}", 1),
    ("math-500", r"-\frac{1}{2}, \frac{1}{3}", r"\boxed{\frac13}", 0),
    ("math-500", r"\text{(C)}", r"\boxed{\textbf{(C)}}", 1),
    ("math-500", r"\text{(C)}", r"\boxed{\textbf{(D)}}", 0),
    # an unboxed choice letter, read from the last `answer is` (0 before 2026-12-07: math-verify's string extraction
    # missed `(C)` and read `C is wrong, the answer is (D)` as C)
    ("math", r"\text{(C)}", "The answer is (C).", 1),
    ("math", "C", "C is wrong, the answer is (D).", 0),
    ("math", "D", "C is wrong, the answer is (D).", 1),
    ("math", "B", "Answer: B) 42", 1),
    ("math", "B", "I think the answer is B or C.", 0),
    ("math", "A", "The answer is A lot.", 0),
    ("math-500", r"\frac{14}{3}", r"\boxed{4\frac{2}{3}}", 1),
    ("math-500", r"\frac{14}{3}", r"\boxed{4.67}", 0),
    # a MATH `solution` cell (hendrycks MATH has no `answer` column): the boxed answer is the reference
    ("math-solution", MATH_SOL, r"\boxed{10}", 1),
    ("math-solution", MATH_SOL, r"\boxed{5}", 0),
    ("math-solution", MATH_SOL, r"\boxed{2}", 0),
    ("math-solution", MATH_SOL_FRAC, r"\boxed{0.5}", 1),
    ("math-solution", MATH_SOL_FRAC, r"\boxed{3}", 0),
    # AIME: integer answers 0-999, some datasets zero-pad them
    ("aime", "033", r"\boxed{33}", 1),
    ("aime", 33, r"\boxed{033}", 1),
    ("aime", 33, r"\boxed{330}", 0),
    # OlympiadBench: `final_answer` is a list of $...$ strings; Omni-MATH: `answer` text with $...$
    ("olympiadbench", [r"$\frac{1}{2}$"], r"\boxed{\frac12}", 1),
    ("olympiadbench", [r"$\frac{1}{2}$"], r"\boxed{2}", 0),
    ("olympiadbench", [r"$x=2$"], r"\boxed{2}", 1),
    ("olympiadbench", [r"$2$", r"$3$"], r"\boxed{3, 2}", 1),
    ("olympiadbench", [r"$2$", r"$3$"], r"\boxed{3}", 0),
    ("omni-math", r"$\frac{1}{2}$", r"\boxed{0.5}", 1),
    ("omni-math", r"$3$", r"\boxed{4}", 0),
    # model output shapes: thinking blocks, empty, truncated, long, pathological
    ("output", 5, "<think>maybe it is 3</think>\n\\boxed{5}", 1),
    ("output", 3, "1 2", 0),
    ("output", 1000, "1 000", 1),
    ("output", 5, "", 0),
    ("output", 5, "   \n", 0),
    ("output", 5, r"so x = 5 and the answer is \boxed{", 0),
    ("output", 5, r"with 5 apples the answer is \boxed{\frac{5", 0),
    ("output", 41, LONG, 1),
    ("output", 42, LONG, 0),
    ("output", 1, r"\boxed{9^{9^{9^{9}}}}", 0),
    ("output", 1, r"\boxed{(10^{10})!}", 0),
    ("output", 1, r"\boxed{1}" * 2000, 1),
    # found 2026-12-07 (each `was` scored the other way at b088b80). Roots stated in prose, no box: math-verify read
    # the last number (1 and 2 scored 0 for [1, 2], 1 for the one answer 2); read as the list they state
    ("math", [1, 2], "The roots are x = 1 and x = 2.", 1),  # was 0
    ("math", [1, 2], "The roots are x = 2 and x = 1.", 1),  # was 0
    ("math", [1, 2], "The roots are 1 and 2.", 1),  # was 0
    ("math", [1, 2], "x = 1 or x = 3", 0),
    ("math", [1, 2], "The roots are x = 1 and x = 1.", 0),
    ("math", "1, 2", "The roots are x = 1 and x = 2.", 1),  # was 0
    ("math", 2, "The roots are x = 1 and x = 2.", 0),  # was 1
    ("math", 2, "So a = 3 and b = 2.", 1),  # two unknowns, not two answers
    # a percentage answer cell in LaTeX (`5\%`): math-verify's LaTeX reader fails on `\%` (antlr 4.9.3) and kept 5,
    # so its value scored 0 (`5%` scored 1); read as math-verify reads `5%`: 0.05, 1/20 or the number 5
    ("math", r"5\%", r"\boxed{0.05}", 1),  # was 0
    ("math", r"12.5\%", r"\boxed{\frac{1}{8}}", 1),  # was 0
    ("math", r"5\%", "The answer is 0.05.", 1),  # was 0
    ("math", r"10\%", r"\boxed{0.1}", 1),  # was 0 (listed as ambiguous before)
    ("math-solution", r"So the rate is $\boxed{25\%}$.", r"\boxed{0.25}", 1),  # was 0
    ("math", "0.05", r"\boxed{5\%}", 1),
    ("math", r"5\%", r"\boxed{0.5}", 0),
    ("math", r"5\%", r"\boxed{50}", 0),
    ("math", r"1\%", r"\boxed{0.1}", 0),
    # symbols as a model types them: ° ∞ × (each read as no number or another one)
    ("math", 30, "\\boxed{30\u00b0}", 1),  # was 0
    ("math", r"30^\circ", "\\boxed{30\u00b0}", 1),  # was 0
    ("math", r"30^\circ", "\\boxed{31\u00b0}", 0),
    ("math", r"(-\infty, 3)", "\\boxed{(-\u221e, 3)}", 1),  # was 0
    ("math", r"\infty", "\\boxed{\u221e}", 1),  # was 0
    ("math", 1500, "1.5 \u00d7 10^3", 1),  # was 0
    ("math", 6, "\\boxed{2 \u00d7 3}", 1),
    # LaTeX stated without `$...$` or a box: math-verify reads only a plain \frac there
    ("math", r"\frac{\sqrt{2}}{2}", r"The answer is \sqrt{2}/2.", 1),  # was 0
    ("math", r"\pi", r"The answer is \pi.", 1),  # was 0
    ("math", r"\frac{\pi}{2}", "The answer is \u03c0/2.", 1),  # was 0
    ("math", r"\frac{1}{2}", r"The answer is \frac{1}{2}x.", 0),  # was 1
    ("math", r"\frac{1}{2}", r"The answer is \frac{1}{2} because it is half.", 1),
    # yes / no answer cells: only the same text in a box scored
    ("math", "Yes", "Yes", 1),  # was 0
    ("math", "yes", "The answer is yes.", 1),  # was 0
    ("math", "No", r"\boxed{No.}", 1),  # was 0
    ("math", "Yes", "The answer is no.", 0),
    ("math", "No", r"\boxed{\text{Yes}} ... wait, \boxed{\text{No}}", 1),
    # GSM8K losses: a minus before the currency sign
    ("gsm8k", "#### -5", "-$5", 1),  # was 0
    ("gsm8k", "#### -5", "The answer is -$5.", 1),  # was 0
    ("gsm8k", "#### 5", "-$5", 0),
]

# two careful graders disagree: the verdict is recorded (with the reason), not asserted
AMBIGUOUS = [
    (
        "math",
        5,
        r"First guess \boxed{3}; wait, wrong. Correct: \boxed{5}",
        "math-verify reads boxed answers "
        "under 70 characters apart with a separator between as one list ({3, 5}), as for x = \\boxed{2} or \\boxed{3}",
    ),
    ("math", 3, r"\boxed{3}. Or maybe \boxed{", "an answer, then a second box cut off (read as cut off: no answer)"),
    ("math", 0.5, r"\boxed{50\%}", "50% of what: a fraction 0.5, or the number 50 the question asks for in percent"),
    ("math", "1,234", r"\boxed{1, 234}", "a thousands separator or a list of two answers"),
    ("math", r"\frac{\pi}{3}", r"\boxed{60^\circ}", "the same angle in other units"),
    ("math", "y = 2x + 3", r"\boxed{2x+3}", "an equation's right side for the equation"),
    ("gsm8k", 1234, r"\boxed{1.234}", "a European thousands separator or a decimal point"),
    ("math", 5, "it is 5 or 6", "two answers hedged, no boxed one"),
    (
        "gsm8k-output",
        GSM,
        "#### 24\nWait: 48 + 24 = 72",
        "an answer line, then a correction without one: read by its answer line (GSM8K's strict match), as a run-on "
        "past `#### 72` into a new question must be",
    ),
]


def score_all(cases: list) -> list[tuple[float, float]]:
    """(verdict, seconds) per case, scored by env=math's reward as a run scores a sample."""
    sys.path.insert(0, str(ROOT / "src"))
    from grpo_launcher.envs import make_env
    from grpo_launcher.envs.base import Prompt
    from grpo_launcher.spec.compose import load_spec

    env = make_env(load_spec(["env=math"]))
    out = []
    for _, answer, completion, *_rest in cases:
        prompt = Prompt(
            text="q", answer=str(answer), agent_ref="math", row={"question": "q", "answer": answer}, source="table"
        )
        t0 = time.monotonic()
        verdict = env.score(prompt, completion)
        out.append((verdict, time.monotonic() - t0))
    return out


def cell(text: object, n: int = 60) -> str:
    s = text if isinstance(text, str) else json.dumps(text)
    s = s.replace("\n", "\\n")
    s = s if len(s) <= n else s[: n - 12] + f"...({len(s)} ch)"
    return "`" + s.replace("|", "\\|").replace("`", "'") + "`"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--before", type=Path)
    args = ap.parse_args()
    got = score_all(CASES)
    amb = score_all(AMBIGUOUS)
    if args.json:
        args.json.write_text(json.dumps({"cases": [v for v, _ in got], "ambiguous": [v for v, _ in amb]}))
    before = json.loads(args.before.read_text()) if args.before else None
    print("| # | shape | answer cell | completion | expected | " + ("before | " if before else "") + "now | s |")
    print("|---|---|---|---|---|" + ("---|" if before else "") + "---|---|")
    for i, ((src, answer, completion, want), (v, s)) in enumerate(zip(CASES, got), 1):
        was = f"{before['cases'][i - 1]:g}{'' if before['cases'][i - 1] == want else ' WRONG'} | " if before else ""
        print(
            f"| {i} | {src} | {cell(answer)} | {cell(completion)} | {want} | {was}{v:g}"
            f"{'' if v == want else ' WRONG'} | {s:.2f} |"
        )
    wrong = sum(v != c[3] for c, (v, _) in zip(CASES, got))
    was_wrong = sum(b != c[3] for c, b in zip(CASES, before["cases"])) if before else None
    print(
        f"\n{len(CASES)} cases: {wrong} wrong now"
        + (f", {was_wrong} before" if before else "")
        + f"; slowest {max(s for _, s in got):.2f} s"
    )
    print("\n| shape | answer cell | completion | verdict | why ambiguous |\n|---|---|---|---|---|")
    for (src, answer, completion, why), (v, _) in zip(AMBIGUOUS, amb):
        print(f"| {src} | {cell(answer)} | {cell(completion)} | {v:g} | {why} |")


if __name__ == "__main__":
    main()
