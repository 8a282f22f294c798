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


@pytest.fixture
def launch_here(monkeypatch, capsys):
    """launch.py's main in this process, from `cwd`: (exit code, stdout, stderr) as a CompletedProcess."""
    monkeypatch.syspath_prepend(str(ROOT))
    import launch as launch_py

    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = launch_py.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["launch.py", *args], code, out, err)

    return run


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
    from grpo_launcher.launch.preflight import preflight

    data = write_csv(tmp_path / "rev.csv", """
        prompt,answer,id
        7840,0487,1
        123,321,2
        """)
    args = dataset_args(data, data, f"output_root={tmp_path}")
    run = launch_here(tmp_path, *args, "dry_run=true")
    assert run.returncode == 0, run.stderr
    spec, _ = preflight(args)
    env = DatasetEnv(spec.env)
    first, second = sorted(env.val_prompts(), key=lambda p: p.row["id"])
    assert first.row == {"prompt": "7840", "answer": "0487", "id": "1"} and first.answer == "0487"
    assert env.score(first, " 0487\n") == 1.0 and env.score(first, "487") == 0.0
    assert second.source == f"{data}:3"  # file:line, the header is line 1


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
