"""model.family=nemotron_h on train.backend=megatron: megatron-core's hybrid (Mamba) language model from a LOCAL layer
spec, no Transformer Engine.

megatron-core ships only TE specs for its hybrid stack (models/mamba/mamba_layer_specs.py; 0.19:
models/hybrid/hybrid_layer_specs.py): the pre-norms fused into TE linears, TE attention, TE grouped experts. The spec
here has the same layers from megatron's own modules: a torch RMSNorm before each mixer, column/row-parallel linears,
megatron's local core attention (or SDPA: train.core_attention), sequential local experts with a shared expert, and
megatron's MambaMixer (which needs mamba-ssm's Triton kernels, not TE). The stack's final norm is TENorm in
megatron-core whatever the spec, so the stack class here builds a torch RMSNorm instead.

Without causal-conv1d the mixer runs its unfused path (`use_mamba_mem_eff_path=False`: torch conv1d, mamba-ssm's chunk
scan and gated norm), which megatron-core cannot pack (train.sequence_packing is refused for megatron anyway).

Both megatron-core APIs are served: 0.16 (MambaModel, ssm/mamba_block.MambaStack, `mamba_stack_spec`,
`hybrid_override_pattern`) and 0.19 (HybridModel, models/hybrid/hybrid_block.HybridStack, `hybrid_stack_spec`,
`hybrid_layer_pattern`).

Imports. megatron-core inside the functions: policy/megatron_policy.py imports this module, and the driver that one
(its imports stay light, as megatron_policy's docstring says); hybrid_api tries each release's module paths.
"""

from __future__ import annotations

from typing import Any, Optional

from . import megatron_convert as mc


def hybrid_api() -> tuple[type, type, type, str, str]:
    """(model class, stack class, stack submodules class, the model's spec keyword, its pattern keyword)."""
    try:
        from megatron.core.models.hybrid.hybrid_block import (  # lazy: see Imports above
            HybridStack, HybridStackSubmodules)
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # lazy: see Imports above

        return HybridModel, HybridStack, HybridStackSubmodules, "hybrid_stack_spec", "hybrid_layer_pattern"
    except ImportError:  # megatron-core 0.16
        from megatron.core.models.mamba.mamba_model import MambaModel  # lazy: see Imports above
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules  # lazy: see Imports above

        return MambaModel, MambaStack, MambaStackSubmodules, "mamba_stack_spec", "hybrid_override_pattern"


def local_norm_stack(base: type) -> type:
    """The hybrid stack with a torch RMSNorm as its final norm (megatron-core hard-codes TENorm there)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # lazy: see Imports above

    class LocalNormStack(base):
        def __init__(self, config: Any, submodules: Any, *args: Any, post_layer_norm: bool = True,
                     **kwargs: Any) -> None:
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm  # forward applies final_norm when post_process and this
            if self.post_process and post_layer_norm:
                self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                                   eps=config.layernorm_epsilon)

    return LocalNormStack


def local_stack_spec(arch: mc.Arch, core_attention: Optional[type] = None) -> Any:
    """The hybrid stack's ModuleSpec: Mamba (M), attention (*) and MoE (E) layers from megatron-core's local modules.
    The attention and MoE layers are the local GPT layer's halves (its spec picks the norm and expert classes of the
    installed megatron-core)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add  # lazy: see Imports above
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # lazy: see Imports above
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules  # lazy: see Imports above
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules  # lazy: see Imports above
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # lazy: see Imports above
    from megatron.core.transformer import transformer_layer as tl  # lazy: see Imports above
    from megatron.core.transformer.spec_utils import ModuleSpec  # lazy: see Imports above
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # lazy: see Imports above

    assert arch.mamba is not None, "a hybrid Arch has its Mamba shape"
    _, stack, submodules, _, _ = hybrid_api()
    gpt = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                   normalization="RMSNorm").submodules
    if core_attention is not None:
        gpt.self_attention.submodules.core_attention = core_attention
    mixer = ModuleSpec(module=MambaMixer, params={"d_conv": arch.mamba.conv_kernel, "chunk_size": arch.mamba.chunk_size},
                       submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    layers: dict[str, Any] = dict(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm, mixer=mixer, mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=tl.TransformerLayer, submodules=tl.TransformerLayerSubmodules(
            input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda)))
    if arch.num_experts:
        layers["moe_layer"] = ModuleSpec(
            module=getattr(tl, "MoETransformerLayer", tl.TransformerLayer), submodules=tl.TransformerLayerSubmodules(
                pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda))
    return ModuleSpec(module=local_norm_stack(stack), submodules=submodules(**layers))


def config_kwargs(arch: mc.Arch, mem_eff: bool) -> dict[str, Any]:
    """TransformerConfig's fields for NemotronH's layers: Mamba-2 sizes, squared-ReLU non-gated experts (megatron
    fuses only gelu / swiglu with their bias: no bias-activation fusion, whatever train.fused_kernels says).
    mem_eff: megatron's fused split-conv1d-scan training path (needs causal-conv1d)."""
    from megatron.core.activations import squared_relu  # lazy: see Imports above

    m = arch.mamba
    assert m is not None
    return dict(is_hybrid_model=True, mamba_state_dim=m.state, mamba_head_dim=m.head_dim, mamba_num_groups=m.groups,
                mamba_num_heads=m.heads, use_mamba_mem_eff_path=mem_eff, gated_linear_unit=False,
                activation_func=squared_relu, bias_activation_fusion=False)


def moe_kwargs(arch: mc.Arch) -> dict[str, Any]:
    """NemotronH's router: sigmoid scores, top-k chosen on score + e_score_correction_bias (megatron's expert_bias,
    kept fixed as HF and the torch backend keep it: update rate 0), renormalised, scaled; one shared expert."""
    return dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                moe_router_topk_scaling_factor=arch.moe_scaling_factor,
                moe_shared_expert_intermediate_size=arch.shared_ffn_hidden_size or None)


def mem_eff_path_available() -> bool:
    """megatron's Mamba mixer found causal-conv1d (its fused training path runs on it)."""
    from megatron.core.ssm import mamba_mixer  # lazy: see Imports above

    return getattr(mamba_mixer, "causal_conv1d_fn", None) is not None


def build_hybrid(arch: mc.Arch, config: Any, *, pre_process: bool = True, post_process: bool = True,
                 core_attention: Optional[type] = None) -> Any:
    """megatron-core's hybrid model for a NemotronH Arch (no position embedding: NemotronH's attention has none)."""
    model, _, _, spec_key, pattern_key = hybrid_api()
    return model(config=config, vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                 pre_process=pre_process, post_process=post_process,
                 share_embeddings_and_output_weights=arch.tie_embeddings, position_embedding_type="none",
                 **{spec_key: local_stack_spec(arch, core_attention), pattern_key: arch.pattern})

