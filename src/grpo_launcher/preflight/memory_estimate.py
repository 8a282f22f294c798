"""Memory pre-flight: what each GPU (and each node's host RAM) of the plan holds, phase by phase.

Pure functions of a validated RunSpec: nothing is imported from torch, nothing is allocated. The dry run
prints `report(spec)` (preflight/memory_report.py), whose `violations(spec)` the rule `gpu_memory_fits`
(preflight/budgets.py) reports when the peak exceeds `cluster.gpu_memory_gib`. Every figure below is bytes
unless it says GiB.

Formulas and their sources
--------------------------
Parameters per rank and activations per token: preflight/memory_shapes.py (its docstring).

Weights, gradients, optimizer (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054, §3: mixed-precision Adam
holds 2 + 2 + K·Ψ bytes with K = 12: fp32 master copy, momentum and variance; ZeRO stage 1 splits the K part
over data parallelism). What *this* project's workers hold:
  megatron (policy/megatron_policy.py): bf16 weights 2 B, fp32 grad buffer 4 B (`grad_reduce_in_fp32`),
      fp32 master + Adam m, v = 12 B per parameter (8 B with fp32 weights: no master copy). This is
      megatron-core's own table (docs "Distributed Optimizer": bf16 params + fp32 grads = 18 B/param,
      distributed = 6 + 12/d). The distributed optimizer shards the 12 B over d = DP·CP for dense
      parameters and over the expert-data-parallel group (world / (EP·ETP·PP)) for experts.
  torch (policy/torch_policy.py): the HF model is loaded in fp32 (4 B), fp32 grads (4 B), AdamW m, v
      (8 B) = 16 B/param; with train.precision=bfloat16 autocast keeps a bf16 copy of every weight for the
      backward (2 B), and the foreach AdamW step allocates one fp32 temporary per parameter (sqrt(v), 4 B).
      With DP > 1 the worker shards with FSDP2 (policy/fsdp.py; ZeRO-3 in the paper's terms, §5.3): each rank
      holds (16 + 4 step temp) / DP B per parameter, no autocast copies; the unsharded weights live only while
      they compute, in the compute dtype a (2 bf16 on GPUs, else 4): the root's (embedding, output layer,
      final norm) for the whole forward/backward, plus two layers (the running one and the prefetched one);
      the backward adds one layer's unsharded gradient in a and its fp32 copy for the reduce-scatter
      ((a + 4) B × the largest layer). The refit to colocated engines gathers one full tensor at a time in the
      engine's dtype (`weight_items`; the largest: the embedding, or a layer's fused experts), plus vLLM's
      packed IPC buffer (rollout/vllm_compat.py, ≤ 1 GiB): a "refit" phase of its own.
  reference model (loss.kl_coef > 0): one more copy of the weights (megatron: model dtype; torch: fp32,
      sharded like the policy with DP > 1).

Logits (the GRPO peak at long sequences and large vocabularies): the output layer makes [tokens, V/TP]
in the compute dtype; the response positions are gathered and divided by the temperature, then
log-softmaxed in fp32 (algos.token_logprobs; the entropy metric does it again). The gather saves its whole
input for the backward, which then allocates a zero-filled gradient of that shape. Counted per micro-batch
as k·V·L + c·V·T bytes for L sequence and T response tokens (`LOGITS_COEF`: megatron k = 3a, c = 16; torch
k = 2a, c = 2a + 6; a = compute dtype bytes).

The path that runs decides the count: the logprob head is the one the plan prints (`logprob_head`: the torch
worker's logit_heads.head_for, whole logits where config.json holds a logit post-processing the chunked head does not
reproduce; the family's transform adds one fp32 [chunk, V] temporary; a softcapped family's own forward keeps tanh's
[L, V] output on whole logits); attention that materialises [heads, T, T] scores adds them per layer (`score_bytes`:
the torch worker's eager attention for softcapped families (models/attention.py) and for families transformers has
no SDPA for (memory_shapes.NO_SDPA, their own bytes per score: EAGER_BYTES); megatron's
train.core_attention=local, with its kept scratch buffer), and rollout=hf's eager prefill holds one layer's.
train.dynamic_batching needs nothing of its own: its token budget is micro_batch_size rows of
max_total_sequence_length tokens (and max_new_tokens response positions), the shape counted here, and n rows of
length L ≤ that budget hold n·L² ≤ micro_batch_size·T² scores (policy/microbatch.py; tests/unit/test_memory.py).

Rollout engines (vLLM, Kwon et al. 2023, arXiv:2309.06180; vLLM docs, `gpu_memory_utilization`: the
fraction of the GPU's *total* memory this engine instance may use, weights + activations + KV cache): the
engine claims `rollout.gpu_memory_utilization × gpu_memory_gib` per GPU; weights are split over the engine's
TP; the KV cache gets the rest, or `rollout.kv_cache_memory_mb` where the user set it (the engine then holds
weights + activations + that, whatever the fraction; vLLM still checks the fraction is free at start). KV bytes per token = 2 (K and V) × attention layers × KV heads per rank
(≥ 1: vLLM replicates KV heads when TP > heads) × head_dim × dtype bytes. The engine refuses to start when
one max_model_len sequence does not fit; fewer sequences than the batch only queue.
Sleep mode (rollout.sleep_mode=true, plan.engine_sleeps: vLLM engines colocated with the policy on GPUs): after the rollout the engine sleeps at level 2 (rollout/vllm.py): vLLM's CuMemAllocator unmaps every
allocation tagged "weights" or "kv_cache" and empties torch's cache (vllm/device_allocator/cumem.py, sleep). What
stays is what lives outside those pools, at vLLM's defaults (vllm/config/model.py: sleep_mode_offload_cudagraph and
enable_nccl_comm_suspend both False): the engine process's CUDA context, its NCCL communicators (engine TP > 1)
and its captured CUDA graphs (enforce_eager=false), counted with the same constants as awake
(`sleep_residue`; vLLM logs the figure as "... GiB memory is still in use" and the driver logs
rollout/sleep_freed_gib). So: generate = policy resident + the whole engine budget; refit = the policy's refit
phase + the engine's woken weights + the residue (the KV cache wakes once the new weights are in, after the
policy's gather is freed); logprobs, train and optimizer step = the policy's phase + the residue. Engines that do
not sleep keep their budget claimed in every phase: each phase's peak is policy + rollout + contexts.

CUDA context and allocator: each process that touches a GPU holds a context outside PyTorch's counters
(CUDA_CONTEXT_GIB, plus NCCL's buffers in a distributed job; figures: benchmarks/results/memory.md); PyTorch's caching allocator
reserves more than it hands out (fragmentation of the transient allocations: reserved ≈ allocated +
ALLOCATOR_SLACK × the phase's transient part).

Host RAM per node: the Ray object store (cluster.object_store_memory_mb), each GPU process's own footprint
(CUDA, torch and library pages), the model loaded on the CPU before it is moved to the GPU (every policy rank
reads the whole HF checkpoint: torch in fp32, megatron in the checkpoint's dtype plus the converted copy),
and the refit source: rank 0's `state_dict()` is the full model on the CPU, shipped to every engine. A
sharded torch policy writes full-state checkpoints: rank 0 gathers the fp32 weights and AdamW state (12 B per
parameter) on its host.

Calibration: benchmarks/memory_gpu.py measures torch.cuda.max_memory_allocated / max_memory_reserved of
the project's own policy workers on a GPU and prints them next to these predictions
(benchmarks/results/memory.md). Figures for layouts the workers do not run yet (PP, CP, SP, MoE, Mamba
hybrids) are extrapolated from the same counting and say so in the report.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..logit_heads import HeadChoice, head_for, logit_transform, read_text_config
from ..models.nemotron_h import mamba_train_path, planned_packages
from ..plan import devices_per_node, engine_max_model_len, engine_sleeps, make_plan
from ..spec.errors import Violation
from ..spec.schema import Precision, RolloutBackend, RunSpec, TrainBackend
from .memory_shapes import (
    GIB,
    Arch,
    ParamCounts,
    arch_of,
    Layout,
    attention_softcapped,
    dtype_bytes,
    eager_attention,
    eager_bytes_per_score,
    eager_forward_score_bytes,
    eager_score_bytes,
    gib,
    hf_eager,
    kv_bytes_per_token,
    largest_tensor,
    layer_activation_bytes,
    layout_of,
    mamba_dims,
    mamba_fixed_bytes,
    mamba_work_bytes,
    megatron_swiglu_fused,
    model_type,
    per_layer_list,
    param_counts,
    rank_params,
)

# Constants the calibration may adjust (benchmarks/results/memory.md says how they were checked).
ALLOCATOR_SLACK = 0.16  # reserved = allocated + this × the phase's transient part (caching-allocator fragmentation)
CUDA_CONTEXT_GIB = 0.75  # one process's CUDA context + cuBLAS handles outside torch's counters
NCCL_GIB = 1.3  # NCCL communicators of one process: a distributed job, or megatron (NCCL even at world 1)
VLLM_ACTIVATION_GIB = 1.5  # vLLM's profiled forward peak inside its budget (max_num_batched_tokens=8192)
VLLM_OUTSIDE_BUDGET_GIB = 1.9  # a vLLM engine process's memory beyond gpu_memory_utilization × the GPU
DRIVER_CONTEXT_GIB = 0.6  # the driver's CUDA context once it built model.path=null's model on the GPU
VLLM_CUDA_GRAPH_GIB = 1.0  # captured CUDA graphs (enforce_eager=false)
IPC_BUFFER_BYTES = 2**30  # rollout/vllm_compat.py's packed buffer (vLLM's weight-transfer API)
CPU_KV_CACHE_MB = 64  # a CPU engine's KV cache where rollout.kv_cache_memory_mb is null (never sized from free RAM)
HOST_PROCESS_GIB = 2.0  # resident footprint of one GPU process (CUDA/torch/library pages)
# Logits bytes per vocab entry: (per sequence token, per response token) for compute dtype bytes `a`. The
# response gather saves its whole input for the backward (torch's gather_backward takes `self`), so the full
# [tokens, V] logits live until the backward, which adds a zero-filled gradient of the same shape (and
# megatron a contiguous copy for the output layer's backward): megatron 3a·V·L, torch 2a·V·L. Per response
# token: the fp32 log-softmax (saved), its gradient, the bf16 copies. Fitted on the CPU build with the
# profiler's allocation events (benchmarks/results/memory.md).
LOGITS_COEF = {"megatron": lambda a: (3 * a, 16 if a == 2 else 20),
               "torch": lambda a: (2 * a, 2 * a + 6)}


RESIDENT = ("weights", "grads", "optimizer", "reference", "attention score buffer")  # the buffer: core_attention=local
FSDP_PARTS = ("fsdp gathered weights", "fsdp gradient buffers")  # torch with FSDP2 (DP > 1) only
PHASE_PARTS = {  # what the policy holds in each phase (the engine: `engine_gib`)
    "generate": (*RESIDENT, "optimizer step temp"),  # held through the next rollout (phase_reserved)
    "logprobs": (*RESIDENT, "autocast copies", "fsdp gathered weights", "logprob logits"),
    "train": (*RESIDENT, "autocast copies", *FSDP_PARTS, "activations", "activation work", "logits"),
    "optimizer step": (*RESIDENT, "optimizer step temp"),
    "refit": (*RESIDENT, "refit gather"),  # torch with FSDP2 only
}


@dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    how: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class Estimate:
    device_gib: Optional[float]
    use_gpus: bool
    policy: dict[str, Item] = field(default_factory=dict)  # components (resident + transient)
    phases: dict[str, float] = field(default_factory=dict)  # GiB per GPU, policy side (allocated)
    policy_alloc_gib: float = 0.0  # the policy's allocated peak over its phases
    policy_reserved_gib: float = 0.0  # × (1 + ALLOCATOR_SLACK)
    policy_phase: str = ""
    rollout: dict[str, Item] = field(default_factory=dict)
    rollout_gib: float = 0.0
    asleep_gib: Optional[float] = None  # the engine's residue while it sleeps (None: it never sleeps)
    engine_weights_gib: float = 0.0  # the engine's weights (woken first by a refit)
    context_gib: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)  # GiB per GPU per phase: policy reserved + engine + contexts
    peak_gib: float = 0.0
    peak_phase: str = ""
    kv: dict[str, float] = field(default_factory=dict)
    host: dict[str, Item] = field(default_factory=dict)
    host_gib: float = 0.0
    notes: list[str] = field(default_factory=list)
    problems: list[Violation] = field(default_factory=list)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_gib is None else self.peak_gib <= self.device_gib


def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.3g}e9" if n >= 1e8 else f"{n / 1e6:.3g}e6"


def _chunked_logits(add: Callable[[str, float, str], None], a: Arch, v: float, act: int, chunk: int, tokens: float,
                    lp_tokens: float, transform: bool = False) -> None:
    """The chunked output layer (train.logprob_chunk_tokens, algos/linear_logprobs.py) over `tokens` positions: the
    torch worker's from the shortest prompt's end (counted as every token), megatron's the response tokens' (V: the
    rank's vocabulary rows, V/TP; the hidden states whole on each TP rank). One chunk's logits at a time. Update: the
    backward's chunk (the compute-dtype GEMM output, fp32 logits, the fp32 gradient and its compute-dtype copy:
    (2a + 8)·V per token) + the saved compute-dtype hidden states and fp32 per-token stats; the logprob pass: the
    forward's chunk (GEMM output, fp32 logits and softmax: (a + 8)·V per token). transform: the family's logit
    post-processing (logit_heads.LogitTransform: Gemma's softcap, Granite's / Cohere's scale) makes one more fp32
    [chunk, V] temporary in both (4·V per token: the profiler on CPU, tests/unit/test_memory.py)."""
    c, lp_c = min(chunk, tokens), min(chunk, lp_tokens)
    x = 4 if transform else 0
    why = " + the family's logit transform" if transform else ""
    add("logits", (2 * act + 8 + x) * v * c + (act * a.hidden + 16) * tokens,
        f"chunked: {2 * act + 8 + x}·V × {c:.0f} tok (train.logprob_chunk_tokens={chunk}){why} + saved hidden")
    add("logprob logits", (act + 8 + x) * v * lp_c + (act * a.hidden + 16) * lp_tokens,
        f"chunked, forward only: {act + 8 + x}·V × {lp_c:.0f} tok{why} + hidden")


def softcapped_logits(spec: RunSpec) -> bool:
    """The family's own forward caps its logits (Gemma's final_logit_softcapping: logit_heads.logit_transform)."""
    tr = logit_transform(read_text_config(spec.model.path) or {"model_type": spec.model.family})
    return tr is not None and tr.softcap is not None


def logprob_head(spec: RunSpec) -> HeadChoice:
    """The policy's logprob head as the worker builds it: the torch worker's logit_heads.head_for (the plan's "logprob
    head" line: whole logits where config.json holds a post-processing the chunked head does not reproduce);
    megatron's is chunked by train.logprob_chunk_tokens, without a transform (softcapped or scaled families are
    refused there), and whole logits with sequence parallelism (the worker refuses SP: counted as whole)."""
    t = spec.train
    if t.backend == TrainBackend.torch:
        return head_for(spec.model.path, spec.model.family, t.logprob_chunk_tokens)
    chunk = 0 if layout_of(spec).sp else t.logprob_chunk_tokens
    return HeadChoice(chunk, None, "")


@dataclass(frozen=True)
class Rank:
    """What the policy's most loaded rank holds, as the estimate's parts read it."""
    a: Arch
    lay: Layout
    dense: float  # params on this rank outside the experts
    experts: float  # expert params on this rank
    bf16: bool
    autocast: bool  # FSDP2's bf16 compute on the torch backend: counted with the same activations
    act: int  # bytes per activation element
    backend: str

    @property
    def n(self) -> float:
        return self.dense + self.experts


def rank_of(spec: RunSpec, est: Estimate) -> Rank:
    a, lay = arch_of(spec), layout_of(spec)
    dense, experts = rank_params(a, param_counts(a), lay)
    bf16, backend = spec.train.precision == Precision.bfloat16, spec.train.backend.value
    return Rank(a, lay, dense, experts, bf16, autocast=backend == "torch" and bf16 and est.use_gpus,
                act=2 if bf16 and (est.use_gpus or backend == "megatron") else 4, backend=backend)


def policy_estimate(spec: RunSpec, est: Estimate, mamba: Optional[str] = None) -> None:
    """Fill est.policy / est.phases for one policy rank (the most loaded one); `mamba`: the torch backend's Mamba-2
    path (memory_shapes.MAMBA_PATHS) instead of the planned one (`mamba_path_of`)."""
    r = rank_of(spec, est)
    it = est.policy

    def add(key: str, nbytes: float, how: str) -> None:
        it[key] = Item(key, nbytes, how)

    _resident_items(spec, est, r, add)
    mamba = mamba or (mamba_path_of(spec)[0] if r.a.mamba and r.backend == "torch" else "torch")
    plain, lp_scores = _activation_items(spec, r, add, mamba)
    lp_tokens = _logit_items(spec, r, add)
    g = lambda *keys: sum(it[k].bytes for k in keys if k in it)  # noqa: E731
    resident = g(*RESIDENT)
    cast = g("autocast copies") + g("fsdp gathered weights")  # FSDP2: the unsharded compute copies instead
    est.phases = {
        "generate": gib(resident),
        # (the frozen reference model's casts are not cached: autocast caches leaves that require grad)
        "logprobs": gib(resident + cast + g("logprob logits") + (2 * max(plain) + lp_scores) * lp_tokens),
        "train": gib(resident + cast + g("activations", "activation work", "logits", "fsdp gradient buffers")),
        "optimizer step": gib(resident + g("optimizer step temp")),
    }
    if "refit gather" in it:
        est.phases["refit"] = gib(resident + g("refit gather"))
    est.policy_phase = max(est.phases, key=est.phases.get)
    est.policy_alloc_gib = est.phases[est.policy_phase]
    # the big resident blocks (weights, grad buffer, optimizer states) do not fragment; the transients do
    est.policy_reserved_gib = est.policy_alloc_gib + ALLOCATOR_SLACK * (est.policy_alloc_gib - est.phases["generate"])
    est.notes.extend(_policy_notes(spec, r, mamba))


def _resident_items(spec: RunSpec, est: Estimate, r: Rank, add: Callable[[str, float, str], None]) -> None:
    """Weights, gradients, optimizer states, the reference model and the optimizer step's temporary."""
    t, lo, n, lay = spec.train, spec.loss, r.n, r.lay
    P = _fmt_params(n)
    if r.backend == "megatron":
        wb = 2 if r.bf16 else 4
        add("weights", wb * n, f"{P} params/rank × {wb} B ({t.precision.value})")
        add("grads", 4 * n, f"{P} × 4 B (fp32 grad buffer)")
        ob = 12 if r.bf16 else 8
        if t.distributed_optimizer:
            d_dense, d_exp = lay.dp * lay.cp, lay.expert_dp
            opt_n = r.dense / d_dense + r.experts / d_exp
            how = f"{ob} B × ({_fmt_params(r.dense)} dense / {d_dense} + {_fmt_params(r.experts)} expert / {d_exp}) " \
                  "(distributed optimizer)" if r.experts else f"{ob} B × {P} / {d_dense} (distributed optimizer, DP·CP)"
        else:
            opt_n = n
            how = f"{P} × {ob} B ({'fp32 master + ' if r.bf16 else ''}Adam m, v)"
        add("optimizer", ob * opt_n, how)
        if lo.kl_coef > 0:
            add("reference", wb * n, f"loss.kl_coef={lo.kl_coef:g}: {P} × {wb} B")
        step_tmp = 4 * opt_n
    elif fsdp_sharded(spec):
        step_tmp = _torch_fsdp(spec, est, r.a, param_counts(r.a), n, lay.dp, r.act)
    else:
        add("weights", 4 * n, f"{P} params × 4 B (fp32: the torch worker loads fp32)")
        add("grads", 4 * n, f"{P} × 4 B (fp32)")
        add("optimizer", 8 * n, f"{P} × 8 B (AdamW m, v, fp32)")
        if r.autocast:
            add("autocast copies", 2 * n, f"{P} × 2 B (bf16 weight casts kept for the backward)")
        if lo.kl_coef > 0:
            add("reference", 4 * n, f"loss.kl_coef={lo.kl_coef:g}: {P} × 4 B (fp32 copy)")
        step_tmp = 4 * n
    add("optimizer step temp", step_tmp, "4 B × optimizer params (foreach AdamW's sqrt(v))")


def _activation_items(spec: RunSpec, r: Rank, add: Callable[[str, float, str], None],
                      mamba: str) -> tuple[list[float], float]:
    """Activations of one micro-batch on this rank; returns the per-layer bytes/token without attention scores
    (the logprob pass's layers) and the logprob pass's score bytes/token."""
    t, a, lay, act, backend = spec.train, r.a, r.lay, r.act, r.backend
    ckpt = t.activation_checkpointing
    # a layer's input under full recompute: megatron's and FSDP2's residual stream is in the compute dtype, the
    # unsharded torch worker's in fp32 (its master weights; autocast casts only inside the linears)
    res = act if backend == "megatron" or fsdp_sharded(spec) else 4
    seq = t.max_total_sequence_length
    tokens = t.micro_batch_size * seq / lay.cp
    fused = megatron_swiglu_fused(spec) and a.gated
    per_kind = layer_activation_bytes(a, backend, act, r.autocast, lay, mamba=mamba, seq=seq, fused=fused)
    on_stage = max(1, math.ceil(a.layers / lay.pp))  # the first PP stage's layers
    plain = per_layer_list(a, per_kind)[:on_stage]
    scores, lp_scores, score_how = score_bytes(spec, a, act, seq, lay)  # eager / local attention's [T, T] scores
    per_kind = {**per_kind, "attention": per_kind["attention"] + scores}
    stage = per_layer_list(a, per_kind)[:on_stage]
    rows = t.global_batch_size // max(lay.dp, 1)
    in_flight = min(lay.pp, max(1, math.ceil(rows / t.micro_batch_size))) if lay.pp > 1 else 1
    rep = lay.tp if lay.sp else 1
    # final norm + the output layer's input, and RoPE's cos/sin (fp32, shared by the layers)
    final: float
    if backend == "torch":
        final = 8 * a.hidden + (2 if r.autocast else 4) * a.hidden + 2 * 4 * a.head_dim
    else:
        final = (4 * a.hidden + 3 * act * a.hidden) / rep + 4 * a.head_dim
    # the torch backend's Mamba-2 blocks: their transient peak while one runs (memory_shapes.mamba_work_bytes)
    ssm_work = mamba_work_bytes(a, mamba, seq, act) / seq if backend == "torch" and a.mamba else 0.0
    if ckpt:
        stored = len(stage) * res * a.hidden / rep * tokens * in_flight
        how = f"{len(stage)} layers × {res}·h B (layer inputs, full recompute) × {tokens:.0f} tok"
        work = max(2 * max(stage), per_kind["mamba"] + ssm_work) * tokens
    else:
        stored = sum(stage) * tokens * in_flight
        how = f"{sum(stage) / len(stage) / 1024:.1f} KiB/tok/layer × {len(stage)} layers × {tokens:.0f} tok" + (
            " (fused SwiGLU)" if fused else "") + score_how
        work = max(max(stage), ssm_work) * tokens
    if in_flight > 1:
        how += f" × {in_flight} micro-batches in flight (1F1B)"
    if backend == "torch" and a.mamba:
        how += f" (Mamba-2 on the {mamba} path: {per_kind['mamba'] / 1024:.1f} KiB/tok each)"
        stored += a.mamba * mamba_fixed_bytes(a, mamba, r.autocast)
    add("activations", stored + final * tokens, how)
    buf = score_buffer_bytes(spec, a, act, seq, lay)
    if buf:
        add("attention score buffer", buf, f"{act} B × {max(t.micro_batch_size, t.logprob_batch_size)} rows × "
            f"{a.heads / lay.tp:g} heads × T² (megatron's global memory buffer: baddbmm's scratch, kept)")
    add("activation work", work, "one layer re-materialised/back-propagated" if ckpt else "one layer's gradients")
    return plain, lp_scores


def _logit_items(spec: RunSpec, r: Rank, add: Callable[[str, float, str], None]) -> float:
    """The output layer's logits in the update and in the logprob pass; returns the logprob pass's tokens."""
    t, lay, act, backend = spec.train, r.lay, r.act, r.backend
    seq, resp = t.max_total_sequence_length, spec.rollout.max_new_tokens
    tokens, rtokens = t.micro_batch_size * seq / lay.cp, t.micro_batch_size * resp / lay.cp
    v = r.a.vocab / lay.tp
    lp_tokens, lp_rtokens = t.logprob_batch_size * seq / lay.cp, t.logprob_batch_size * resp / lay.cp
    # megatron: over the response tokens (policy/megatron_policy.py _token_stats)
    head = logprob_head(spec)
    if head.chunk:
        n, lp_n = (tokens, lp_tokens) if backend == "torch" else (rtokens, lp_rtokens)
        _chunked_logits(add, r.a, v, act, head.chunk, n, lp_n, transform=head.transform is not None)
    else:
        lead, c = LOGITS_COEF[backend](act)
        cap = act if backend == "torch" and softcapped_logits(spec) else 0  # the family's forward: tanh keeps [L, V]
        add("logits", (lead + cap) * v * tokens + c * v * rtokens,
            f"{lead + cap}·V·L + {c}·V·T = V {v:.0f} × (L {tokens:.0f}, T {rtokens:.0f} tok)"
            + (f" ({head.why})" if t.logprob_chunk_tokens and head.why else ""))
        add("logprob logits", 2 * act * v * lp_tokens + 12 * v * lp_rtokens,
            f"forward only: {2 * act}·V·L + 12·V·T for train.logprob_batch_size={t.logprob_batch_size}")
    return lp_tokens


def _policy_notes(spec: RunSpec, r: Rank, mamba: str) -> list[str]:
    """What the policy's estimate extrapolates (hybrid layouts, PP/CP/SP/MoE) and which Mamba-2 path it counts."""
    a, lay, notes = r.a, r.lay, []
    if a.hybrid:
        where = "the one built here (models/nemotron_h.py)" if spec.model.path is None else \
            "the published one, not read from model.path"
        notes.append(f"extrapolated: the {spec.model.family} layer layout ({a.mamba} Mamba / {a.moe} MoE / "
                     f"{a.attention} attention) is {where}; Mamba/MoE activations are counted, not measured")
        if r.backend == "torch":
            known = mamba_path_of(spec)[1]
            notes.append(f"Mamba-2 counted on the {MAMBA_WORDS[mamba]} path" + (
                " (judged from this interpreter's packages, as the plan's Mamba-2 line)" if known else
                " (the node's packages decide: counted as the pure-torch path, the largest)"))
        if spec.train.sequence_packing and mamba != "torch":
            notes.append("packed: the Mamba layers take seq_idx on the packed rows (mamba-ssm's kernels, true "
                         "varlen; policy/packing.py)")
        elif spec.train.sequence_packing:
            notes.append("packed: the Mamba layers run on the sequences as padded groups (policy/packing.py), "
                         "up to 2x their tokens; counted as the packed rows")
    if r.backend == "megatron" and (lay.pp > 1 or lay.cp > 1 or lay.sp or a.experts):
        notes.append("extrapolated: PP/CP/SP/MoE activation terms (calibrated on dense TP=1 only)")
    return notes


def score_bytes(spec: RunSpec, a: Arch, act: int, seq: int, lay: Layout) -> tuple[float, float, str]:
    """(bytes per token one attention layer saves for its backward beyond SDPA's count, bytes per token of one layer's
    forward transient without grad, the `how` words) for attention that materialises the [heads, T, T] scores: the
    torch worker's eager attention (memory_shapes.eager_attention: softcapped families, families without SDPA) and
    megatron's local core
    attention (train.core_attention=local: `local_score_bytes`). 0 for SDPA / flash, which never store them."""
    if eager_attention(spec):
        per = eager_bytes_per_score(spec, act)
        saved, fwd = eager_score_bytes(a, act, seq, per), eager_forward_score_bytes(a, act, seq)
        why = "attn_logit_softcapping, models/attention.py" if attention_softcapped(spec) else \
            f"{model_type(spec)} has no SDPA in transformers"
        return saved, fwd, f" + eager attention's [T, T] scores ({per} B × {a.heads} heads × T {seq} per token and " \
                           f"layer: {why})"
    if spec.train.backend == TrainBackend.megatron and spec.train.core_attention == "local":
        saved, fwd = local_score_bytes(a, act, seq, lay.tp)
        return saved, fwd, f" + local core attention's [T, T] scores ({act + 4 if act < 4 else 4} B × " \
                           f"{a.heads / lay.tp:g} heads × T {seq} per token and layer: train.core_attention=local)"
    return 0.0, 0.0, ""


def local_score_bytes(a: Arch, act: int, seq: int, tp: int) -> tuple[float, float]:
    """megatron's local DotProductAttention (megatron/core/transformer/dot_product_attention.py, the torch softmax
    path: masked_softmax_fusion off), per token and layer on one TP rank: (saved, forward transient without grad).
    Saved: the fp32 softmax and its cast back for the second bmm (act + 4 B per score; 4 in fp32, where the cast is a
    no-op) and the key and value repeated to every query head (repeat_interleave; SDPA keeps the KV heads):
    2·act·(q − kv)/TP. Forward: baddbmm's output and its fp32 copy, then the softmax's fp32 input and output: 8 B
    per score. Checked with saved-tensor hooks on the CPU build (benchmarks/results/memory.md)."""
    heads = a.heads / tp
    saved = (act + 4 if act < 4 else 4) * heads * seq + 2 * act * (a.q_dim - a.kv_dim) / tp
    return saved, 8 * heads * seq


def score_buffer_bytes(spec: RunSpec, a: Arch, act: int, seq: int, lay: Layout) -> float:
    """megatron's local core attention computes the raw scores with baddbmm over a scratch tensor from megatron's
    global memory buffer ([rows · heads/TP, T, T] in the compute dtype), which is kept and grown to the largest
    micro-batch it served (the logprob pass's or the update's): resident from the first forward on."""
    if spec.train.backend != TrainBackend.megatron or spec.train.core_attention != "local":
        return 0.0
    rows = max(spec.train.micro_batch_size, spec.train.logprob_batch_size)
    return act * rows * a.heads / lay.tp * (seq / lay.cp) * seq


MAMBA_WORDS = {"torch": "pure-torch (transformers' reference scan, chunk-padded)",
               "kernels": "mamba-ssm Triton chunk-scan (torch conv1d)", "fused": "mamba-ssm fused split-conv1d-scan"}


def mamba_path_of(spec: RunSpec) -> tuple[str, bool]:
    """(the torch backend's Mamba-2 train path as memory_shapes.MAMBA_PATHS names it, whether it is known here):
    models/nemotron_h.py's choice from the packages the plan's Mamba-2 line reads; the pure-torch path where the node
    decides (the largest)."""
    packages = planned_packages(spec)
    if packages is None:
        return "torch", False
    return mamba_train_path(*packages, on_cuda=spec.cluster.gpus_per_node > 0), True


def fsdp_sharded(spec: RunSpec) -> bool:
    """The torch worker shards with FSDP2: over DP > 1 ranks, or on one rank for train.cpu_offload (on GPUs)."""
    return spec.train.backend == TrainBackend.torch and (layout_of(spec).dp > 1 or offloaded(spec))


def offloaded(spec: RunSpec) -> bool:
    """train.cpu_offload where the worker applies it (torch_policy: a CUDA device; pre-flight refuses the rest)."""
    return spec.train.cpu_offload and spec.train.backend == TrainBackend.torch and spec.cluster.gpus_per_node > 0


def _torch_fsdp(spec: RunSpec, est: Estimate, a: Arch, pc: ParamCounts, n: float, dp: int, act: int) -> float:
    """The torch worker's resident and FSDP2 items (see the module doc); returns the step temp. train.cpu_offload:
    the shards, grads, AdamW state and the step run in host RAM (`host_estimate`); on the GPU the copied-in fp32
    shards of the gathered layers and the reduce-scattered fp32 gradient shard are added."""
    it = est.policy
    P, S = _fmt_params(n), _fmt_params(n / dp)
    off = offloaded(spec)
    gpu = 0 if off else 1
    where = " on the host (train.cpu_offload)" if off else ""
    it["weights"] = Item("weights", gpu * 4 * n / dp, f"{P} params × 4 B / DP {dp} (fp32 shards, FSDP2){where}")
    it["grads"] = Item("grads", gpu * 4 * n / dp, f"{S} × 4 B (fp32 sharded grads){where}")
    it["optimizer"] = Item("optimizer", gpu * 8 * n / dp, f"{S} × 8 B (AdamW m, v on the shards){where}")
    if spec.loss.kl_coef > 0:
        it["reference"] = Item("reference", gpu * 4 * n / dp,
                               f"loss.kl_coef={spec.loss.kl_coef:g}: {S} × 4 B (sharded){where}")
    root, layer = pc.embedding + pc.output + pc.final_norm, pc.largest_layer(a)
    copied = 4 * (root + 2 * layer) / dp if off else 0  # the fp32 shards copied in before each all-gather
    it["fsdp gathered weights"] = Item("fsdp gathered weights", act * (root + 2 * layer) + copied,
                                       f"{act} B × (root {_fmt_params(root)} + 2 layers × {_fmt_params(layer)})"
                                       + (f" + their fp32 shards copied in (4 B / DP {dp})" if off else ""))
    it["fsdp gradient buffers"] = Item("fsdp gradient buffers", (act + 4) * layer + (4 * layer / dp if off else 0),
                                       f"({act} + 4) B × {_fmt_params(layer)} (one layer's unsharded grad, fp32 "
                                       "reduce-scatter input)" + (" + its fp32 shard before the copy out" if off
                                                                  else ""))
    if spec.cluster.rollout_devices == 0:  # colocated engines refit from `weight_items` on the device
        eb = 2 if est.use_gpus and spec.train.precision == Precision.bfloat16 else 4  # rollout.hf.engine_dtype
        big = largest_tensor(a)
        vllm = spec.rollout.backend == RolloutBackend.vllm  # its IPC buffer: 1 GiB, or the largest tensor's size
        ipc = max(min(IPC_BUFFER_BYTES, pc.total(a) * eb), eb * big) if vllm else 0
        it["refit gather"] = Item("refit gather", eb * big + ipc, f"{_fmt_params(big)} × {eb} B (the largest "
                                  "tensor, gathered one at a time)" + (" + vLLM's IPC buffer" if ipc else ""))
    return gpu * 4 * n / dp


def sleep_residue(spec: RunSpec) -> float:
    """GiB a vLLM engine keeps on each of its GPUs asleep at level 2 (the module doc): its CUDA context, its NCCL
    communicators when the engine spans GPUs, its CUDA graphs unless eager."""
    r = spec.rollout
    nccl = r.tensor_parallel_size * r.pipeline_parallel_size > 1
    return CUDA_CONTEXT_GIB + (NCCL_GIB if nccl else 0) + (0 if r.enforce_eager else VLLM_CUDA_GRAPH_GIB)


def _vllm_estimate(spec: RunSpec, est: Estimate, a: Arch, mml: int) -> None:
    """The engine's weights, activation reserve and KV cache: the size it will be given (rollout/vllm.py
    kv_cache_bytes): rollout.kv_cache_memory_mb where set; else on a GPU the rest of its budget, on CPU
    CPU_KV_CACHE_MB."""
    r, it = spec.rollout, est.rollout
    total = param_counts(a).total(a)
    tp = r.tensor_parallel_size * r.pipeline_parallel_size
    db = dtype_bytes(spec.model.dtype)
    weights = total * db / tp
    budget = r.gpu_memory_utilization * (est.device_gib or 0) * GIB
    extra = (VLLM_ACTIVATION_GIB + (0 if r.enforce_eager else VLLM_CUDA_GRAPH_GIB)) * GIB
    it["engine weights"] = Item("engine weights", weights, f"{_fmt_params(total)} × {db} B / engine TP {tp}")
    est.engine_weights_gib = gib(weights)
    if engine_sleeps(spec):
        est.asleep_gib = sleep_residue(spec)
    it["engine activations"] = Item("engine activations", extra, "profiled forward" + ("" if r.enforce_eager
                                                                                       else " + CUDA graphs"))
    per_tok = kv_bytes_per_token(a, tp, db)
    plan = make_plan(spec)
    seqs = plan.rollouts_per_step / max(plan.rollout_engines, 1)
    need = seqs * mml * per_tok
    batch = f"{seqs:.0f} seq × {mml} tok × {per_tok / 1024:.1f} KiB"
    user = r.kv_cache_memory_mb
    if user is not None or not est.use_gpus:
        mb = CPU_KV_CACHE_MB if user is None else user
        kv, how = float(mb * 2**20), f"rollout.kv_cache_memory_mb={user}" if user else "null: the CPU default"
    elif est.device_gib is None:
        kv, how = need, "what the batch needs (gpu_memory_gib unknown)"
    else:
        kv, how = budget - weights - extra, f"rest of {r.gpu_memory_utilization:g} × {est.device_gib:g} GiB"
    est.kv = {"per_token": per_tok, "need": need, "available": kv, "max_model_len": mml, "seqs": seqs,
              "one_seq": mml * per_tok}
    it["KV cache"] = Item("KV cache", max(kv, 0.0), f"{how}; the batch needs {gib(need):.1f} GiB ({batch})")
    derived_budget = user is None and est.use_gpus and est.device_gib is not None
    est.rollout_gib = gib(budget) if derived_budget else gib(weights + extra + kv)
    if a.mamba:
        est.notes.append("extrapolated: Mamba state per sequence not counted in the KV figure (small)")


def rollout_estimate(spec: RunSpec, est: Estimate) -> None:
    a = arch_of(spec)
    mml = engine_max_model_len(spec)
    if spec.rollout.backend == RolloutBackend.vllm:
        return _vllm_estimate(spec, est, a, mml)
    if not est.use_gpus:  # hf: a copy of the model in the run's precision + generate's KV cache and logits
        return None
    total = param_counts(a).total(a)
    plan = make_plan(spec)
    it = est.rollout
    db = 2 if spec.train.precision == Precision.bfloat16 else 4
    seqs = plan.rollouts_per_step / max(plan.rollout_engines, 1)
    per_tok = kv_bytes_per_token(a, 1, db)
    it["engine weights"] = Item("engine weights", total * db, f"HF copy: {_fmt_params(total)} × {db} B")
    it["KV cache"] = Item("KV cache", seqs * mml * per_tok, f"{seqs:.0f} seq × {mml} tok × "
                          f"{per_tok / 1024:.1f} KiB (generate's dynamic cache)")
    it["sampling logits"] = Item("sampling logits", 3 * 4 * seqs * a.vocab, "fp32 logits/probs of one step")
    if hf_eager(spec):  # eager attention (models/attention.py, or no SDPA): the prefill's [prompts, heads, W, W]
        width = mml - spec.rollout.max_new_tokens
        prompts = seqs / spec.grpo.num_generations_per_prompt if not a.mamba else seqs  # rollout/hf.py sample
        it["prefill scores"] = Item("prefill scores", prompts * width * eager_forward_score_bytes(a, db, width),
                                    f"eager attention: {prompts:.0f} prompts × {a.heads} heads × {width}² scores "
                                    "of one layer (the prompts' prefill, at once)")
    if a.mamba:  # generate's cache: per sequence and Mamba-2 layer the SSM state [h, p, n] and conv state [cd, K]
        md = mamba_dims(a)
        it["Mamba states"] = Item("Mamba states", seqs * a.mamba * (md.d * md.n + md.cd * a.conv) * db,
                                  f"{seqs:.0f} seq × {a.mamba} layers × (SSM [h, p, n] + conv [cd, K]) × {db} B")
    est.rollout_gib = gib(sum(i.bytes for i in it.values())) * (1 + ALLOCATOR_SLACK)
    est.context_gib += CUDA_CONTEXT_GIB  # its own process
    return None


def host_estimate(spec: RunSpec, est: Estimate) -> None:
    a = arch_of(spec)
    total = param_counts(a).total(a)
    per_node = devices_per_node(spec)
    procs = 2 * per_node  # a policy and a rollout actor per device
    it = est.host
    it["object store"] = Item("object store", spec.cluster.object_store_memory_mb * 2**20,
                              "cluster.object_store_memory_mb")
    it["processes"] = Item("processes", procs * HOST_PROCESS_GIB * GIB,
                           f"{procs} GPU/worker processes × {HOST_PROCESS_GIB:g} GiB")
    if spec.train.backend == TrainBackend.megatron:
        load = per_node * 2 * total * dtype_bytes(spec.model.dtype)
        how = f"{per_node} ranks × (HF checkpoint + converted copy) × {dtype_bytes(spec.model.dtype)} B"
        refit_b = dtype_bytes(spec.train.precision)
    elif fsdp_sharded(spec):  # policy/fsdp.materialize: rank 0 alone reads, the shards go out by broadcast
        load, how, refit_b = 4 * total, f"rank 0 alone: {_fmt_params(total)} × 4 B (FSDP2 broadcasts the shards)", 4
    else:
        load = per_node * 4 * total
        how = f"{per_node} ranks × {_fmt_params(total)} × 4 B (fp32 load before .to(device))"
        refit_b = 4
    # engines on devices of their own refit from state_dict(): a sharded torch policy gathers it on every rank
    sharded = fsdp_sharded(spec)
    ranks = per_node if sharded and spec.cluster.rollout_devices > 0 else 1
    it["model load (start-up)"] = Item("model load (start-up)", load, how)
    it["refit copies (node 0)"] = Item("refit copies (node 0)", (ranks + 1) * total * refit_b,
                                       f"{ranks} rank(s)' state_dict() + the serialized copy sent to the engines")
    if sharded:  # checkpoints are full-state: rank 0 gathers fp32 weights + AdamW m, v on its host to write them
        it["checkpoint gather (node 0)"] = Item("checkpoint gather (node 0)", 12 * total,
                                                f"{_fmt_params(total)} × (4 + 8) B (full weights + optimizer state)")
    offload = 0.0
    if offloaded(spec):  # every rank's shards, grads, AdamW m, v and the CPU step's sqrt(v) (+ the reference)
        per_param = 20 + (4 if spec.loss.kl_coef > 0 else 0)
        dp = layout_of(spec).dp
        offload = per_node * per_param * total / dp
        it["offloaded shards"] = Item("offloaded shards", offload, f"{per_node} ranks × {_fmt_params(total)} × "
                                      f"{per_param} B / DP {dp} (train.cpu_offload, pinned)")
    files = [p for p in (spec.env.train_path, spec.env.val_path) if p]
    size = sum(os.path.getsize(p) for p in files if os.path.isfile(p))
    it["dataloader"] = Item("dataloader", 3 * size, "3 × the env's data files (parsed rows in the driver); "
                            "built-in generators ≈ 0" if files else "built-in prompt generator (≈ 0)")
    est.host_gib = gib(it["object store"].bytes + it["processes"].bytes + it["dataloader"].bytes + offload
                       + max(it[k].bytes for k in ("model load (start-up)", "refit copies (node 0)",
                                                   "checkpoint gather (node 0)") if k in it))


def estimate(spec: RunSpec, mamba: Optional[str] = None) -> Estimate:
    """The per-GPU budget of the plan's most loaded rank, every phase, and host RAM per node (`mamba`: count the torch
    backend's Mamba-2 layers on that path, memory_shapes.MAMBA_PATHS, instead of the planned one)."""
    c = spec.cluster
    est = Estimate(device_gib=c.gpu_memory_gib, use_gpus=c.gpus_per_node > 0)
    policy_estimate(spec, est, mamba)
    rollout_estimate(spec, est)
    host_estimate(spec, est)
    if est.use_gpus:
        nccl = layout_of(spec).world > 1 or spec.train.backend == TrainBackend.megatron or fsdp_sharded(spec)
        est.context_gib += CUDA_CONTEXT_GIB + (NCCL_GIB if nccl else 0)
        if spec.rollout.backend == RolloutBackend.vllm:  # the engine process: its context and more, beyond its budget
            est.context_gib += CUDA_CONTEXT_GIB if est.device_gib is None else VLLM_OUTSIDE_BUDGET_GIB
        if spec.model.path is None:  # models/tiny.py builds (and warms up) the model on the driver's GPU
            est.context_gib += DRIVER_CONTEXT_GIB
    est.totals = {p: phase_reserved(est, p) + engine_gib(est, p) + est.context_gib for p in est.phases}
    est.peak_phase = max(est.totals, key=lambda p: est.totals[p])
    est.peak_gib = est.totals[est.peak_phase]
    return est


def phase_reserved(est: Estimate, phase: str) -> float:
    """The policy's reserved GiB in a phase: allocated + ALLOCATOR_SLACK × its transient part over the resident.
    Through a rollout after the first step the policy holds what its optimizer step held (measured whole-GPU on an
    H200, benchmarks/results/memory.md: the refit's empty_cache does not give it back), so "generate" counts that."""
    held = est.phases["optimizer step"] if phase == "generate" and "optimizer step" in est.phases else est.phases[phase]
    return held + ALLOCATOR_SLACK * (held - est.phases["generate"])


def engine_gib(est: Estimate, phase: str) -> float:
    """What the colocated engine holds on the GPU during a policy phase (the module doc: sleep mode)."""
    if est.asleep_gib is None or phase == "generate":
        return est.rollout_gib
    return est.asleep_gib + (est.engine_weights_gib if phase == "refit" else 0.0)
