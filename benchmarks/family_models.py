"""Tiny random models of many transformers families, built locally (no hub), for the family sweep
(benchmarks/results/families.md): save_pretrained of each config class + the tiny model's byte-level tokenizer.

    python benchmarks/family_models.py /tmp/fam/models            # every variant below
    python benchmarks/family_models.py /tmp/fam/models gemma2 phi_v   # some
    python launch.py model.path=/tmp/fam/models/gemma2 grpo.max_steps=2 logging.mlflow=false output_root=/tmp/fam/out name=g2

Variants: head_dim 32 where vLLM's CPU attention needs it (`_v`: hidden 128 over 4 heads), quirks that past bugs
hid behind (logit softcapping / scaling, lm_head bias, tied embeddings, an odd vocab), tokenizers without a pad
token, with a BOS post-processor, with a chat template.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer, processors
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_launcher.models.tiny import build_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nemotron_tiny import CONFIG as NEMOTRON_H  # noqa: E402  (tests/ holds the tiny Nemotron-H's shape)

COMMON = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
V = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192)  # head_dim 32
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# name -> (model_type, quirks on COMMON (None: the tiny Nemotron-H), tokenizer variant)
FAMILIES: dict[str, tuple[str, Optional[dict[str, Any]], str]] = {
    "llama": ("llama", dict(head_dim=32), ""),
    "llama_tied": ("llama", dict(head_dim=32, tie_word_embeddings=True), ""),
    "llama_nopad": ("llama", dict(head_dim=32), "nopad"),
    "llama_bos": ("llama", dict(head_dim=32), "bos"),
    "llama_bias": ("llama", dict(head_dim=32, attention_bias=True, mlp_bias=True), ""),
    "llama_gelu": ("llama", dict(head_dim=32, hidden_act="gelu"), ""),
    "mistral": ("mistral", dict(head_dim=32, sliding_window=8), ""),
    "qwen2": ("qwen2", dict(head_dim=32), ""),
    "qwen2_v": ("qwen2", dict(V), ""),
    "qwen2_odd_v": ("qwen2", dict(V, vocab_size=301), ""),
    "qwen2_oddvocab": ("qwen2", dict(head_dim=32, vocab_size=301), ""),
    "qwen2_chat": ("qwen2", dict(head_dim=32), "chat"),
    "qwen2_swa": ("qwen2", dict(head_dim=32, use_sliding_window=True, sliding_window=4, max_window_layers=0), ""),
    "qwen3": ("qwen3", dict(head_dim=32), ""),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    decoder_sparse_step=1, mlp_only_layers=[]), ""),
    "gemma": ("gemma", dict(head_dim=32), ""),
    "gemma2": ("gemma2", dict(head_dim=32, final_logit_softcapping=2.0, attn_logit_softcapping=5.0,
                              query_pre_attn_scalar=16, sliding_window=8), ""),
    "gemma3_text": ("gemma3_text", dict(head_dim=32, final_logit_softcapping=3.0, sliding_window=8), ""),
    "granite": ("granite", dict(head_dim=32, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                attention_multiplier=0.1), ""),
    "phi3": ("phi3", dict(), ""),
    "phi3_v": ("phi3", dict(V), ""),
    "phi": ("phi", dict(partial_rotary_factor=0.5, qk_layernorm=True), ""),  # lm_head with a bias
    "phi_v": ("phi", dict(V, partial_rotary_factor=0.5, qk_layernorm=True), ""),
    "olmo2": ("olmo2", dict(), ""),
    "olmo2_v": ("olmo2", dict(V), ""),
    "starcoder2": ("starcoder2", dict(sliding_window=8), ""),
    "starcoder2_v": ("starcoder2", dict(V, sliding_window=8), ""),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5), ""),
    "gpt_neox_v": ("gpt_neox", dict(V, rotary_pct=0.5), ""),
    "nemotron_h": ("nemotron_h", None, ""),
    "qwen3_tied": ("qwen3", dict(head_dim=32, tie_word_embeddings=True), ""),
    "cohere_v": ("cohere", dict(V, logit_scale=0.5), ""),  # tied, logits scaled, LayerNorm, parallel block
    "cohere2_v": ("cohere2", dict(V, logit_scale=0.5, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"]), ""),  # global layers: no RoPE
    "exaone4": ("exaone4", dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
                ""),
    "llama_stop": ("llama", dict(head_dim=32), "stop"),  # generation_config.json: a second stop token
    "stablelm_v": ("stablelm", dict(V, partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True), ""),
    "glm4": ("glm4", dict(head_dim=32, partial_rotary_factor=0.5, attention_bias=True), ""),
}


def build(root: Path, name: str) -> Path:
    """root/name: config.json + model.safetensors (random, seed 0; an lm_head bias drawn, not zero) + tokenizer."""
    family, quirks, tok_kind = FAMILIES[name]
    out = root / name
    tok = build_tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    base = {**NEMOTRON_H, "vocab_size": 288, "initializer_range": 0.1} if quirks is None else {**COMMON, **quirks}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**base, **ids}), dtype=torch.float32)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        torch.nn.init.normal_(head.bias, std=1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _tokenizer_variant(out, tok_kind)
    return out


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}, indent=1))


def _tokenizer_variant(out: Path, kind: str) -> None:
    if kind == "chat":
        _edit_json(out / "tokenizer_config.json", chat_template=CHATML)
    elif kind == "stop":  # a stop set wider than the tokenizer's EOS (Llama-3's <|eot_id|>): '>' ends a sample
        _edit_json(out / "generation_config.json", eos_token_id=[json.loads((out / "config.json").read_text())[
            "eos_token_id"], Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(">")])
    elif kind == "nopad":  # Llama-3's and Mistral's tokenizers declare none
        _edit_json(out / "tokenizer_config.json", pad_token=None)
    elif kind == "bos":  # a BOS prepended by the tokenizer's post-processor, as Llama's
        t = Tokenizer.from_file(str(out / "tokenizer.json"))
        bos = t.token_to_id("<|im_start|>")
        t.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B",
                                                         special_tokens=[("<|im_start|>", bos)])
        t.save(str(out / "tokenizer.json"))
        _edit_json(out / "tokenizer_config.json", bos_token="<|im_start|>")
        _edit_json(out / "config.json", bos_token_id=bos)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in sys.argv[2:] or FAMILIES:
        print(name, build(root, name), flush=True)
