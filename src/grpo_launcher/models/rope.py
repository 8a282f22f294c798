"""Longrope (Phi-3's long-context checkpoints) computed one way for a whole run, as vLLM computes it.

transformers picks longrope's short or long factors on every forward, from that call's longest position against
original_max_position_embeddings. A KV-cached decode (rollout=hf) then holds prompt keys rotated with the short
factors and later ones with the long, and the policy's forward of the same sequence picks by its micro-batch's
width: on a tiny Phi-3 (original 16, 24-token sequences) rollout=hf's logprobs sat 0.65 nats off the policy's.
vLLM decides once per engine: the long factors when max_model_len exceeds original_max_position_embeddings, else
the short. pin_longrope fixes transformers' rotary modules to that same choice for the run's max model length.
"""

from __future__ import annotations

from typing import Any

PINNED = "longrope_pinned"  # a rope_type transformers' dynamic_rope_update does not recompute


def pin_longrope(model: Any, max_len: int) -> int:
    """Every longrope rotary module of `model` pinned to the long factors (max_len > original_max_position_embeddings)
    or the short; returns how many were pinned (0: no longrope, nothing changed)."""
    pinned = 0
    for module in model.modules():
        if getattr(module, "rope_type", None) != "longrope" or not hasattr(module, "inv_freq"):
            continue
        params = module.config.rope_parameters
        original = params.get("original_max_position_embeddings") or module.config.max_position_embeddings
        device = module.inv_freq.device
        if device.type == "meta":  # a sharded model before materialize: its buffers come from rank 0's pinned copy
            module.rope_type = PINNED
            pinned += 1
            continue
        inv_freq, _ = longrope_init(module.config, device, original, long=max_len > original)
        module.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        module.rope_type = PINNED
        pinned += 1
    return pinned


def longrope_init(config: Any, device: Any, original: int, long: bool) -> tuple[Any, float]:
    """transformers' longrope inverse frequencies: the long factors for a length past `original`, else the short."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=original + 1 if long else None)
