"""A hostile user's data files (benchmarks/results/environments.md, "Data files a user has"): each was read wrong
without a word (rows dropped, a prompt that is not what the model should see, an answer always scored 0) or refused
with an error that did not say what to do. Read through the run's path (load_split, a dry run's pre-flight)."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from grpo_launcher.envs.dataset import DataError, load_split
from grpo_launcher.envs.math import math_verify_match
from grpo_launcher.spec.schema import EnvSpec

ROWS = [{"question": "What is 2+3?", "answer": 5}, {"question": "Half of 1?", "answer": r"\frac{1}{2}"}]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def read(path: Path, which: str = "train", **keys) -> list[dict]:
    env = dataclasses.replace(EnvSpec(), name="math", prompt_key="question", **{f"{which}_path": str(path)}, **keys)
    return load_split(env, which).rows


def refusal(path: Path, **keys) -> str:
    with pytest.raises(DataError) as info:
        read(path, **keys)
    return str(info.value)


def jsonl(rows: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# --------------------------------------------------------------------------- formats a user has
def test_gzipped_tsv_and_upper_case_files_are_read(tmp_path):
    """.jsonl.gz / .csv.gz (hub dumps), .tsv, DATA.JSONL: refused at HEAD ('is not .jsonl, .json, .csv or .parquet')."""
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl(ROWS).encode()))
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress(b"question,answer\nWhat is 2+3?,5\n"))
    (tmp_path / "a.tsv").write_text("question\tanswer\nWhat is 2+3?\t5\nQ, with a comma\t1,000\n")
    (tmp_path / "A.JSONL").write_text(jsonl(ROWS))
    assert read(tmp_path / "a.jsonl.gz") == [{"question": "What is 2+3?", "answer": 5}, ROWS[1]]
    assert read(tmp_path / "a.csv.gz") == [{"question": "What is 2+3?", "answer": "5"}]
    assert read(tmp_path / "a.tsv")[1] == {"question": "Q, with a comma", "answer": "1,000"}
    assert len(read(tmp_path / "A.JSONL")) == 2
    (tmp_path / "not.jsonl.gz").write_text(jsonl(ROWS))  # named .gz, not gzip'ed
    assert "is named .gz but cannot be un-gzipped" in refusal(tmp_path / "not.jsonl.gz")
    (tmp_path / "a.txt").write_text("x")
    message = refusal(tmp_path / "a.txt")
    assert "is not .jsonl, .ndjson, .json, .csv, .tsv (each also gzip'ed" in message and ".parquet" in message


def test_json_lines_under_a_json_name_and_hf_data_field_are_read(tmp_path):
    """`datasets`' Dataset.to_json('x.json') writes JSON Lines: at HEAD 'x.json:2: not valid JSON (Extra data)'.
    {"data": [...]} (HF's json loader, field="data"): 'must hold a JSON list of objects'. pandas' default
    to_json (an object of columns) is still refused, saying how to write it."""
    (tmp_path / "lines.json").write_text(jsonl(ROWS))
    (tmp_path / "field.json").write_text(json.dumps({"version": "1.0", "data": ROWS}))
    (tmp_path / "columns.json").write_text(json.dumps({"question": {"0": "q"}, "answer": {"0": 1}}))
    assert read(tmp_path / "lines.json") == ROWS
    assert read(tmp_path / "field.json") == ROWS
    assert "an object of columns" in refusal(tmp_path / "columns.json")
    assert 'orient="records", lines=True' in refusal(tmp_path / "columns.json")
    (tmp_path / "bad.json").write_text(jsonl(ROWS) + "{oops\n")
    assert "bad.json: 1 row with invalid JSON: line 3 (Expecting property name" in refusal(tmp_path / "bad.json")


def test_a_directory_of_data_files_names_them(tmp_path):
    """A hub snapshot (data/train-00000-of-00001.parquet) given as the path: the error names the file to point at."""
    import pandas as pd

    (tmp_path / "hub" / "data").mkdir(parents=True)
    pd.DataFrame(ROWS[:1]).to_parquet(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    message = refusal(tmp_path / "hub")
    assert "not one written by datasets' save_to_disk; it holds 1 data file" in message
    assert "data/train-00000-of-00001.parquet" in message


def test_csv_headers_and_rows_that_would_be_misread_are_named(tmp_path):
    """A header naming 'answer' twice (the csv module kept the last column's cells), a ';'-separated export (one
    column named 'question;answer'), a row short of cells (reported as an empty answer)."""
    (tmp_path / "twice.csv").write_text("question,answer,answer\nq,1,2\n")
    (tmp_path / "semi.csv").write_text("question;answer\nq;1\n")
    (tmp_path / "short.csv").write_text("question,answer\nq\nr,2\n")
    assert "the header names 'answer' more than once" in refusal(tmp_path / "twice.csv")
    assert "separated by ';', not ','" in refusal(tmp_path / "semi.csv")
    assert "1 row with fewer cells than the header names (2): line 2" in refusal(tmp_path / "short.csv")


def test_rows_nested_under_a_key_are_named(tmp_path):
    """The HF datasets-server's lines ({"row_idx", "row": {...}}): 'no row has 'question'' now says where they are."""
    (tmp_path / "api.jsonl").write_text(jsonl([{"row_idx": 0, "row": ROWS[0], "truncated_cells": []}]))
    assert "the columns: row, row_idx, truncated_cells (the rows are objects under 'row'" in refusal(
        tmp_path / "api.jsonl"
    )


def test_a_nan_answer_is_an_empty_one(tmp_path):
    """JSON's NaN (pandas writes it for a missing number): at HEAD the row trained with the answer 'NaN'."""
    (tmp_path / "nan.jsonl").write_text('{"question": "q1", "answer": NaN}\n{"question": "q2", "answer": 4}\n')
    assert "1 row with an empty 'answer' (env.answer_key): line 1" in refusal(tmp_path / "nan.jsonl")


def test_an_empty_object_answer_is_an_empty_one(tmp_path):
    """{"answer": {}}: trained with the answer '{}' (an empty list was refused, an empty object was not)."""
    (tmp_path / "obj.jsonl").write_text('{"question": "q1", "answer": {}}\n{"question": "q2", "answer": 4}\n')
    assert "1 row with an empty 'answer' (env.answer_key): line 1" in refusal(tmp_path / "obj.jsonl")


# --------------------------------------------------------------------------- chat messages
BAD_MESSAGES = [  # at HEAD each was rendered (ChatML) as the comment shows, without a word
    [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],  # ...assistant\n2<|im_end|>...
    ["What is 2+3?"],  # <|im_start|>\n<|im_end|>: the question dropped
    [{"role": "user"}],  # an empty user message
    [{"role": "user", "content": None}],  # 'None'
    [{"role": "human", "content": "hi"}],  # a role the model was never trained on
    [{"from": "human", "value": "hi"}],  # ShareGPT: an empty turn
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],  # the list's repr
    [],  # pre-flight stopped: '<compose>: ValueError: Cannot apply chat template to an empty conversation'
]


def test_message_lists_a_template_would_render_wrong_are_named(tmp_path):
    (tmp_path / "chat.jsonl").write_text(jsonl([{"question": m, "answer": "2"} for m in BAD_MESSAGES]))
    message = refusal(tmp_path / "chat.jsonl")
    for line in [
        "1 row whose 'question' ends with the assistant's message (the model would be shown it: drop it from the "
        "prompt, or move it to the answer column): line 1",
        """1 row whose 'question' holds an item that is not a {"role", "content"} object: line 2""",
        "3 rows whose 'question' holds a message whose content is not text: lines 3, 4, 7",
        "1 row whose 'question' holds a message whose role is 'human', not one of system, developer, user, "
        "assistant, tool, ipython, function: line 5",
        """1 row whose 'question' holds ShareGPT-style {"from", "value"} messages, not {"role", "content"}: line 6""",
        "1 row with an empty 'question' (env.prompt_key): line 8",
    ]:
        assert f"\n      {line}\n" in message + "\n", (line, message)


def test_a_tool_call_turn_without_content_is_a_prompt(tmp_path):
    """OpenAI's assistant turn that calls a tool has content null: a multi-turn tool prompt is read as it is."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    msgs = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]
    (tmp_path / "tool.jsonl").write_text(jsonl([{"question": msgs, "answer": 5}]))
    assert read(tmp_path / "tool.jsonl")[0]["question"] == msgs


def test_openai_content_parts_are_given_as_their_text(tmp_path):
    """content=[{"type": "text", "text": ...}]: a text-only template printed the list's repr ("[{'type': ...")."""
    parts = [{"type": "text", "text": "What is "}, {"type": "input_text", "text": "2+3?"}]  # input_text: Responses API
    rows = [{"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}], "answer": 5}]
    (tmp_path / "parts.jsonl").write_text(jsonl(rows))
    assert read(tmp_path / "parts.jsonl")[0]["question"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
    ]


def test_message_lists_written_to_csv_are_judged_as_lists(tmp_path):
    """A CSV messages cell with content parts or ShareGPT turns: at HEAD it stayed a string, and the model was given
    its JSON text ('[{"role": "user", "content": [{"type": ...'). A blank prompt or answer is an empty one."""
    import csv

    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}]}]
    sharegpt = [{"from": "human", "value": "What is 2+3?"}]
    with open(tmp_path / "m.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["question", "answer"], [json.dumps(parts), "5"], [json.dumps(sharegpt), "5"]])
    message = refusal(tmp_path / "m.csv")
    assert """1 row whose 'question' holds ShareGPT-style {"from", "value"} messages""" in message
    assert "line 3" in message and "line 2" not in message  # the content parts are read as their text
    with open(tmp_path / "parts.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["question", "answer"], [json.dumps(parts), "5"]])
    assert read(tmp_path / "parts.csv")[0]["question"] == [{"role": "user", "content": "What is 2+3?"}]
    (tmp_path / "blank.jsonl").write_text(
        jsonl([{"question": " \n ", "answer": "5"}, {"question": "q", "answer": " "}])
    )
    message = refusal(tmp_path / "blank.jsonl")
    assert "1 row with an empty 'question' (env.prompt_key): line 1" in message
    assert "1 row with an empty 'answer' (env.answer_key): line 2" in message


def chat_model(path: Path) -> Path:
    from grpo_launcher.models.tiny import build_tokenizer

    path.mkdir()
    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 512,
           "tie_word_embeddings": True}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    tok = build_tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path


def test_a_dry_run_names_bad_messages_as_a_config_error(tmp_path, launch_here):
    """An empty message list stopped pre-flight with '<compose>: ValueError: Cannot apply chat template to an empty
    conversation'; a trailing assistant message passed. Both are now env.train_path's config error with a fix."""
    data = tmp_path / "chat.jsonl"
    data.write_text(jsonl([{"messages": [], "answer": "2"}, {"messages": BAD_MESSAGES[0], "answer": "2"}]))
    args = [f"env.train_path={data}", f"env.val_path={data}", "env.prompt_key=messages"]
    run = launch_here(tmp_path, "env=math", *args, f"model.path={chat_model(tmp_path / 'm')}", "dry_run=true")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "ValueError" not in run.stderr and "  - env.train_path: " in run.stderr
    assert "1 row with an empty 'messages' (env.prompt_key): line 1" in run.stderr
    assert "1 row whose 'messages' ends with the assistant's message" in run.stderr
    assert "fix: fix those rows' prompts: a string, or chat messages" in run.stderr


def test_the_answer_column_as_the_prompt_is_refused(tmp_path, launch_here):
    """env.prompt_key=answer (GSM8K's worked solution ending '#### 72'): at HEAD the model was shown its answer."""
    data = tmp_path / "gsm.jsonl"
    data.write_text(jsonl([{"question": "48 clips, half as many in May: total?", "answer": "48/2 = 24\n#### 72"}]))
    args = [f"env.train_path={data}", f"env.val_path={data}", "env.prompt_key=answer", "env.max_prompt_tokens=0"]
    run = launch_here(tmp_path, "env=math", *args, "train.max_total_sequence_length=128", "dry_run=true")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "  - env.answer_key, env.prompt_key: env.prompt_key and env.answer_key are both 'answer': the model " \
           "would be shown the answer in its prompt" in run.stderr  # fmt: skip


def test_exact_match_on_worked_solutions_is_warned_of(tmp_path, launch_here):
    """env=dataset's default reward (exact_match) on GSM8K's answer column: only the whole solution text scores, so
    every reward is 0; at HEAD nothing was said (the own-answer check passes: the answer matches itself)."""
    data = tmp_path / "gsm.jsonl"
    data.write_text(jsonl([{"question": "48 clips, half as many in May: total?", "answer": "48/2 = 24\n#### 72"}]))
    args = [f"env.train_path={data}", f"env.val_path={data}", "env.prompt_key=question", "env.max_prompt_tokens=0"]
    run = launch_here(tmp_path, "env=dataset", *args, "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert f"warning: 1 of 1 answers in {data} are worked solutions" in run.stderr, run.stderr
    assert "every reward would be 0; use env=math" in run.stderr
    run = launch_here(tmp_path, "env=math", *args, "train.max_total_sequence_length=128", "dry_run=true")
    assert run.returncode == 0 and "worked solutions" not in run.stderr, run.stderr


# --------------------------------------------------------------------------- answers
@pytest.mark.parametrize(
    "answer, completion, verdict",
    [
        ([1, 2], r"\boxed{1, 2}", 1),  # HEAD: 0 (the JSON text [1, 2] read as the interval [1, 2])
        ([1, 2], r"\boxed{2, 1}", 1),  # HEAD: 0; any order (math.number_list; 0 at 16319d9 only)
        ([1, 2], r"\boxed{2}", 0),
        ([1.5, "2"], r"\boxed{1.5, 2}", 1),  # HEAD: 0
        ([3], r"\boxed{3}", 1),
        ([3], r"\boxed{4}", 0),
    ],
)
def test_a_list_of_numbers_is_its_answers(answer, completion, verdict):
    assert math_verify_match("q", completion, answer=answer) == verdict


def test_exact_match_takes_a_whole_float_as_its_integer(tmp_path):
    """pandas makes an integer column with a missing value float64; dropping that row leaves 5.0: env=dataset's
    exact_match compared '5' with '5.0' and scored every correct completion 0 (at HEAD)."""
    import pandas as pd

    from grpo_launcher.envs import make_env
    from grpo_launcher.spec.compose import load_spec

    df = pd.DataFrame({"prompt": ["2+3?", "1+1?"], "answer": [5, None]}).dropna()
    df.to_parquet(tmp_path / "a.parquet")
    path = tmp_path / "a.parquet"
    env = make_env(load_spec(["env=dataset", f"env.train_path={path}", f"env.val_path={path}"]))
    prompt = env.train_prompts(1, 0, 1)[0]
    assert prompt.row["answer"] == 5.0
    assert [env.score(prompt, c) for c in ("5", "5.0", " 5\n", "6", "50")] == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_preflight_warns_of_repeated_prompts(tmp_path, launch_here):
    """Validation prompts that are also training prompts (validation then measures recall), and one prompt given two
    answers: a warning each, naming a row (at HEAD nothing was said). A list answer [1, 2] is not called
    unrewardable (its own JSON text is an interval to math-verify)."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text(
        jsonl([*ROWS, {"question": "What is 2+3?", "answer": 6}, {"question": "Roots?", "answer": [1, 2]}])
    )
    val.write_text(jsonl([{"question": "Half of 1?", "answer": 0.5}, {"question": "3+3?", "answer": 6}]))
    run = launch_here(tmp_path, "env=math", f"env.train_path={train}", f"env.val_path={val}", "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert "warning: 1 of 2 validation prompts are also training prompts: validation rewards will not measure " \
           f"held-out accuracy; the first at {val}:1" in run.stderr  # fmt: skip
    assert f"1 training row(s) repeat an earlier row's prompt with another answer (only one can be rewarded): " \
           f"{train}:3 (answer '6'; line 1: '5')" in run.stderr  # fmt: skip
    assert "can never be rewarded" not in run.stderr, run.stderr


def test_decimal_and_binary_answer_cells_are_graded(tmp_path, launch_here):
    """Parquet's decimal128 and binary answer columns: a config error without file, column or row at HEAD
    (`TypeError: Object of type Decimal is not JSON serializable`); now their text, graded."""
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpo_launcher.envs.dataset import answer_text

    assert answer_text(decimal.Decimal("1.50")) == "1.50" and answer_text(b"2.25") == "2.25"
    assert math_verify_match("q", r"\boxed{1.5}", answer=decimal.Decimal("1.50")) == 1.0
    for name, column in [("dec", pa.array([decimal.Decimal("1.50")], type=pa.decimal128(5, 2))),
                         ("bin", pa.array([b"1.5"], type=pa.binary()))]:
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"prompt": ["What is 1.5?"], "answer": column}), path)
        run = launch_here(tmp_path, "env=math", f"env.train_path={path}", f"env.val_path={path}",
                          "env.prompt_key=prompt", "dry_run=true")
        assert run.returncode == 0, run.stderr


def test_columns_the_reward_functions_do_not_get_are_named(tmp_path, launch_here):
    """env.answer_key=solution: the reward's `answer` argument is the solution, so the file's own `answer` column is
    not passed (at HEAD it was overwritten without a word), nor a `completion` column: a warning names both."""
    data = tmp_path / "t.jsonl"
    data.write_text(jsonl([{"question": "What is 2+3?", "answer": "5", "solution": "2+3 = \\boxed{5}",
                            "completion": "x"}]))
    run = launch_here(tmp_path, "env=math", f"env.train_path={data}", f"env.val_path={data}",
                      "env.prompt_key=question", "env.answer_key=solution", "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert "the reward functions do not get the file's column 'answer' (the `answer` argument is the 'solution' " \
           "column, env.answer_key) or 'completion'" in run.stderr  # fmt: skip


def test_a_pipe_or_a_device_as_a_data_file_is_refused_not_read():
    """A FIFO as env.train_path hung pre-flight (the dry run too) waiting for a writer; a link to /dev/zero read until
    memory ran out (MemoryError naming no key). Both are refused by name, nothing read."""
    import os
    import tempfile

    from grpo_launcher.envs.dataset import load_table

    with tempfile.TemporaryDirectory() as d:
        fifo, zero = Path(d) / "fifo.jsonl", Path(d) / "zero.jsonl"
        os.mkfifo(fifo)
        zero.symlink_to("/dev/zero")
        for p in (fifo, zero):
            with pytest.raises(DataError, match="is not a regular file"):
                load_table(str(p), "env.train_path")
