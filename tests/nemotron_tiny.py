"""A tiny Nemotron-H (model.family=nemotron_h: hybrid Mamba-2 / attention / MoE, the layer kinds of Nemotron 3 Nano)
made with transformers' save_pretrained, built once per machine next to helpers.MODEL_CACHE's tiny model (whose
byte-level tokenizer it shares). Pure-torch path: no mamba-ssm or causal-conv1d needed."""

from __future__ import annotations

import shutil
from pathlib import Path

from helpers import MODEL_CACHE, tiny_model

# Mamba, MoE, attention, MoE: Nano's pattern in miniature (4 routed experts top-2 + a shared expert)
LAYERS = ["mamba", "moe", "attention", "moe"]
CONFIG = dict(vocab_size=512, hidden_size=64, layers_block_type=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
              ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, n_shared_experts=1,
              max_position_embeddings=256, pad_token_id=0, eos_token_id=2, bos_token_id=None)


def tiny_nemotron_h() -> Path:
    """The model directory (config.json, model.safetensors, tokenizer), built on first use."""
    out = MODEL_CACHE / "nemotron-h-tiny-v1"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    import os

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    NemotronHForCausalLM(NemotronHConfig(**CONFIG)).save_pretrained(tmp)
    tok = tiny_model()
    for f in tok.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy2(f, tmp / f.name)
    try:
        tmp.rename(out)  # complete or absent
    except OSError:  # a concurrent builder got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
