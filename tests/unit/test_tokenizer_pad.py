"""A checkpoint whose tokenizer declares no pad token (Llama-3's, Mistral's) pads with its EOS: the tokenizer every
worker and the driver use (rollout/hf.py load_tokenizer, through Ray) has one, and the CPU sampler runs on it."""

from __future__ import annotations

import json
import pickle

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_launcher.models.tiny import build_tokenizer
from grpo_launcher.rollout.hf import load_tokenizer, sample


def test_a_tokenizer_without_pad_pads_with_its_eos(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # as Llama-3 ships it: no pad_token
        f = tmp_path / name
        if f.is_file():
            f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "pad_token"}))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)

    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    assert pickle.loads(pickle.dumps(loaded)).pad_token_id == tok.eos_token_id  # the driver's copy, through Ray
    model = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    prompts = [loaded("12>")["input_ids"], loaded("98765>")["input_ids"]]  # two widths: left padding
    tokens, logprobs = sample(model, prompts, 2, 1.0, 4, loaded.pad_token_id, [loaded.eos_token_id])
    assert tokens.shape == logprobs.shape == (4, 4) and bool(torch.isfinite(logprobs).all())
