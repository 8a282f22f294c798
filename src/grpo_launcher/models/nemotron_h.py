"""model.family=nemotron_h built here (no hub): Nemotron 3 Nano's shape at any size, for model.path=null.

The layer kinds follow Nano's hybrid pattern (Mamba-2 `M`, MoE `E`, attention `*`), cut to model.num_layers;
the MoE layers route top-k of model.num_experts sigmoid-scored experts plus one shared expert of twice the
expert width (Nano: 1856 / 3712); the Mamba-2 mixer has expand 2, Nano's 8 groups where the width allows.
transformers' pure-torch path runs it (no mamba-ssm, no causal-conv1d).
"""

from __future__ import annotations

from typing import Any

from ..spec.model_dir import model_facts
from ..spec.schema import ModelSpec

# NVIDIA-Nemotron-3-Nano-30B-A3B's hybrid_override_pattern: 23 Mamba-2, 23 MoE, 6 attention layers
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
KINDS = {"M": "mamba", "E": "moe", "*": "attention"}


def layer_pattern(num_layers: int) -> str:
    """Nano's pattern cut to num_layers (repeated past 52)."""
    return "".join(NANO_PATTERN[i % len(NANO_PATTERN)] for i in range(num_layers))


def layer_kinds(num_layers: int) -> list[str]:
    return [KINDS[c] for c in layer_pattern(num_layers)]


def nemotron_h_config(spec: ModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """NemotronHConfig keyword arguments for the spec's sizes (model.ffn_hidden_size = one expert's width)."""
    head_dim = model_facts(spec).head_dim  # model.head_dim, else hidden / heads (what the memory model reads)
    mamba_head_dim = min(64, spec.hidden_size // spec.num_attention_heads)
    groups = next(g for g in (8, 4, 2, 1) if (2 * spec.hidden_size // mamba_head_dim) % g == 0)
    return dict(
        # the published checkpoints' key (every transformers with NemotronH reads it; 5.x maps it to layer_types)
        vocab_size=vocab_size, hidden_size=spec.hidden_size, hybrid_override_pattern=layer_pattern(spec.num_layers),
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_kv_heads, head_dim=head_dim,
        intermediate_size=spec.ffn_hidden_size, max_position_embeddings=spec.max_position_embeddings,
        mamba_num_heads=2 * spec.hidden_size // mamba_head_dim, mamba_head_dim=mamba_head_dim, n_groups=groups,
        ssm_state_size=min(128, max(16, spec.hidden_size // 8)), conv_kernel=4, chunk_size=64,
        n_routed_experts=spec.num_experts, num_experts_per_tok=spec.moe_top_k,
        moe_intermediate_size=spec.ffn_hidden_size, moe_shared_expert_intermediate_size=2 * spec.ffn_hidden_size,
        n_shared_experts=1, tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)


def build_model(spec: ModelSpec, tokenizer: Any, seed: int, device: str = "cpu") -> Any:
    """A randomly initialised NemotronHForCausalLM in fp32 on `device`."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    cfg = NemotronHConfig(**nemotron_h_config(spec, max(spec.vocab_size, len(tokenizer)), tokenizer.eos_token_id,
                                              tokenizer.pad_token_id))
    with torch.device(device):
        return NemotronHForCausalLM(cfg).to(torch.float32)


def memory_layout(spec: ModelSpec) -> dict[str, Any]:
    """The layer counts and Mamba / expert sizes of the model built here, as spec/memory.py's HYBRID_LAYOUTS."""
    cfg = nemotron_h_config(spec, spec.vocab_size, 2, 0)
    kinds = layer_kinds(spec.num_layers)
    return dict(attention=kinds.count("attention"), mlp=0, moe=kinds.count("moe"), mamba=kinds.count("mamba"),
                gated=False, shared_ffn=cfg["moe_shared_expert_intermediate_size"], head_dim=cfg["head_dim"],
                mamba_heads=cfg["mamba_num_heads"], mamba_head_dim=cfg["mamba_head_dim"], groups=cfg["n_groups"],
                state=cfg["ssm_state_size"], conv=cfg["conv_kernel"])
