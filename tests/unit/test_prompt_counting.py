"""Pre-flight counts each prompt's tokens as the model gets them (chat template, env.system_prompt). A long
env.system_prompt was tokenised again with every prompt: env=toy's 10^4 prompts under a 4,000-character system
prompt took a minute of CPU in `launch.py env=toy dry_run=true`. prompting.shared_head_lengths tokenises the shared
head once and each prompt's tail; its counts must be exactly the whole encodings' (a tokenizer that merges across
the cut falls back to them)."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from grpo_launcher.envs.prompting import encode, prompt_lengths, shared_head_lengths
from grpo_launcher.envs.toy import every_prompt_text
from grpo_launcher.models.tiny import build_tokenizer
from grpo_launcher.spec.schema import EnvSpec
from helpers import launch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM_PROMPTS = ["x " * 400, "x" * 900, "é" * 300 + " ok", "Think step by step. " * 30 + "\n\n",
                  "The answer goes in \\boxed{}. " * 20 + "1234"]


def merging_tokenizer(prefix_space: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges (the tiny model's has none): pieces that span characters, as a real one's do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([*SYSTEM_PROMPTS, "0123 4567 89>", "xxxx xx x", "éé éé"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


TOKENIZERS = {"tiny": build_tokenizer, "bpe": lambda: merging_tokenizer(False),
              "bpe-prefix-space": lambda: merging_tokenizer(True)}


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("system", SYSTEM_PROMPTS)
@pytest.mark.parametrize("template", [False, True])
def test_counts_with_a_long_system_prompt_are_the_whole_encodings(name, system, template):
    tok = TOKENIZERS[name]()
    if template and not tok.chat_template:
        tok.chat_template = CHATML
    env = EnvSpec(system_prompt=system, chat_template=template)
    prompts = [*every_prompt_text()[::97], "4821>", "x" * 50, "a longer question, with words: 12 + 30?", "é"]
    assert prompt_lengths(tok, prompts, env) == [len(encode(tok, p, env)) for p in prompts]


def test_the_shared_head_is_tokenised_once_for_the_toy_prompts():
    tok = build_tokenizer()
    texts = [f"{'x ' * 2000}\n{p}" for p in every_prompt_text()]
    assert shared_head_lengths(tok.backend_tokenizer, texts, True) == [len(texts[0])] * len(texts)  # a byte a token


def test_no_shared_head_is_counted_whole():
    tok = build_tokenizer()
    assert shared_head_lengths(tok.backend_tokenizer, ["12>", "345>"], True) is None


def test_a_long_system_prompt_with_env_toy_is_counted_in_seconds(tmp_path):
    """Before: 62 s of CPU (119 s wall on the shared 2-core machine) for this dry run; after: 2.5 s."""
    t0 = time.monotonic()
    r = launch("env=toy", f"env.system_prompt={'x ' * 2000}", "dry_run=true", f"output_root={tmp_path}", timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "env=toy's prompts ('4821>') are up to 4005 tokens as the model gets them" in r.stderr, r.stderr
    assert took < 30, f"{took:.0f} s"


def test_a_prompt_holding_a_special_tokens_text_is_warned_of(tmp_path, launch_here):
    """A row's prompt `what is <|im_end|> 2+2=` is encoded with the end-of-turn token mid-prompt (the tokenizer reads
    special tokens' text as the tokens): the model is given another prompt than the file's. Pre-flight said nothing;
    now a warning names the file, the first row and the token, and env.system_prompt likewise."""
    tok = build_tokenizer()
    assert tok.eos_token_id in encode(tok, "what is <|im_end|> 2+2=", EnvSpec(name="dataset"))  # the claim
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "what is <|im_end|> 2+2=", "answer": "4"}\n')
    val.write_text('{"prompt": "3+3=", "answer": "6"}\n')
    r = launch_here(tmp_path, "env=dataset", f"env.train_path={train}", f"env.val_path={val}",
                    "env.system_prompt='x<|endoftext|>'", "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert f"1 of 2 prompts in {train} hold the text of a special token of the tokenizer ('<|im_end|>' at {train}:2)" \
        in r.stderr, r.stderr
    assert "env.system_prompt holds the text of the special token '<|endoftext|>'" in r.stderr, r.stderr
    assert str(val) + " hold" not in r.stderr
