"""Every place that runs an HF model to score or sample runs the attention the policy runs (models/attention.py):
eager where sdpa would drop Gemma-2's attention-logit softcapping."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_launcher.gym.samples import GymGeneration
from grpo_launcher.train.gym_probe import policy_logprobs


def gemma2(root: Path) -> Path:
    """A tiny Gemma-2 whose attention logits are capped hard (attn_logit_softcapping=0.5): sdpa computes another
    model."""
    config = AutoConfig.for_model(
        "gemma2",
        vocab_size=288,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
        sliding_window=8,
        initializer_range=0.5,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "gemma2")
    return root / "gemma2"


def test_the_gym_probe_scores_gemma2_with_its_softcapping(tmp_path):
    """The probe's policy logprobs (what it compares the engine's to) came from sdpa: softcapping dropped."""
    model_dir = gemma2(tmp_path)
    gen = GymGeneration(
        prompt_ids=[5, 17, 33, 40, 41, 90], response_ids=[7, 8, 200, 13, 2], logprobs=[0.0] * 5, truncated=False
    )
    eager = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = torch.log_softmax(eager(torch.tensor([gen.prompt_ids + gen.response_ids])).logits[0].float(), -1)
    want = [float(lp[len(gen.prompt_ids) - 1 + j, t]) for j, t in enumerate(gen.response_ids)]
    (got,) = policy_logprobs(model_dir, [gen])
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
