"""The model as the memory model counts it (preflight/memory_estimate.py): its layer inventory, its parameters per
layer kind and per rank of a parallel layout, its largest tensor, its KV bytes per token, and the bytes per token
each layer saves for its backward. Pure functions of a RunSpec; every figure is bytes unless it says GiB.

Parameters per rank (Megatron-LM layouts, Shoeybi et al. 2019, arXiv:1909.08053; Narayanan et al. 2021,
arXiv:2104.04473): dense weights are split over TP and over the PP stages (the embedding sits on the first
stage, the output layer on the last; with PP = 1 one rank holds both); routed-expert weights over
EP·ETP and the PP stages. The layer shapes are counted matrix by matrix (`param_counts`); the 1.21 B Llama
shape of the calibration gives exactly 1,213,302,784 (= the HF model's count).

Mamba-2 layers (nemotron_h) on the torch backend: counted on the path its workers will run (`MAMBA_PATHS`, chosen as
models/nemotron_h.py binds the kernels), the pure-torch reference's chunk-padded scan temporaries included.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, §4): count the tensors each layer saves for its backward, per token. Their GPT layer
gives s·b·h·(34 + 5·a·s/h) bytes; our layers differ (no dropout masks, SwiGLU, GQA, RMSNorm, and SDPA/flash
attention, which never stores the a·s² score matrices: Dao et al. 2022, arXiv:2205.14135), so
`layer_activation_bytes` counts our code's tensors the same way. Where the score matrices are stored after all
(transformers' eager attention for softcapped families, megatron's local core attention) they are added per layer:
`eager_score_bytes` and memory_estimate.local_score_bytes. The per-token coefficients were checked
tensor by tensor with torch.autograd.graph.saved_tensors_hooks on both workers' models (CPU build, bf16
autocast / bf16 megatron; per layer and token: torch 30h + 4kv + 8f, megatron 20h + 6q + 6kv + 10f; for the
1.21 B Llama shape 108,544 B and 112,640 B). On GPUs the megatron worker fuses SwiGLU (train.fused_kernels), which
saves 3 tensors of f instead of 5: 20h + 6q + 6kv + 6f (1.5 B Qwen2 shape on an H200 through launch.py, megatron
decode-heavy: the worker's 71.7 GiB whole-process peak against 70.7 predicted so, 82.2 unfused;
benchmarks/results/memory.md). TP divides the tensors between the
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

from ..logit_heads import read_text_config
from ..models.nemotron_h import memory_layout
from ..plan import train_devices, world_size
from ..spec.model_dir import model_facts
from ..spec.schema import Precision, RunSpec, TrainBackend

GIB = 2**30

# Hybrid layer layouts the ModelSpec does not carry. Nemotron 3 Nano 30B-A3B (from its published HF config:
# hybrid_override_pattern of 23 Mamba-2, 23 MoE and 6 GQA layers of head_dim 128; 128 routed experts top-6
# plus one shared expert of 3712; squared-ReLU experts; Mamba-2 with 64 heads × 64, 8 groups, state 128,
# conv 4, chunk 128 (NemotronHConfig's default)). Not read from model.path: figures for this family are extrapolated.
HYBRID_LAYOUTS: dict[tuple[str, int], dict] = {
    ("nemotron_h", 52): dict(attention=6, mlp=0, moe=23, mamba=23, gated=False, shared_ffn=3712, head_dim=128,
                             mamba_heads=64, mamba_head_dim=64, groups=8, state=128, conv=4, chunk=128),
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
    chunk: int = 0  # the Mamba-2 scan's chunk length
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


def layer_activation_bytes(a: Arch, backend: str, act: int, autocast: bool, lay: Layout, mamba: str = "torch",
                           seq: int = 0, fused: bool = False) -> dict[str, float]:
    """Bytes per token that one layer of each kind saves for its backward, on one rank.

    act: bytes of the compute dtype (2 bf16, 4 fp32). Returned per layer kind: 'attention', 'mlp', 'moe',
    'mamba' (each includes its pre-norm). TP divides the parallel-linear tensors; the norm/residual tensors
    only with SP. See the module docstring (Activations) for the derivation. The torch backend's Mamba-2 layers:
    `mamba_saved_bytes` on the path `mamba` (MAMBA_PATHS) for rows of `seq` tokens. fused: megatron's fused SwiGLU
    (`megatron_swiglu_fused`), which saves 3 tensors of f instead of 5.
    """
    h, q, kv, f = a.hidden, a.q_dim, a.kv_dim, a.ffn
    tp, etp = lay.tp, lay.etp
    rep = tp if lay.sp else 1  # sequence parallelism splits the replicated (norm/residual) part too
    norm: float
    attn: float
    mlp: float
    moe: float
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
        ssm = mamba_saved_bytes(a, mamba, seq, act) / seq if a.mamba and seq else 0.0
        return {"attention": attn, "mlp": mlp, "moe": moe, "mamba": ssm}
    # megatron-core local spec: torch RMSNorm in bf16 saves 4h + 2·2h, and the next linear its output (2h);
    # the fused QKV output (kept alive by the V view), RoPE'd q and k, the SDPA output (linear_proj's input is
    # a view of it); fc1's fused gate|up output, silu(gate), one more f-sized tensor and the product (fc2's
    # input): 5 tensors of f. Counted with saved-tensor hooks on the CPU build (the module docstring). With
    # megatron-core's fused SwiGLU (bias_activation_fusion, on GPUs by default: train.fused_kernels) the
    # activation is one autograd Function that saves only its input (fc1's gate|up output, 2 tensors of f) and
    # recomputes silu in its backward (megatron/core/fusions/fused_bias_swiglu.py, BiasSwiGLUFunction), plus
    # fc2's input: 3 tensors of f. The residual add's fusion (bias_dropout_fusion) saves nothing either way.
    norm = (4 * h + 3 * act * h) / rep
    attn = norm + act * (3 * q + 3 * kv) / tp
    # bytes per ffn unit: SwiGLU 5 tensors (3 fused), squared ReLU 4 (never fused: megatron_hybrid.py)
    act_f = (3 if fused else 5) * act if a.gated else 4 * act
    mlp = norm + act_f * f / tp
    # MoE: router logits/probs in fp32 (3 tensors of E), every routed copy of a token (top-k) saves its
    # permuted input, the expert's ffn tensors (split over ETP) and the output the combine weights.
    routed = a.top_k * (2 * act * h + act_f * f / etp) if a.experts else 0
    shared = act_f * a.shared_ffn / tp if a.shared_ffn else 0
    moe = norm + 3 * 4 * a.experts + routed + shared
    di, gn, mh = a.d_inner, a.groups * a.state, a.mamba_heads
    # Mamba-2 (extrapolated): in_proj output, conv output, the SSD scan's x/B/C/dt and output, the gated
    # RMSNorm (fp32) and out_proj's input.
    ssm = (norm + (act * (2 * di + 2 * gn + mh) * 2 + act * (di + 2 * gn) + 8 * di + 2 * act * di) / tp
           if a.mamba else 0.0)
    return {"attention": attn, "mlp": mlp, "moe": moe, "mamba": ssm}


# transformers 5's config classes that cap attention logits when config.json omits attn_logit_softcapping (their
# configuration_*.py defaults: Gemma-2's and VaultGemma's 50; Gemma-3's is None)
ATTN_SOFTCAP_DEFAULTS = {"gemma2": 50.0, "vaultgemma": 50.0}
# causal LMs whose transformers class has no SDPA (transformers 5.19: `_supports_sdpa` unset), so from_pretrained falls
# back to eager attention (modeling_utils.get_correct_attn_implementation); the attention-free ones (mamba, rwkv, xlstm)
# left out. Checked against transformers by tests/unit/test_memory.py.
NO_SDPA = frozenset("""big_bird bigbird_pegasus bloom codegen cpmant deepseek_v4 git got_ocr2 gpt_neo gpt_neox_japanese
    gpt_oss gptj granite_swa granitemoe_swa hy_v4 megatron-bert mimo_v2_flash mpt mvp openai-gpt prophetnet reformer
    rembert roformer trocr xglm xlm xlnet""".split())
# bytes autograd keeps per attention score and layer on eager attention, (fp32, bf16 autocast), measured with
# saved-tensor hooks (tests/unit/test_memory.py): softcapped (Gemma-2: tanh's output, the fp32 softmax, its cast
# back); these families' own eager functions; any other: the fp32 softmax and its cast back (Llama's
# eager_attention_forward; gptj, gpt_neo, bloom, codegen, mpt, gpt_oss measured so)
SOFTCAPPED_BYTES = (8, 8)
EAGER_BYTES = {"xglm": (16, 14), "granite_swa": (8, 10), "granitemoe_swa": (8, 10)}
PLAIN_EAGER_BYTES = (4, 6)


def model_type(spec: RunSpec) -> str:
    """config.json's model_type (its text model's) where model.path is readable here, else model.family."""
    cfg = read_text_config(spec.model.path) or {}
    return str(cfg.get("model_type") or spec.model.family)


def attention_softcapped(spec: RunSpec) -> bool:
    """The model caps its attention logits, so transformers runs it with eager attention, the policy and rollout=hf's
    engine alike: models/attention.py `hf_attention`'s choice, read here as files (config.json's
    attn_logit_softcapping, else the config class's default; the family's default where the directory is not readable
    here, as logit_heads.head_for)."""
    cfg = read_text_config(spec.model.path) or {"model_type": spec.model.family}
    key = "attn_logit_softcapping"
    cap = cfg[key] if key in cfg else ATTN_SOFTCAP_DEFAULTS.get(str(cfg.get("model_type")))
    return bool(cap)


def hf_eager(spec: RunSpec) -> bool:
    """transformers runs this model's attention eagerly: softcapped (models/attention.py asks for it) or a family
    without SDPA (`NO_SDPA`: transformers' own fallback)."""
    return attention_softcapped(spec) or model_type(spec) in NO_SDPA


def eager_attention(spec: RunSpec) -> bool:
    """The torch worker's policy runs transformers' eager attention (`hf_eager`). The megatron worker never does (its
    core attention is train.core_attention's; softcapped families are refused there)."""
    return spec.train.backend == TrainBackend.torch and hf_eager(spec)


def eager_bytes_per_score(spec: RunSpec, act: int) -> int:
    """Bytes one layer's eager attention keeps per [T, T] score for the backward (SOFTCAPPED_BYTES, EAGER_BYTES,
    PLAIN_EAGER_BYTES), for compute dtype bytes `act`."""
    fp32, bf16 = SOFTCAPPED_BYTES if attention_softcapped(spec) else EAGER_BYTES.get(model_type(spec),
                                                                                     PLAIN_EAGER_BYTES)
    return fp32 if act == 4 else bf16


def eager_score_bytes(a: Arch, act: int, seq: int, per_score: int = 8) -> float:
    """Bytes per token one layer of transformers' eager attention saves for its backward beyond SDPA, for rows of
    `seq` tokens: `per_score` bytes for each of the token's [heads, seq] scores (`eager_bytes_per_score`; 8 for the
    softcapped eager_attention_forward: tanh's output (`act` bytes), the fp32 softmax (4) and its cast back to the
    compute dtype for the second matmul (`act`; the same tensor when act = 4), in bf16 and fp32). Checked with
    saved-tensor hooks and the process's peak RSS on a CPU Gemma-2 (benchmarks/eager_attention_memory.py;
    benchmarks/results/memory.md). A micro-batch of n rows cut to its own longest row L (train.dynamic_batching)
    holds n·L² ≤ micro_batch_size·seq² scores: the full-length rows are the bound."""
    return per_score * a.heads * seq


def eager_forward_score_bytes(a: Arch, act: int, seq: int) -> float:
    """Bytes per token of one eager attention layer's transient scores in a forward without grad (the logprob pass,
    the hf engine's prefill): the largest moment is the mask's add, whose fp32 mask promotes bf16 scores (CPU: the
    bf16 input, a promoted copy and the fp32 sum, act + 8 bytes per score), or the fp32 softmax's input and output
    (8); plus the fp32 [T, T] masks eager attention is given, one per layer type (Gemma-2: full and sliding, 2 × 4 B
    × T per token; SDPA's are bool). Measured on the CPU (the same file); a GPU adds without the promoted copy (6 B
    per score): counted as the CPU's."""
    return (act + 8 if act < 4 else 8) * a.heads * seq + 2 * 4 * seq


def megatron_swiglu_fused(spec: RunSpec) -> bool:
    """The megatron worker runs megatron-core's fused SwiGLU: train.fused_kernels null (on with CUDA) or true, on GPUs
    (policy/megatron_policy.py `transformer_config`; the CPU build never fuses, and squared-ReLU layers are never
    fused: megatron_hybrid.py)."""
    return (spec.train.backend == TrainBackend.megatron and spec.cluster.gpus_per_node > 0
            and spec.train.fused_kernels is not False)


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


# ------------------------------------------------------------------ the torch backend's Mamba-2 layers
# Which code runs a NemotronH Mamba-2 mixer in training (models/nemotron_h.py bind_mamba_kernels / mamba_train_path):
#   "torch":   transformers' references (modeling_nemotron_h.py: torch conv1d, mamba2_chunk_scan's einsums);
#   "kernels": mamba-ssm's Triton chunk scan (mamba_chunk_scan_combined), torch conv1d, the mixer's gated RMSNorm;
#   "fused":   mamba-ssm's mamba_split_conv1d_scan_combined (conv, scan, gated norm and out_proj in one autograd
#              Function; needs causal-conv1d).
# Counted tensor by tensor from that code (transformers 5.19, mamba-ssm 2.3.2), per row of s tokens, under bf16
# autocast (linear / conv / bmm outputs in `act` bytes, the fp32 casts and the scan's own arithmetic in 4); fp32
# runs are counted with act = 4 (an upper bound: some casts are then no-ops). The pure-torch count is checked against
# what autograd saves (tests/unit/test_memory.py) and the profiler's peaks on the CPU build; the kernel paths need a
# GPU (benchmarks/nemotron_memory.py; benchmarks/results/memory.md, "Mamba-2 layers").
MAMBA_PATHS = ("torch", "kernels", "fused")


@dataclass(frozen=True)
class MambaDims:
    h: int  # heads
    p: int  # head dim
    n: int  # state size
    g: int  # groups
    d: int  # inner width h·p
    gn: int  # g·n: B (and C) width
    cd: int  # conv width d + 2·gn (x, B, C)
    proj: int  # in_proj's output d (gate) + cd + h (dt)


def mamba_dims(a: Arch) -> MambaDims:
    h, p, n, g = a.mamba_heads, a.mamba_head_dim, a.state, a.groups
    d, gn = h * p, g * n
    return MambaDims(h, p, n, g, d, gn, d + 2 * gn, 2 * d + 2 * gn + h)


def mamba_common_bytes(a: Arch, s: int, act: int) -> float:
    """Bytes one row of s tokens saves in a Mamba-2 block on every path, before the mixer's own work: the block's
    fp32 RMSNorm (its input and output [s, H], rsqrt [s, 1]), in_proj's input cast [s, H] and the padding mask
    ([s, 1] int64, apply_mask_to_padding_states)."""
    return s * (8 * a.hidden + 4 + act * a.hidden + 8)


def mamba_torch_scan_bytes(a: Arch, s: int, act: int) -> float:
    """Bytes mamba2_chunk_scan (the pure-torch reference) saves for one row of s tokens. It pads the row to whole
    chunks: S = c·Q tokens (Q = the chunk length). Shapes per row, b = 1; h heads × p, n state, c chunks."""
    m, Q = mamba_dims(a), a.chunk
    c = -(-s // Q)
    S = c * Q
    real = s * (2 * act * m.h  # dt + dt_bias: softplus' and clamp's inputs [s, h]
                + 8 * m.h  # dt.float() twice [s, h] (x·dt, A·dt)
                + 4 * m.d)  # x.float() [s, h, p] (x·dt)
    padded = S * (8 * m.d  # the scan's fp32 output [S, h, p] (the gated norm keeps it) and D's padded x
                  + 4 * m.h * m.n  # B repeated to h heads and padded [c, Q, h, n] (B·decay)
                  + 4 * m.h * Q  # L = exp(segment_sum(A)) [h, c, Q, Q]
                  + 2 * act * m.h * Q  # G = C·B [c, Q, Q, h] and M = G·L cast for its einsum
                  + 4 * act * m.h * m.n  # bmm operands [c·h, Q, n]: C and B (G), B·decay (states), C (C·states)
                  + 3 * act * m.d  # bmm operands [c·h, Q, p]: x (Y_diag), x (states); C·states [c, Q, h, p]
                  + 8 * m.h)  # decay_states, state_decay_out [h, c, Q]
    # chunk states [c + 1, h, p, n] in act bytes: the inter-chunk einsum's operand and the states C·states reads
    # (a view of new_states [c + 1, ...] when c = 1, a copy of its c chunks otherwise); decay_chunk [h, c+1, c+1]
    states = act * m.h * m.p * m.n * ((c + 1) + (c + 1 if c == 1 else c)) + (4 + act) * m.h * (c + 1) ** 2
    return real + padded + states


def mamba_saved_bytes(a: Arch, path: str, s: int, act: int) -> float:
    """Bytes one Mamba-2 block (norm + mixer) saves for its backward per row of s tokens on `path`."""
    m = mamba_dims(a)
    common = mamba_common_bytes(a, s, act)
    conv = act * m.cd * s + act * m.cd * (s + a.conv - 1)  # torch conv1d: its input cast [cd, s]; its output
    # [cd, s + K - 1] (silu's input is a view of it)
    out_proj = act * m.d * s  # out_proj's input cast [s, d]
    if path == "torch":
        # gated RMSNorm on the scan's fp32 output: gate.float(), silu(gate), x·silu(gate), the normalised
        # output [s, d]; rsqrt per group [s, g]
        norm = s * (16 * m.d + 4 * m.g)
        return common + conv + mamba_torch_scan_bytes(a, s, act) + norm + out_proj
    S = -(-s // a.chunk) * a.chunk
    if path == "kernels":
        # mamba_chunk_scan_combined keeps its output [s, h, p], x, B, C (views of the masked conv output [s, cd])
        # and dt (a view of in_proj's output [s, proj]), dA_cumsum [h, c, Q] fp32; the gated norm on a bf16
        # output adds its fp32 copy and a cast of the normalised output
        scan = s * (act * m.d + act * m.cd + act * m.proj) + 4 * m.h * S
        norm = s * (16 * m.d + act * m.d + 4 * m.g)
        return common + conv + scan + norm + out_proj
    if path == "fused":
        # MambaSplitConv1dScanCombinedFn keeps in_proj's output [s, proj], the scan output [s, d] and the
        # norm's rstd [s, g]; conv, norm and out_proj are recomputed in its backward
        return common + s * (act * m.proj + act * m.d + 4 * m.g)
    raise ValueError(f"unknown Mamba-2 path {path!r} (one of {MAMBA_PATHS})")


def mamba_work_bytes(a: Arch, path: str, s: int, act: int) -> float:
    """The transient peak beyond what a Mamba-2 block saves, per row of s tokens, while it runs forward or
    backward. torch: half of one block's saved tensors again (its einsums' fp32 operand copies and the gradients of
    the chunk tensors; the CPU build's profiler, benchmarks/results/memory.md);
    kernels / fused: the gradients of the saved tensors, plus the chunk states and their gradients
    [c, h, p, n] fp32 and C·Bᵀ [c, g, Q, Q] fp32 that the Triton backward recomputes (fused: also the
    recomputed conv output, its gradient and in_proj's gradient [s, cd + cd + proj])."""
    saved = mamba_saved_bytes(a, path, s, act)
    if path == "torch":
        return saved / 2
    m, Q = mamba_dims(a), a.chunk
    S = -(-s // Q) * Q
    triton = S * (8 * m.h * m.p * m.n / Q + 4 * m.g * Q)
    fused = act * s * (2 * m.cd + m.proj + m.d) if path == "fused" else 0
    return saved + triton + fused


def mamba_fixed_bytes(a: Arch, path: str, autocast: bool) -> float:
    """Bytes per Mamba-2 block and micro-batch that do not scale with tokens: the fused path casts out_proj's
    weight to the autocast dtype itself and keeps the copy for its backward [H, d]."""
    return 2 * a.hidden * mamba_dims(a).d if path == "fused" and autocast else 0.0
