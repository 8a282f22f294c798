"""env=dataset as a user brings it (own small files): a row's own answer, as the env gives it to the model (the warm
start's target, Prompt.answer: the answer as text), is rewarded by the default reward (exact_match), whatever the
cell's JSON type and whichever column env.answer_key names. Found as a hostile user:
- env.answer_key=target: exact_match was called with answer=None (the rows have no `answer` column; only env=math
  copied it), so every correct completion scored 0 and the completion `None` scored 1;
- a JSON true/false answer (BoolQ's `answer`): the model is shown `true` (JSON text) but exact_match compared with
  Python's `True`: every correct completion scored 0."""

from __future__ import annotations

import json

import pytest

from grpo_launcher.envs.dataset import DatasetEnv
from grpo_launcher.envs.rewards import exact_match
from grpo_launcher.spec.schema import EnvSpec

# (the answer cell, a completion that must score 1, one that must score 0)
CELLS = [
    ("4", "4", "5"),
    (4, "4", "4.0"),
    (5.0, "5", "6"),
    (2.5, "2.5", "2"),
    (True, "true", "false"),
    (False, "false", "true"),
    ([1, 2], "[1, 2]", "[2, 1]"),
    ({"x": 1}, '{"x": 1}', "{'y': 1}"),
]


def env_for(tmp_path, rows: list[dict], **keys) -> DatasetEnv:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DatasetEnv(EnvSpec(name="dataset", train_path=str(path), val_path=str(path), **keys), seed=0)


@pytest.mark.parametrize("answer_key", ["answer", "target"])
def test_a_rows_own_answer_is_rewarded_whatever_its_type_and_column(tmp_path, answer_key):
    rows = [{"prompt": f"q{i}", answer_key: cell} for i, (cell, _, _) in enumerate(CELLS)]
    env = env_for(tmp_path, rows, answer_key=answer_key)
    prompts = env.train_prompts(1, 0, len(rows))
    for p in prompts:
        _, right, wrong = next(c for i, c in enumerate(CELLS) if rows[i]["prompt"] == p.text)
        assert env.score(p, p.answer) == 1.0, (p.text, p.answer)  # what the warm start teaches is rewarded
        assert env.score(p, right) == 1.0, (p.text, right)
        assert env.score(p, wrong) == 0.0, (p.text, wrong)
        assert env.score(p, "None") == 0.0


def test_python_spelling_of_a_bool_still_scores():
    assert exact_match("q", "True", answer=True) == 1.0 and exact_match("q", "true", answer=True) == 1.0


def test_no_answer_matches_nothing():
    assert exact_match("q", "None", answer=None) == 0.0


def test_preflight_finds_every_row_rewardable(tmp_path, launch_here):
    """The pre-flight answer check said 'can never be rewarded' for both files (and it was right)."""
    target = tmp_path / "t.jsonl"
    target.write_text("".join(json.dumps({"q": f"{i}+{i}=", "target": str(2 * i)}) + "\n" for i in range(3)))
    boolq = tmp_path / "b.jsonl"
    boolq.write_text("".join(json.dumps({"q": f"is {i} even?", "answer": i % 2 == 0}) + "\n" for i in range(3)))
    for data, key in ((target, "target"), (boolq, "answer")):
        r = launch_here(tmp_path, "env=dataset", f"env.train_path={data}", f"env.val_path={data}", "env.prompt_key=q",
                        f"env.answer_key={key}", "dry_run=true")
        assert r.returncode == 0, r.stderr
        assert "never be rewarded" not in r.stderr, r.stderr


# env.reward_fn=grpo_launcher.envs.rewards:last_number_match (math word problems): (answer, completion, verdict); the
# rows marked "was 0" scored 0 before (`1,000` read as 000; an answer cell `1,000` matched no completion)
LAST_NUMBER = [
    (1000, "There are 1,000 apples.", 1),  # was 0
    ("1,000", "1000", 1),  # was 0
    ("1,000", "so 1,000.", 1),  # was 0
    (1000000.5, "1,000,000.5", 1),  # was 0
    (-1234, "it is -1,234", 1),  # was 0
    (3, "1,2,3", 1),
    (3, "3 then 4", 0),
    ("1,2", "12", 0),  # a cell `1,2` is no grouped number
    (-3.5, "so -3.5.", 1),
    (5, "no number", 0),
]


@pytest.mark.parametrize("answer, completion, verdict", LAST_NUMBER)
def test_last_number_match_reads_thousands_separators(answer, completion, verdict):
    from grpo_launcher.envs.rewards import last_number_match

    assert last_number_match("q", completion, answer=answer) == verdict
