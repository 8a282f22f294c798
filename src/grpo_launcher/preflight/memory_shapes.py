"""The model as the memory model counts it (preflight/memory_estimate.py): its layer inventory, its parameters per
layer kind and per rank of a parallel layout, its largest tensor, its KV bytes per token, and the bytes per token
each layer saves for its backward. Pure functions of a RunSpec; every figure is bytes unless it says GiB.

Parameters per rank (Megatron-LM layouts, Shoeybi et al. 2019, arXiv:1909.08053; Narayanan et al. 2021,
arXiv:2104.04473): dense weights are split over TP and over the PP stages (the embedding sits on the first
stage, the output layer on the last; with PP = 1 one rank holds both); routed-expert weights over
EP·ETP and the PP stages. The layer shapes are counted matrix by matrix (`param_counts`); the 1.21 B Llama
shape of the calibration gives exactly 1,213,302,784 (= the HF model's count).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, §4): count the tensors each layer saves for its backward, per token. Their GPT layer
gives s·b·h·(34 + 5·a·s/h) bytes; our layers differ (no dropout masks, SwiGLU, GQA, RMSNorm, and SDPA/flash
attention, which never stores the a·s² score matrices: Dao et al. 2022, arXiv:2205.14135), so
`layer_activation_bytes` counts our code's tensors the same way. The per-token coefficients were checked
tensor by tensor with torch.autograd.graph.saved_tensors_hooks on both workers' models (CPU build, bf16
autocast / bf16 megatron; per layer and token: torch 30h + 4kv + 8f, megatron 20h + 6q + 6kv + 10f; for the
1.21 B Llama shape 108,544 B and 112,640 B). TP divides the tensors between the
column- and row-parallel linears; the norms' and the residual's tensors are divided only with sequence
parallelism (their eq. 4 vs eq. 5). CP divides the tokens. Full recomputation keeps only each layer's input
(2·s·b·h bytes per layer, their §5) plus one layer re-materialised during its backward. With PP the first
stage keeps up to PP micro-batches in flight (1F1B): L/PP layers × PP micro-batches = L layers' worth.
Working space: one layer's activations again (the gradients of the layer being back-propagated; two with
recomputation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.nemotron_h import memory_layout
from ..plan import train_devices, world_size
from ..spec.model_dir import model_facts
from ..spec.schema import Precision, RunSpec, TrainBackend

GIB = 2**30

# Hybrid layer layouts the ModelSpec does not carry. Nemotron 3 Nano 30B-A3B (from its published HF config:
# hybrid_override_pattern of 23 Mamba-2, 23 MoE and 6 GQA layers of head_dim 128; 128 routed experts top-6
# plus one shared expert of 3712; squared-ReLU experts; Mamba-2 with 64 heads × 64, 8 groups, state 128,
# conv 4). Not read from model.path: figures for this family are extrapolated.
HYBRID_LAYOUTS: dict[tuple[str, int], dict] = {
    ("nemotron_h", 52): dict(attention=6, mlp=0, moe=23, mamba=23, gated=False, shared_ffn=3712, head_dim=128,
                             mamba_heads=64, mamba_head_dim=64, groups=8, state=128, conv=4),
}


def dtype_bytes(p: Precision) -> int:
    return 2 if p == Precision.bfloat16 else 4


def gib(x: float) -> float:
    return x / GIB


# ------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Arch:
    """The layer inventory of a model: how many layers of each kind, and their dimensions."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    attention: int  # layers with self-attention
    mlp: int  # layers with a dense MLP
    moe: int  # layers with routed experts
    mamba: int  # Mamba-2 layers
    experts: int = 0
    top_k: int = 0
    gated: bool = True  # SwiGLU (3 matrices) vs a plain 2-matrix MLP (squared ReLU)
    shared_ffn: int = 0
    qkv_bias: bool = False
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    groups: int = 0
    state: int = 0
    conv: int = 0
    hybrid: bool = False  # the layout came from HYBRID_LAYOUTS (extrapolated)
    tied: bool = False  # output layer shares the embedding

    @property
    def layers(self) -> int:
        return self.attention + self.mlp + self.moe + self.mamba if self.hybrid else max(self.attention, 1)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim


def arch_of(spec: RunSpec) -> Arch:
    m = spec.model
    f = model_facts(m)  # head_dim: config.json's when set (Qwen3, Gemma), as the rules read it
    base = dict(hidden=m.hidden_size, heads=f.heads, kv_heads=f.kv_heads, head_dim=f.head_dim,
                ffn=m.ffn_hidden_size, vocab=m.vocab_size, experts=m.num_experts, top_k=m.moe_top_k,
                qkv_bias=m.family == "qwen2", tied=f.tied)
    hybrid = HYBRID_LAYOUTS.get((m.family, m.num_layers))
    if m.family == "nemotron_h" and m.path is None:  # built here: models/nemotron_h.py's layout, exactly
        hybrid = memory_layout(m)
    if hybrid:
        return Arch(**{**base, **hybrid}, hybrid=True)
    if m.num_experts:
        return Arch(**base, attention=m.num_layers, mlp=0, moe=m.num_layers, mamba=0)
    return Arch(**base, attention=m.num_layers, mlp=m.num_layers, moe=0, mamba=0)


@dataclass(frozen=True)
class ParamCounts:
    attention: int  # one attention block (incl. its norm)
    mlp: int  # one dense MLP block (incl. its norm)
    moe_dense: int  # one MoE block's non-expert part: router, shared expert, norm
    moe_experts: int  # one MoE block's routed experts
    mamba: int  # one Mamba-2 block (incl. its norm)
    embedding: int
    output: int  # the output layer (0 when tied to the embedding)
    final_norm: int

    def layers_dense(self, a: Arch) -> int:
        return a.attention * self.attention + a.mlp * self.mlp + a.moe * self.moe_dense + a.mamba * self.mamba

    def experts(self, a: Arch) -> int:
        return a.moe * self.moe_experts

    def total(self, a: Arch) -> int:
        return self.layers_dense(a) + self.experts(a) + self.embedding + self.output + self.final_norm

    def largest_layer(self, a: Arch) -> int:
        """The parameters of the largest decoder layer (FSDP2's unit; hybrids: one block of each kind)."""
        moe = self.moe_dense + self.moe_experts
        if a.hybrid:
            return max(self.attention if a.attention else 0, self.mlp if a.mlp else 0, moe if a.moe else 0,
                       self.mamba if a.mamba else 0)
        return self.attention + (moe if a.moe else self.mlp)


def param_counts(a: Arch) -> ParamCounts:
    h, q, kv = a.hidden, a.q_dim, a.kv_dim
    attn = h * q + 2 * h * kv + q * h + h + ((q + 2 * kv) if a.qkv_bias else 0)
    mats = 3 if a.gated else 2
    mlp = mats * h * a.ffn + h
    moe_dense = a.experts * h + (mats * h * a.shared_ffn if a.shared_ffn else 0) + h
    moe_experts = a.experts * mats * h * a.ffn
    di, gn = a.d_inner, a.groups * a.state
    mamba = (h * (2 * di + 2 * gn + a.mamba_heads) + (di + 2 * gn) * (a.conv + 1) + 3 * a.mamba_heads + di
             + di * h + h) if a.mamba else 0
    return ParamCounts(attn, mlp, moe_dense, moe_experts, mamba, a.vocab * h, 0 if a.tied else a.vocab * h, h)


@dataclass(frozen=True)
class Layout:
    """The policy's parallel layout as the worker runs it (torch: data parallel only)."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    world: int

    @property
    def dp(self) -> int:  # dense data parallel (the plan's policy DP size)
        return max(self.world // (self.tp * self.pp * self.cp), 1)

    @property
    def expert_dp(self) -> int:
        return max(self.world // (self.ep * self.etp * self.pp), 1)


def layout_of(spec: RunSpec) -> Layout:
    t = spec.train
    if t.backend == TrainBackend.torch:  # one policy rank per training device (FSDP2 over them when > 1)
        return Layout(1, 1, 1, 1, 1, False, max(train_devices(spec), 1))
    return Layout(t.tensor_parallel_size, t.pipeline_parallel_size, t.context_parallel_size,
                  t.expert_parallel_size, t.expert_tensor_parallel_size, t.sequence_parallel, world_size(spec))


def rank_params(a: Arch, pc: ParamCounts, lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters held by the most loaded rank (the first/last PP stage)."""
    edge = pc.embedding + pc.output + pc.final_norm if lay.pp == 1 else max(pc.embedding, pc.output + pc.final_norm)
    dense = (pc.layers_dense(a) / lay.pp + edge) / lay.tp
    experts = pc.experts(a) / lay.pp / (lay.ep * lay.etp)
    return dense, experts


def layer_activation_bytes(a: Arch, backend: str, act: int, autocast: bool, lay: Layout) -> dict[str, float]:
    """Bytes per token that one layer of each kind saves for its backward, on one rank.

    act: bytes of the compute dtype (2 bf16, 4 fp32). Returned per layer kind: 'attention', 'mlp', 'moe',
    'mamba' (each includes its pre-norm). TP divides the parallel-linear tensors; the norm/residual tensors
    only with SP. See the module docstring (Activations) for the derivation.
    """
    h, q, kv, f = a.hidden, a.q_dim, a.kv_dim, a.ffn
    tp, etp = lay.tp, lay.etp
    rep = tp if lay.sp else 1  # sequence parallelism splits the replicated (norm/residual) part too
    if backend == "torch":
        # HF Llama/Qwen2 on fp32 weights: fp32 residual stream; RMSNorm saves its input and the normalised
        # tensor (4h + 4h); under autocast every linear casts its fp32 input to bf16 separately (q/k/v: 3 casts,
        # gate/up: 2; without autocast the norm's fp32 output is saved once); RoPE's outputs are cast again for
        # SDPA, which saves q, k, v and its output (o_proj's input is that output, no copy); SwiGLU saves
        # gate, silu(gate), up and their product. Counted with saved-tensor hooks on CPU (the module docstring).
        norm = 8 * h
        attn = norm + (3 * 2 * h if autocast else 4 * h) + act * (2 * q + 2 * kv)
        mlp = norm + (2 * 2 * h if autocast else 4 * h) + 4 * act * f
        moe_routed = a.top_k * (2 * act * h + 5 * act * f) if a.experts else 0
        moe = norm + a.experts * 4 * 3 + moe_routed
        return {"attention": attn, "mlp": mlp, "moe": moe, "mamba": 0.0}
    # megatron-core local spec: torch RMSNorm in bf16 saves 4h + 2·2h, and the next linear its output (2h);
    # the fused QKV output (kept alive by the V view), RoPE'd q and k, the SDPA output (linear_proj's input is
    # a view of it); fc1's fused gate|up output, silu(gate), one more f-sized tensor and the product (fc2's
    # input): 5 tensors of f. Counted with saved-tensor hooks on the CPU build (the module docstring).
    norm = (4 * h + 3 * act * h) / rep
    attn = norm + act * (3 * q + 3 * kv) / tp
    act_f = 5 * act if a.gated else 4 * act  # bytes per ffn unit: SwiGLU 5 tensors, squared ReLU 4
    mlp = norm + act_f * f / tp
    # MoE: router logits/probs in fp32 (3 tensors of E), every routed copy of a token (top-k) saves its
    # permuted input, the expert's ffn tensors (split over ETP) and the output the combine weights.
    routed = a.top_k * (2 * act * h + act_f * f / etp) if a.experts else 0
    shared = act_f * a.shared_ffn / tp if a.shared_ffn else 0
    moe = norm + 3 * 4 * a.experts + routed + shared
    di, gn, mh = a.d_inner, a.groups * a.state, a.mamba_heads
    # Mamba-2 (extrapolated): in_proj output, conv output, the SSD scan's x/B/C/dt and output, the gated
    # RMSNorm (fp32) and out_proj's input.
    mamba = (norm + (act * (2 * di + 2 * gn + mh) * 2 + act * (di + 2 * gn) + 8 * di + 2 * act * di) / tp
             if a.mamba else 0.0)
    return {"attention": attn, "mlp": mlp, "moe": moe, "mamba": mamba}


def per_layer_list(a: Arch, per_kind: dict[str, float]) -> list[float]:
    """Bytes per token of each layer (a decoder layer = attention + its MLP/MoE; hybrids: one block each)."""
    if a.hybrid:
        return ([per_kind["attention"]] * a.attention + [per_kind["mlp"]] * a.mlp + [per_kind["moe"]] * a.moe
                + [per_kind["mamba"]] * a.mamba)
    ffn = per_kind["moe"] if a.moe else per_kind["mlp"]
    return [per_kind["attention"] + ffn] * a.layers


def largest_tensor(a: Arch) -> int:
    """Elements of the model's largest single tensor: the embedding / output layer, an MLP matrix, a Mamba
    in_proj, or one MoE layer's routed experts (transformers stores them as one 3-D tensor)."""
    mamba_in = a.hidden * (2 * a.d_inner + 2 * a.groups * a.state + a.mamba_heads) if a.mamba else 0
    return max(a.vocab * a.hidden, a.hidden * a.ffn, a.experts * a.ffn * a.hidden, mamba_in)


def kv_bytes_per_token(a: Arch, tp: int, dtype: int) -> float:
    """vLLM KV cache bytes per token on one GPU of an engine (KV heads replicated when TP > heads)."""
    kv_heads = max(1, math.ceil(a.kv_heads / tp))
    return 2 * a.attention * kv_heads * a.head_dim * dtype
