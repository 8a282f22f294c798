"""The attention implementation a family's transformers model must run with to compute the model it defines.

transformers 5 loads Gemma-2 (and VaultGemma) with `sdpa`, whose attention function takes `softcap` into **kwargs and
drops it: attention logits are not capped (cap·tanh(s/cap)), so the policy and rollout=hf ran another model than the
checkpoint's. Only `eager` (and flex) apply attn_logit_softcapping. vLLM applies it (its CPU kernel included), so
rollout=vllm's logprobs sat 0.013 nats off the policy's on the tiny gemma2 (benchmarks/results/families.md); with
eager both agree to 1e-6.
"""

from __future__ import annotations

from typing import Any


def hf_attention(model_dir: str) -> dict[str, Any]:
    """from_pretrained / from_config keyword arguments: eager attention where the config caps attention logits
    (config.json's attn_logit_softcapping, or the config class's default when absent: Gemma-2's 50), else none."""
    from transformers import AutoConfig  # here: the driver imports the policy modules, not transformers

    cap = getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "attn_logit_softcapping", None)
    return {"attn_implementation": "eager"} if cap else {}
