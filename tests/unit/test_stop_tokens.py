"""Stop tokens as the checkpoint defines them (issue 42, item 1): tokenizer EOS ∪ generation_config's eos_token_id.

Tiny checkpoints in the style of families whose end-of-turn token is listed only in generation_config.json (Qwen3,
Llama-3, Gemma-it, Phi-3), built with save_pretrained and a byte-level tokenizer carrying the family's special
tokens. Each model is made to say its end-of-turn token mid-answer: its greedy continuation is read first, then the
ids of the k-th greedy token and of the end-of-turn token are swapped in the embeddings (a relabelling: the model
computes the same function, only the two ids trade names), so greedy decoding emits the end-of-turn token at step k.
rollout=hf, at a temperature where sampling is greedy, must stop exactly where `transformers.generate` stops (before
this fix it stopped at the tokenizer's EOS only and ran every sample to rollout.max_new_tokens).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from grpo_launcher.batch import collate
from grpo_launcher.plan import make_plan
from grpo_launcher.rollout.hf import HFEngine, _one
from grpo_launcher.spec.schema import RunSpec
from grpo_launcher.stop_tokens import describe, stop_token_ids

MAX_NEW = 12
PROMPT = "reverse 1234>"
# style: (model_type, its special tokens, tokenizer EOS, pad, generation_config eos_token_id, the end-of-turn token)
STYLES = {
    "qwen3": ("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|endoftext|>",
              ["<|im_end|>", "<|endoftext|>"], "<|im_end|>"),
    "llama3": ("llama", ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|end_of_text|>",
               "<|end_of_text|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "gemma_it": ("gemma", ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<pad>",
                 ["<eos>", "<end_of_turn>"], "<end_of_turn>"),
    "phi3": ("phi3", ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"], "<|endoftext|>", "<|endoftext|>",
             ["<|endoftext|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    # generation_config.json with a single int, not the tokenizer's EOS (generate stops at it alone)
    "int_listed": ("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|endoftext|>",
                   "<|im_end|>", "<|im_end|>"),
}
# a tied tiny Gemma only repeats the prompt's last token (its embeddings are scaled by √hidden): untied here (and
# the output layer is scaled, below, which a tied model could not take)
UNTIED = {"gemma_it"}
GREEDY = dataclasses.replace(RunSpec(), rollout=dataclasses.replace(RunSpec().rollout, temperature=1e-6,
                                                                    max_new_tokens=MAX_NEW))


def build_tokenizer(specials: list[str], eos: str, pad: str):
    """models/tiny.py's byte-level tokenizer, with this family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(specials), special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["0123456789"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """The model's greedy continuation, no stopping (full forward each step: a reference, not fast)."""
    x = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0, len(prompt):].tolist()


def swap_ids(model, a: int, b: int) -> None:
    """Relabel token ids a ↔ b in the input embedding and the output layer (once when tied)."""
    layers = {id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    with torch.no_grad():
        for w in layers.values():
            w[[a, b]] = w[[b, a]]


def checkpoint(root: Path, style: str) -> tuple[Path, list[int], int]:
    """(model dir, prompt ids, end-of-turn id): a tiny `style` checkpoint that greedily ends its turn mid-answer."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    family, specials, eos, pad, listed, turn_end = STYLES[style]
    tok = build_tokenizer(specials, eos, pad)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=None,
                               **({"tie_word_embeddings": False} if style in UNTIED else {}))
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert not cfg.tie_word_embeddings
    with torch.no_grad():  # logits × 1000: top-2 gaps of ≥ 1, greedy at any temperature an engine really uses
        model.get_output_embeddings().weight.mul_(1000)  # (vLLM raises temperatures below 0.01 to 0.01)
    prompt = tok(PROMPT)["input_ids"]
    path, special_ids = greedy(model, prompt, MAX_NEW - 2), set(tok.all_special_ids)
    k = next(i for i, t in enumerate(path) if i >= 2 and t not in path[:i] + prompt and t not in special_ids)
    assert not special_ids & set(path[:k]), (style, path)
    turn_end_id = tok.convert_tokens_to_ids(turn_end)
    swap_ids(model, path[k], turn_end_id)  # greedy decoding now says the end-of-turn token at step k
    ids = tok.convert_tokens_to_ids(listed)
    model.generation_config = GenerationConfig(eos_token_id=ids, pad_token_id=tok.pad_token_id)
    out = root / style
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, prompt, turn_end_id


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list[int], int]]:
    root = tmp_path_factory.mktemp("stop-tokens")
    return {style: checkpoint(root, style) for style in STYLES}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_hf_engine_stops_where_transformers_generate_stops(checkpoints, style):
    """rollout=hf (the CPU decoding loop) ends each sample at the generation config's end-of-turn token, keeps it as
    the last token, and the loss mask covers it, exactly as `generate` with the checkpoint's generation config."""
    from transformers import AutoModelForCausalLM

    d, prompt, turn_end = checkpoints[style]
    ref_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ref = ref_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_NEW)[0, len(prompt):].tolist()
    assert ref[-1] == turn_end and len(ref) < MAX_NEW, ref  # generate stops at the end-of-turn token
    gens = HFEngine(GREEDY, str(d), torch.device("cpu")).generate([prompt], 2, seed=3)
    for g in gens:  # before the fix: 12 tokens, truncated, the end-of-turn token in the middle
        assert g.response_ids == ref and not g.truncated and len(g.logprobs) == len(ref), (g.response_ids, ref)
    batch = collate(gens, torch.zeros(2), torch.ones(2), 0)
    assert batch.response_mask.sum(1).tolist() == [len(ref)] * 2  # the stop token is trained on, as on vLLM
    assert batch.response_ids[0, len(ref) - 1] == turn_end


def test_the_cuda_path_generate_takes_nothing_else_from_generation_config(checkpoints, tmp_path):
    """rollout=hf on CUDA decodes with transformers' `generate` (HFEngine._generate_hf, run here on the CPU): it stops
    at the stop set too, and a checkpoint's other generation settings (a repetition_penalty, as Qwen2.5's) leave the
    distribution alone: the logprobs it records are log_softmax(logits / T) of the model's forward, the policy's."""
    from transformers import AutoModelForCausalLM

    d, prompt, turn_end = checkpoints["llama3"]
    own = tmp_path / "penalised"
    own.mkdir()
    for f in d.iterdir():
        (own / f.name).write_bytes(f.read_bytes())
    gen_cfg = json.loads((d / "generation_config.json").read_text())
    (own / "generation_config.json").write_text(json.dumps({**gen_cfg, "repetition_penalty": 1.5}))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    greedy = HFEngine(GREEDY, str(own), torch.device("cpu"))
    new, lps = greedy._generate_hf([prompt], 0, greedy.stop_ids)
    assert _one(prompt, new[0], lps[0], greedy.stop_ids).response_ids[-1] == turn_end  # before: only the EOS
    warm = dataclasses.replace(GREEDY, rollout=dataclasses.replace(GREEDY.rollout, temperature=700.0))
    engine = HFEngine(warm, str(own), torch.device("cpu"))  # T = 700: logits ~ ±500, a spread-out distribution
    torch.manual_seed(0)
    new, lps = engine._generate_hf([prompt] * 3, 0, engine.stop_ids)
    for row in range(3):
        g = _one(prompt, new[row], lps[row], engine.stop_ids)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + g.response_ids])).logits[0, len(prompt) - 1:-1]  # [T, V]
        want = (logits / 700.0).log_softmax(-1).gather(-1, torch.tensor(g.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-5), (g.logprobs, want.tolist())
    assert engine.model.generation_config.repetition_penalty == 1.5  # the model's own, put back (export saves it)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_stop_set_is_tokenizer_eos_and_generation_config(checkpoints, style):
    """stop_token_ids: the tokenizer's EOS first, then the generation config's ids (int or list), once each; the
    plan's line (read as JSON, no transformers) names the same ids."""
    from transformers import AutoTokenizer, GenerationConfig

    d = checkpoints[style][0]
    tok, listed = AutoTokenizer.from_pretrained(d), GenerationConfig.from_pretrained(d).eos_token_id
    listed = listed if isinstance(listed, list) else [listed]
    ids = stop_token_ids(d)
    assert ids == tuple(dict.fromkeys([tok.eos_token_id, *listed])) and checkpoints[style][2] in ids
    assert [int(i) for i in re.findall(r"(\d+) '", describe(str(d)))] == list(ids)


def test_without_generation_config_json_config_json_lists_them(tmp_path, checkpoints):
    """No generation_config.json: the model config's eos_token_id, as from_pretrained falls back to it."""
    d = checkpoints["llama3"][0]
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in d.iterdir():
        if f.name != "generation_config.json":
            (bare / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [cfg["eos_token_id"], 7]}))
    assert stop_token_ids(bare) == (cfg["eos_token_id"], 7)
    assert [int(i) for i in re.findall(r"(\d+)[ ,(]", describe(str(bare)))] == [cfg["eos_token_id"], 7]


def test_the_plan_prints_the_stop_tokens(checkpoints):
    d, _, turn_end = checkpoints["gemma_it"]
    spec = dataclasses.replace(RunSpec(), model=dataclasses.replace(RunSpec().model, path=str(d)))
    line = next(x for x in make_plan(spec).summary().splitlines() if x.startswith("stop tokens"))
    assert f"{turn_end} '<end_of_turn>'" in line and "'<eos>'" in line, line
    assert "at start-up" in make_plan(RunSpec()).summary()  # the tiny model: built when the run starts
