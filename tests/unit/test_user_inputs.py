"""What the user gave is what the run used (issue 30): data read as written, changed keys applied or refused on
resume, any causal LM's config.json, default run names that do not collide.

The fast tests run launch.py's main in this process (pre-flight and dry runs: nothing started); the `slow`
ones train a couple of steps through `python launch.py`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import ROOT


# ----------------------------------------------------------------------------- 1. data as written
def dataset_args(train: Path, val: Path, *more: str) -> list[str]:
    return ["env=dataset", f"env.train_path={train}", f"env.val_path={val}", "env.max_prompt_tokens=64",
            "train.max_total_sequence_length=80", *more]


def write_csv(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_csv_cells_arrive_as_the_file_wrote_them(tmp_path, launch_here):
    """"0487" keeps its leading zero, and the built-in exact match scores the right completion 1."""
    from grpo_launcher.envs.dataset import DatasetEnv
    from grpo_launcher.spec.compose import compose, to_spec

    data = write_csv(tmp_path / "rev.csv", """
        \ufeffprompt,answer,id
        7840,0487,1
        123,321,2
        """)  # with the byte-order mark a spreadsheet writes
    args = dataset_args(data, data, f"output_root={tmp_path}")
    run = launch_here(tmp_path, *args, "dry_run=true")
    assert run.returncode == 0, run.stderr
    env = DatasetEnv(to_spec(compose(args)).env)  # the env the run builds (validated by the launch above)
    first, second = sorted(env.val_prompts(), key=lambda p: p.row["id"])
    assert first.row == {"prompt": "7840", "answer": "0487", "id": "1"} and first.answer == "0487"
    assert env.score(first, " 0487\n") == 1.0 and env.score(first, "487") == 0.0
    assert second.source == f"{data}:3"  # file:line, the header is line 1


def test_a_csv_cell_longer_than_the_csv_modules_default_cap_is_read():
    """Long-context prompts: a 200 KiB cell (the csv module refuses cells over 128 KiB unless told)."""
    import tempfile

    from grpo_launcher.envs.dataset import _load_csv

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "long.csv"
        p.write_text("prompt,answer\n" + "7" * 200_000 + ",1\n")
        table = _load_csv(p, "env.train_path")
    assert len(table.rows[0]["prompt"]) == 200_000


def test_csv_row_with_too_many_cells_is_named(tmp_path, launch_here):
    data = write_csv(tmp_path / "bad.csv", """
        prompt,answer
        12,21
        34,43,extra
        """)
    run = launch_here(tmp_path, *dataset_args(data, data), "dry_run=true")
    assert run.returncode == 2 and "config error" in run.stderr
    assert f"{data}:3" in run.stderr and "env.train_path" in run.stderr, run.stderr


def test_json_chat_messages_in_a_csv_column_are_parsed(tmp_path, launch_here):
    """A messages column written to CSV as JSON text reaches the model as messages, not as literal text."""
    import csv

    from grpo_launcher.envs.dataset import load_split
    from grpo_launcher.spec.schema import EnvSpec

    msgs = [{"role": "system", "content": "Reverse the digits."}, {"role": "user", "content": "12"}]
    data = tmp_path / "chat.csv"
    with open(data, "w", newline="") as fh:
        csv.writer(fh).writerows([["messages", "answer"], [json.dumps(msgs), "21"], ["[not json", "x"]])
    args = dataset_args(data, data, "env.prompt_key=messages")
    run = launch_here(tmp_path, *args, "dry_run=true")  # the tiny model's tokenizer has no chat template
    assert run.returncode == 2 and "env.chat_template" in run.stderr and "chat messages" in run.stderr, run.stderr
    env = dataclasses.replace(EnvSpec(), name="dataset", train_path=str(data), val_path=str(data),
                              prompt_key="messages")
    chat, text = load_split(env, "val").rows
    assert chat["messages"] == msgs and text["messages"] == "[not json"  # only a real message list is parsed


# ----------------------------------------------------------------------------- 4. data pre-flight
def test_every_bad_row_is_named_in_one_config_error(tmp_path, launch_here):
    """Empty answers at lines 4 and 9, an empty prompt at line 5, a missing prompt at line 7: one launch names them
    all; past MAX_LISTED a problem says how many it left out."""
    from grpo_launcher.envs.dataset import MAX_LISTED

    rows = [{"prompt": f"{i}>", "answer": str(i)} for i in range(10)]
    rows[3]["answer"] = rows[8]["answer"] = ""
    rows[4]["prompt"] = ""
    del rows[6]["prompt"]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = launch_here(tmp_path, *dataset_args(data, data), "dry_run=true")
    assert run.returncode == 2 and "config error" in run.stderr
    for line in ("2 rows with an empty 'answer' (env.answer_key): lines 4, 9",
                 "1 row with an empty 'prompt' (env.prompt_key): line 5",
                 "1 row without 'prompt' (env.prompt_key): line 7", f"{data}:7 has the keys ['answer']"):
        assert line in run.stderr, run.stderr
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": "1>", "answer": ""}) + "\n" for _ in range(MAX_LISTED + 5)))
    run = launch_here(tmp_path, *dataset_args(many, data), "dry_run=true")
    assert f"{MAX_LISTED + 5} rows with an empty 'answer'" in run.stderr
    assert "lines 1, 2, 3" in run.stderr and f"(the first {MAX_LISTED} of {MAX_LISTED + 5})" in run.stderr


def test_a_binary_jsonl_names_the_key_and_the_file(tmp_path, launch_here):
    """Issue 43: `<compose>: UnicodeDecodeError` named neither env.train_path nor the file."""
    good = reverse_jsonl(tmp_path / "good.jsonl", 8)
    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)  # not UTF-8 from its first line
    run = launch_here(tmp_path, *dataset_args(binary, good), "dry_run=true")
    assert run.returncode == 2 and "config error" in run.stderr, run.stdout + run.stderr
    assert "env.train_path" in run.stderr and str(binary) in run.stderr and "not in UTF-8" in run.stderr
    assert "UnicodeDecodeError" not in run.stderr and "<compose>" not in run.stderr, run.stderr


def test_a_utf8_bom_jsonl_and_json_are_read_as_csv_is(tmp_path, launch_here):
    """An editor's byte-order mark before the first line (a CSV's was already dropped)."""
    from grpo_launcher.envs.dataset import load_table

    rows = [{"prompt": f"{i}{i + 1}>", "answer": f"{i + 1}{i}"} for i in range(8)]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    run = launch_here(tmp_path, *dataset_args(bom, bom), "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert load_table(str(bom), "env.train_path").rows == rows
    as_json = tmp_path / "bom.json"
    as_json.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert load_table(str(as_json), "env.train_path").rows == rows


def test_data_is_read_once_per_preflight_and_a_large_file_says_so(tmp_path, launch_here, monkeypatch):
    from grpo_launcher.envs import dataset, preflight

    data = reverse_jsonl(tmp_path / "d.jsonl", 8)
    reads: list[Path] = []
    real = dataset._load_jsonl
    monkeypatch.setattr(dataset, "_load_jsonl", lambda p, key: reads.append(p) or real(p, key))
    monkeypatch.setattr(preflight, "PROGRESS_BYTES", 0)  # every file counts as large
    run = launch_here(tmp_path, *dataset_args(data, data), "dry_run=true", f"output_root={tmp_path}")
    assert run.returncode == 0, run.stderr
    assert reads == [data, data]  # train and val, once each (a dry run validates twice: as given, as launched)
    assert f"pre-flight: reading {data}" in run.stderr and "d.jsonl: 8 rows: prompt tokens counted in" in run.stderr


BAD_REWARDS = '''
def nan(prompt, completion, **row):
    return float("nan")


def text(prompt, completion, **row):
    return "1.0"


def boom(prompt, completion, **row):
    raise KeyError("score")


def huge(prompt, completion, **row):
    return 1e39


def numpy_number(prompt, completion, **row):
    import numpy

    return numpy.float32(0.5)
'''


@pytest.mark.parametrize("fn,expect", [("nan", "returned nan (expected a finite float"),
                                       ("text", "returned '1.0' (expected a finite float"),
                                       ("boom", "raised KeyError"),
                                       ("huge", "returned 1e+39 (expected a finite float within float32's range"),
                                       ("numpy_number", None)])
def test_reward_functions_are_called_on_real_rows_at_preflight(tmp_path, launch_here, fn, expect):
    """A NaN, a string, a value past float32 (1e39: NaN weights after the update) or an exception from a reward
    function is a config error before anything starts; with
    env.reward_errors=zero an exception is left to the run (scored 0 and counted), a NaN is not."""
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    data = reverse_jsonl(tmp_path / "d.jsonl", 4)
    args = dataset_args(data, data, f"env.reward_fn=bad_rewards.py:{fn}", "dry_run=true", f"output_root={tmp_path}")
    run = launch_here(tmp_path, *args)
    if expect is None:  # numpy's float32 is a real number: a reward (it was refused)
        assert run.returncode == 0, run.stderr
        return
    assert run.returncode == 2 and "env.reward_fn" in run.stderr and expect in run.stderr, run.stderr
    assert f"{data}:1" in run.stderr and "called at pre-flight" in run.stderr
    zero = launch_here(tmp_path, *args, "env.reward_errors=zero")
    assert (zero.returncode == 0) == (fn == "boom"), zero.stderr


# ----------------------------------------------------------------------------- 3. any causal LM
# config.json as transformers 5's save_pretrained writes them (trimmed to the architecture keys)
CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_inner": None, "n_layer": 2, "n_positions": 128,
             "vocab_size": 512, "tie_word_embeddings": True, "activation_function": "gelu_new"},
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "vocab_size": 512, "tie_word_embeddings": False, "head_dim": 16},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "vocab_size": 512, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 128,
                "vocab_size": 512, "sliding_window": 4096},  # no tie_word_embeddings: MistralConfig's False
    "gemma": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128,
              "vocab_size": 512},  # no tie_word_embeddings: GemmaConfig's True
}
# (layers, hidden, heads, kv heads, ffn, vocab, positions, tied) as transformers resolves each
EXPECTED = {"gpt2": (2, 64, 4, 4, 256, 512, 128, True), "llama": (2, 64, 4, 2, 128, 512, 128, False),
            "qwen2": (2, 64, 4, 2, 128, 512, 128, True), "mistral": (2, 64, 4, 1, 128, 512, 128, False),
            "gemma": (2, 64, 4, 1, 128, 512, 128, True)}


def model_dir(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>", "pad_token": "<p>"}))
    return path


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_config_json_resolved_as_transformers_does(tmp_path, launch_here, family):
    from grpo_launcher.launch.preflight import preflight

    d = model_dir(tmp_path / f"tiny-{family}", CONFIGS[family])
    args = [f"model.path={d}", f"output_root={tmp_path}", "train.max_total_sequence_length=64"]
    run = launch_here(tmp_path, *args, "dry_run=true")
    assert run.returncode == 0, run.stderr
    m = preflight(args)[0].model
    got = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size,
           m.max_position_embeddings, m.tie_word_embeddings)
    assert (m.family, m.name, got) == (family, d.name, EXPECTED[family])


def test_gpt2_stated_width_that_disagrees_is_named(tmp_path, launch_here):
    d = model_dir(tmp_path / "g", CONFIGS["gpt2"])
    run = launch_here(tmp_path, f"model.path={d}", "model.ffn_hidden_size=100", "model.num_layers=3",
                      "train.max_total_sequence_length=64", "dry_run=true")
    assert run.returncode == 2 and "model.ffn_hidden_size=100" in run.stderr and "=256" in run.stderr
    assert "model.num_layers=3" in run.stderr and "n_layer=2" in run.stderr, run.stderr


def test_model_dir_reader_imports_no_transformers():
    code = ("import sys; from grpo_launcher.spec import model_dir; "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    proc = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- 8. rerun: the same door as a launch
def tampered_run_dir(tmp_path: Path) -> Path:
    """A run dir whose spec.yaml was edited by hand: train.lr is no number."""
    from grpo_launcher.spec.compose import spec_to_yaml
    from grpo_launcher.spec.schema import RunSpec

    run_dir = tmp_path / "edited"
    run_dir.mkdir()
    text = spec_to_yaml(RunSpec(output_root=str(tmp_path)))
    assert "  lr: 0.0003\n" in text
    (run_dir / "spec.yaml").write_text(text.replace("  lr: 0.0003\n", "  lr: abc\n"))
    return run_dir


def test_a_tampered_spec_value_names_the_key_and_spec_yaml(tmp_path, launch_here):
    """Issue 43: `<compose>: ValidationError` named neither train.lr nor spec.yaml (rerun, and the job's driver)."""
    run_dir = tampered_run_dir(tmp_path)
    run = launch_here(tmp_path, "rerun", str(run_dir), "dry_run=true")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "- train.lr: " in run.stderr and f"{run_dir}/spec.yaml" in run.stderr and "'abc'" in run.stderr, run.stderr
    assert "<compose>" not in run.stderr
    job = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "grpo_launcher.train.driver",
                          str(run_dir / "spec.yaml")], capture_output=True, text=True, timeout=300)
    assert job.returncode == 2 and "- train.lr: " in job.stderr and "Traceback" not in job.stderr, job.stderr[-3000:]


def test_rerun_with_another_model_path_reads_its_config_json(tmp_path, launch_here):
    """`rerun RUN_DIR model.path=OTHER` resolves OTHER's architecture (config.json) as a launch does, instead of
    keeping the saved one; a width stated on the command line that disagrees with it is named."""
    from grpo_launcher.launch.preflight import preflight
    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    llama, gpt2 = model_dir(tmp_path / "tiny-llama", CONFIGS["llama"]), model_dir(tmp_path / "tiny-gpt2", CONFIGS["gpt2"])
    spec = load_spec([f"model.path={llama}", f"output_root={tmp_path}", "name=orig",
                      "train.max_total_sequence_length=64"])
    run_dir = tmp_path / "orig"
    run_dir.mkdir()
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    run = launch_here(tmp_path, "rerun", str(run_dir), f"model.path={gpt2}", "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert "rerunning" in run.stdout and "run 'orig-rerun1'" in run.stdout, run.stdout
    m = preflight([f"model.path={gpt2}"], saved=run_dir / "spec.yaml")[0].model
    got = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size,
           m.max_position_embeddings, m.tie_word_embeddings)
    assert (m.family, m.name, got) == ("gpt2", "tiny-gpt2", EXPECTED["gpt2"])
    kept = preflight(["grpo.max_steps=3"], saved=run_dir / "spec.yaml")[0]  # no new model.path: the saved model
    assert kept.model == spec.model and kept.name == "orig-rerun1" and kept.grpo.max_steps == 3
    run = launch_here(tmp_path, "rerun", str(run_dir), f"model.path={gpt2}", "model.ffn_hidden_size=100",
                      "dry_run=true")
    assert run.returncode == 2 and "model.ffn_hidden_size=100" in run.stderr and "=256" in run.stderr, run.stderr


def fake_checkpoint(root: Path, name: str, step: int, **changes: object) -> Path:
    """RUN_DIR/checkpoints/step_N/meta.json as a run of `name` with these spec keys would have written it."""
    from grpo_launcher.checkpoint.manager import CheckpointManager
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec([f"name={name}", f"output_root={root}", *(f"{k}={v}" for k, v in changes.items())])
    ckpt = root / name / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    CheckpointManager(ckpt.parent, spec).write_meta(ckpt, step, {"mlflow_run_id": None}, {})
    return ckpt


def test_keys_that_cannot_change_are_refused_each_named(tmp_path, launch_here):
    fake_checkpoint(tmp_path, "r", 2, **{"grpo.max_steps": 2})
    run = launch_here(tmp_path, "name=r", f"output_root={tmp_path}", "grpo.max_steps=4", "model.ffn_hidden_size=128",
                      "grpo.num_generations_per_prompt=4", "train.global_batch_size=64", "train.lr=1e-5")
    assert run.returncode == 2 and "config error" in run.stderr
    for key in ("model.ffn_hidden_size", "grpo.num_generations_per_prompt", "checkpoint.resume=fresh"):
        assert key in run.stderr, run.stderr
    assert "train.lr" not in run.stderr  # it may change mid-run


def test_spec_changes_are_recorded_in_the_run_dir(tmp_path):
    from grpo_launcher.checkpoint.manager import SPEC_CHANGES, load_meta, record_spec_changes
    from grpo_launcher.spec.compose import load_spec

    meta = load_meta(fake_checkpoint(tmp_path, "r", 2, **{"grpo.max_steps": 2}))
    spec = load_spec(["name=r", f"output_root={tmp_path}", "grpo.max_steps=3", "train.lr=1e-5", "loss=dapo",
                      "checkpoint.resume=auto"])
    said: list[str] = []
    changes = record_spec_changes(tmp_path / "r", meta, spec, say=said.append)
    assert changes["train.lr"] == (3e-4, 1e-5) and changes["grpo.max_steps"] == (2, 3)
    assert "loss.clip_high" in changes and "name" not in changes  # loss=dapo: its coefficients, each a key
    (line,) = (tmp_path / "r" / SPEC_CHANGES).read_text().splitlines()
    rec = json.loads(line)
    assert rec["from_step"] == 3 and rec["changes"]["train.lr"] == {"old": 3e-4, "new": 1e-5}
    assert "train.lr 0.0003 → 1e-05" in said[0] and "from step 3" in said[0]
    assert record_spec_changes(tmp_path / "r", load_meta(tmp_path / "r/checkpoints/step_000002"),
                               load_spec(["name=r", f"output_root={tmp_path}", "grpo.max_steps=2", "dry_run=true"]),
                               say=said.append) == {}


# ----------------------------------------------------------------------------- 5. prompts as recorded
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_prompting_json_records_each_splits_first_prompt_and_system_source(tmp_path):
    """Train rows carry their own system message (CSV, JSON messages), val rows are strings: one rule for both (a
    row's own system message wins, the others get env.system_prompt), and the record says which each split got."""
    import csv

    from grpo_launcher.envs.dataset import DatasetEnv
    from grpo_launcher.envs.prompting import split_prompts
    from grpo_launcher.models.tiny import build_tokenizer
    from grpo_launcher.spec.compose import compose, to_spec
    from grpo_launcher.tracking.report import write_prompting

    train = tmp_path / "train.csv"
    with open(train, "w", newline="") as fh:
        rows = [[json.dumps([{"role": "system", "content": "Row system."}, {"role": "user", "content": "12"}]), "21"],
                [json.dumps([{"role": "user", "content": "34"}]), "43"]]
        csv.writer(fh).writerows([["prompt", "answer"], *rows])
    val = write_csv(tmp_path / "val.csv", "prompt,answer\n56,65\n")
    spec = to_spec(compose(dataset_args(train, val, "env.chat_template=true", "env.system_prompt=CLI system.",
                                        "env.shuffle=false")))
    env = DatasetEnv(spec.env)
    tok = build_tokenizer()
    tok.chat_template = CHATML
    rec = write_prompting(tmp_path, tok, spec.env, splits=split_prompts(env, 4))
    assert rec["first_prompt"]["train"] == ("<|im_start|>system\nRow system.<|im_end|>\n<|im_start|>user\n12<|im_end|>"
                                            "\n<|im_start|>assistant\n")
    assert rec["first_prompt"]["val"].startswith("<|im_start|>system\nCLI system.<|im_end|>\n<|im_start|>user\n56")
    assert rec["system_prompt_source"] == {"train": "1 prompt: their own system message; 1 prompt: env.system_prompt",
                                           "val": "1 prompt: env.system_prompt"}
    assert json.loads((tmp_path / "prompting.json").read_text())["first_prompt"] == rec["first_prompt"]


# ----------------------------------------------------------------------------- 6. rewards
REWARDS = '''
def correct(prompt, completion, answer, **row):
    return float(completion.strip() == answer)


def flaky(prompt, completion, answer, id, **row):
    if id == "row-5":
        raise ValueError("cannot parse this one")
    return 0.5
'''


def reverse_jsonl(path: Path, n: int, prefix: str = "row") -> Path:
    rows = [{"prompt": f"{(i * 7919) % 10000:04d}>", "answer": f"{(i * 7919) % 10000:04d}"[::-1], "id": f"{prefix}-{i}"}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reward_errors_zero_scores_the_failing_function_0_and_keeps_the_error(tmp_path):
    """env.reward_errors=zero: the failing function scores 0 on that row, the others still count; raise: the
    error names the function and the row."""
    from grpo_launcher.envs.dataset import DatasetEnv, UserCodeError
    from grpo_launcher.envs.rewards import reward_metrics
    from grpo_launcher.spec.compose import compose, to_spec

    (tmp_path / "rewards.py").write_text(REWARDS)
    data = reverse_jsonl(tmp_path / "d.jsonl", 8)
    args = dataset_args(data, data, f"env.reward_fns=[{tmp_path}/rewards.py:correct,{tmp_path}/rewards.py:flaky]",
                        "env.reward_weights=[1.0,2.0]")
    env = DatasetEnv(to_spec(compose([*args, "env.reward_errors=zero"])).env)
    prompts = env.val_prompts()
    scored = [env.score_detail(p, p.answer) for p in prompts]
    assert scored[5].total == 1.0 and scored[5].parts == {"correct": 1.0, "flaky": 0.0}
    assert "ValueError: cannot parse this one" in scored[5].error and f"{data}:6" in scored[5].error
    assert "Traceback" in scored[5].error and scored[0].total == 2.0 and scored[0].error is None
    m = reward_metrics("val", scored)
    assert m == {"val/reward/correct_mean": 1.0, "val/reward/flaky_mean": 0.5 * 7 / 8, "val/reward_errors": 1.0}
    strict = DatasetEnv(to_spec(compose(args)).env)  # the default: raise
    with pytest.raises(UserCodeError, match="rewards.py:flaky raised ValueError"):
        strict.score(prompts[5], "x")


def test_reward_errors_takes_raise_or_zero(tmp_path, launch_here):
    run = launch_here(tmp_path, "env.reward_errors=skip", "dry_run=true")
    assert run.returncode == 2 and "env.reward_errors" in run.stderr, run.stderr


# ----------------------------------------------------------------------------- 7. defaults that work
def test_default_name_after_a_finished_default_run_takes_the_overrides(tmp_path, launch_here):
    """`python launch.py` (finished), then `python launch.py rollout=vllm`: the second is a run of its own."""
    fake_checkpoint(tmp_path, "tiny-grpo", 150)
    root = f"output_root={tmp_path}"
    run = launch_here(tmp_path, root, "rollout=vllm", "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert "run 'tiny-grpo_rollout=vllm'" in run.stdout and "would be refused" not in run.stdout, run.stdout
    more = launch_here(tmp_path, root, "grpo.max_steps=160", "dry_run=true")  # extends the run: keeps its name
    assert "run 'tiny-grpo' (local)" in more.stdout, more.stdout


def test_dataset_takes_its_prompt_budget_from_the_data(tmp_path, launch_here):
    """env=dataset without env.max_prompt_tokens: the longest prompt of train and val, as templated, said and kept in
    the spec; a number given caps it as before."""
    from grpo_launcher.launch.preflight import preflight

    train = reverse_jsonl(tmp_path / "train.jsonl", 8)
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "1234567890123>", "answer": "x"}) + "\n")  # 14 tokens, the longest
    args = ["env=dataset", f"env.train_path={train}", f"env.val_path={val}", f"output_root={tmp_path}"]
    run = launch_here(tmp_path, *args, "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert f"env.max_prompt_tokens=14: the longest prompt of the data ({val}:1)" in run.stdout, run.stdout
    assert preflight([*args, "dry_run=true"])[0].env.max_prompt_tokens == 14
    run = launch_here(tmp_path, *args, "env.max_prompt_tokens=8", "dry_run=true")
    assert run.returncode == 2 and "exceed env.max_prompt_tokens=8" in run.stderr, run.stderr


def test_a_prompt_budget_from_data_that_is_not_here_is_asked_for(tmp_path, launch_here):
    run = launch_here(tmp_path, "env=dataset", "env.train_path=/cluster/only/train.jsonl", "cluster=slurm",
                      "env.val_path=/cluster/only/val.jsonl", "cluster.account=a", "cluster.partition=p",
                      f"output_root={tmp_path}", "dry_run=true")
    assert run.returncode == 2 and "env.max_prompt_tokens=0 takes the longest prompt" in run.stderr, run.stderr


def test_async_alone_picks_devices_for_the_engines_and_the_plan_shows_them(tmp_path, launch_here):
    """`grpo.async_grpo.enabled=true` alone: one more CPU slot for the engine (a 1-slot CPU run), or half of a
    larger job's devices; a stated cluster.rollout_devices=0 is refused with one override line to add."""
    from grpo_launcher.launch.preflight import preflight

    root = f"output_root={tmp_path}"
    run = launch_here(tmp_path, root, "grpo.async_grpo.enabled=true", "dry_run=true")
    assert run.returncode == 0, run.stderr
    assert "cluster.rollout_devices=1 cluster.cpu_workers_per_node=2" in run.stdout
    assert "placement            : separate: 1 policy + 1 rollout device(s)" in run.stdout, run.stdout
    spec = preflight([root, "grpo.async_grpo.enabled=true", "cluster.cpu_workers_per_node=4", "dry_run=true"])[0]
    assert (spec.cluster.rollout_devices, spec.cluster.cpu_workers_per_node) == (2, 4)
    run = launch_here(tmp_path, root, "grpo.async_grpo.enabled=true", "cluster.gpus_per_node=1", "dry_run=true")
    assert run.returncode == 2 and "add cluster.rollout_devices=1 cluster.gpus_per_node=2" in run.stderr, run.stderr


# ----------------------------------------------------------------------------- 9. prompt budgets under a chat template
def chat_model_dir(path: Path) -> Path:
    """qwen2's config with the tiny tokenizer and a ChatML template (as an instruct checkpoint has): '4821>' is 24
    tokens as the model gets it."""
    from grpo_launcher.models.tiny import build_tokenizer

    d = model_dir(path, CONFIGS["qwen2"])
    tok = build_tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(d)
    return d


def test_toy_prompts_under_a_chat_template_are_counted_when_the_launch_trains(tmp_path, launch_here):
    """env=toy (the default) with a model.path whose tokenizer has a chat template: '4821>' becomes 24 tokens, over
    the toy budget of 8. At be57fe8 pre-flight passed it and the run stopped at step 1 (PromptTooLong). A launch (its
    dry run), a rerun, a sweep's point and an eval (it scores toy's prompts) are refused naming env.max_prompt_tokens;
    load_spec, which generate composes (it fits the budget to its own --prompt texts), is not (6daf708 refused
    generate: reverted)."""
    from grpo_launcher.launch.preflight import preflight_config
    from grpo_launcher.spec.compose import compose, load_spec, spec_to_yaml
    from grpo_launcher.spec.errors import ConfigError

    args = [f"model.path={chat_model_dir(tmp_path / 'chat')}", f"output_root={tmp_path}"]
    run = launch_here(tmp_path, *args, "dry_run=true")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "  - env.max_prompt_tokens, model.path: env=toy's prompts ('4821>') are up to 24 tokens" in run.stderr
    assert "fix: set env.max_prompt_tokens=24, or env.chat_template=false" in run.stderr, run.stderr
    for fix in ("env.max_prompt_tokens=24", "env.chat_template=false"):  # what the fix names passes
        run = launch_here(tmp_path, *args, fix, "dry_run=true")
        assert run.returncode == 0, run.stderr
    run = launch_here(tmp_path, *args, "env.max_prompt_tokens=20", "rollout.max_new_tokens=44", "dry_run=true")
    assert "fix: set env.max_prompt_tokens=24 train.max_total_sequence_length=68," in run.stderr, run.stderr
    with pytest.raises(ConfigError) as info:  # a sweep's point
        preflight_config(compose(args), args)
    assert [v.keys for v in info.value.violations] == [("env.max_prompt_tokens", "model.path")]
    spec = load_spec([*args, "name=orig"])  # eval's and generate's door: no refusal for prompts they do not use
    (tmp_path / "orig").mkdir()
    (tmp_path / "orig" / "spec.yaml").write_text(spec_to_yaml(spec))
    run = launch_here(tmp_path, "rerun", str(tmp_path / "orig"), "dry_run=true")
    assert run.returncode == 2 and "are up to 24 tokens" in run.stderr, run.stdout + run.stderr
    run = launch_here(tmp_path, "eval", str(tmp_path / "chat"), f"output_root={tmp_path}")  # scores toy's prompts
    assert run.returncode == 2 and "are up to 24 tokens" in run.stderr, run.stdout + run.stderr
    run = launch_here(tmp_path, f"output_root={tmp_path}", "env.max_prompt_tokens=4", "dry_run=true")  # tiny, raw
    assert "  - env.max_prompt_tokens: env=toy's prompts ('4821>') are up to 5 tokens" in run.stderr, run.stderr


@pytest.mark.parametrize("env, key", [("math", "question"), ("dataset", "prompt")])
def test_a_data_row_over_the_budget_under_a_chat_template_is_named_by_file_and_line(tmp_path, launch_here, env, key):
    """env=math and env=dataset (env.train_path) count every row as the model gets it: a row that fits raw (30
    tokens) but not templated (49 > 40) is named by file and line, at pre-flight, eval's and generate's too."""
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.spec.errors import ConfigError

    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    rows = [{key: "1+1", "answer": "2"}, {key: "2+2", "answer": "4"}, {key: "What is 1+1+1+1+1+1+1+1+1+1+1?", "answer": "11"}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val.write_text(json.dumps(rows[0]) + "\n")
    args = [f"env={env}", f"env.train_path={train}", f"env.val_path={val}", "env.max_prompt_tokens=40",
            f"model.path={chat_model_dir(tmp_path / 'chat')}", f"output_root={tmp_path}"]
    run = launch_here(tmp_path, *args, "dry_run=true")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "  - env.max_prompt_tokens, env.train_path: 1 of 3 prompts exceed env.max_prompt_tokens=40 (chat template " \
           f"on); the longest, 49 tokens, is at {train}:3" in run.stderr, run.stderr
    with pytest.raises(ConfigError):
        load_spec(args)
    assert launch_here(tmp_path, *args, "env.chat_template=false", "dry_run=true").returncode == 0
