"""What the Megatron converter maps, readable without torch: pre-flight's rules ask it before any GPU work."""

from __future__ import annotations

CPU_SHIM_ENV = "GRPO_MEGATRON_CPU_SHIM"  # 1: megatron-core on CPU through policy/megatron_cpu.py (tests only)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "nemotron_h")  # HF model_type values megatron_convert maps

# nemotron_h's layer kinds: HF NemotronH's pattern symbols / layers_block_type names -> megatron's pattern symbols
HYBRID_SYMBOLS = {"M": "M", "E": "E", "*": "*", "-": "-", "mamba": "M", "linear_attention": "M", "moe": "E",
                  "attention": "*", "full_attention": "*", "mlp": "-"}
LLAMA3_ROPE = (1.0, 4.0, 8192)  # megatron-core's llama3 rope scaling: low/high frequency factors, original length
MAMBA_NORM_EPS = 1e-5  # megatron-core's Mamba mixer builds its gated RMSNorm with eps=1e-5, whatever the config says


# config.json switches of the dense families that add biases megatron's layers (add_qkv_bias only) do not map
DENSE_BIASES = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",), "qwen3_moe": ("attention_bias",)}


def dense_refusals(cfg: dict) -> list[str]:
    """What our GPTModel mapping (policy/megatron_convert.py: SwiGLU, full causal attention, biases on Q/K/V only
    for qwen2) cannot reproduce of an HF llama / qwen2 / qwen3 / qwen3_moe config (each a sentence; [] when it maps
    exactly). Unrefused, each ran: biases crash the first refit (KeyError: o_proj.bias), an activation or a
    sliding window other than the HF model's gave logprobs 0.07 / 0.6 nats off the engine's (benchmarks/results/
    families.md)."""
    family, out = cfg.get("model_type"), []
    biases = [k for k in DENSE_BIASES.get(str(family), ()) if cfg.get(k)]
    if biases:
        out.append(f"{', '.join(f'{k}=true' for k in biases)}: the output-projection / MLP biases are not mapped "
                   "(megatron's layers here have biases on Q/K/V only)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act={act}: megatron's MLP here is SwiGLU (silu)")
    layer_types = cfg.get("layer_types")
    sliding = "sliding_attention" in layer_types if isinstance(layer_types, list) else \
        bool(cfg.get("use_sliding_window") and cfg.get("sliding_window"))
    if sliding:
        out.append(f"sliding-window attention (sliding_window={cfg.get('sliding_window')}): megatron's core "
                   "attention here is full causal")
    if family == "qwen3_moe" and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        out.append("Qwen3-MoE with dense layers in between (mlp_only_layers / decoder_sparse_step) is not mapped")
    rope = rope_refusal(cfg)
    return out + ([rope] if rope else [])


def rope_refusal(cfg: dict) -> str | None:
    """The RoPE scaling megatron_convert.arch_from_hf_config cannot map (a sentence), None where it maps: none, or
    llama3 with megatron-core's fixed low/high frequency factors (1, 4) and original length 8192. Unrefused, a yarn
    or linear rope_parameters passed pre-flight and the worker stopped at start-up (NotImplementedError, rc 1)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return f"rope_parameters={rope!r} is not mapped"
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        found = tuple(rope.get(k) for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
        if found != LLAMA3_ROPE:
            return (f"llama3 RoPE scaling with (low_freq_factor, high_freq_factor, original_max_position_embeddings)="
                    f"{found}: megatron-core's llama3 scaling fixes them at {LLAMA3_ROPE}")
    elif kind != "default":
        return f"RoPE scaling rope_type={kind!r} is not mapped (megatron-core here: none, or llama3)"
    return None


def hybrid_pattern(cfg: dict) -> str:
    """An HF NemotronH config (dict) -> its layer pattern in megatron's symbols: M Mamba-2, E MoE, * attention,
    - dense MLP (hybrid_override_pattern, or layers_block_type / layer_types)."""
    layers = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types") or ""
    return "".join(HYBRID_SYMBOLS[k] for k in layers)


def hybrid_refusals(cfg: dict) -> list[str]:
    """What megatron-core's hybrid model with our local layer spec cannot reproduce of an HF NemotronH config
    (each a sentence; [] when the model maps exactly)."""
    pattern, out = hybrid_pattern(cfg), []
    if "-" in pattern:
        out.append("dense MLP layers ('-' in the pattern) are not mapped")
    if cfg.get("num_nextn_predict_layers"):
        out.append("multi-token-prediction layers (num_nextn_predict_layers) are not mapped")
    if cfg.get("moe_latent_size") is not None:
        out.append("MoE latent projections (moe_latent_size) are not mapped")
    if (cfg.get("n_group") or 1) > 1:
        out.append(f"group-limited routing (n_group={cfg['n_group']}): HF and megatron score the groups differently")
    top_k, norm = cfg.get("num_experts_per_tok", 2), bool(cfg.get("norm_topk_prob", True))
    if "E" in pattern and (top_k > 1) != norm:  # megatron's sigmoid router renormalises exactly when top-k > 1
        out.append(f"norm_topk_prob={str(norm).lower()} with top-{top_k}: megatron's sigmoid router renormalises the "
                   "top-k weights exactly when k > 1")
    acts = (cfg.get("mlp_hidden_act", "relu2"), cfg.get("mamba_hidden_act", "silu"))
    if acts != ("relu2", "silu"):
        out.append(f"activations {acts}: megatron's Mamba mixer is silu and the experts here squared ReLU")
    biases = [k for k in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias") if cfg.get(k)]
    if biases or not cfg.get("use_conv_bias", True):
        out.append(f"linear biases ({', '.join(biases) or 'use_conv_bias=false'}) differ from megatron's Mamba layers")
    if "M" in pattern and float(cfg.get("layer_norm_epsilon", MAMBA_NORM_EPS)) != MAMBA_NORM_EPS:
        out.append(f"layer_norm_epsilon={cfg['layer_norm_epsilon']}: megatron's Mamba gated norm uses {MAMBA_NORM_EPS}")
    return out
