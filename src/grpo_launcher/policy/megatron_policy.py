"""train.backend=megatron: a megatron-core GPTModel (local layer spec, no Transformer Engine) per rank; for
model.family=nemotron_h its hybrid Mamba model (policy/megatron_hybrid.py, local spec too).

Same interface and the same math as TorchPolicyWorker (policy/__init__.py): losses use GLOBAL
denominators and gradients are SUMmed over data parallelism, so any TP/EP/DP layout gives the DP=1 update.

Layout. The driver starts one actor per device (ranks 0..world-1) and hands rank r the r-th equal
row shard of every batch. Ranks that form one model replica (the tensor-parallel group, TP·PP·CP ranks)
all-gather their shards, so each replica works on the union of its ranks' rows; every rank then
returns the results for its own rows. Expert parallelism is carved out of data parallelism
(megatron's order tp-cp-ep-dp-pp): EP ranks hold different experts and different rows.

Logprobs without whole logits (train.logprob_chunk_tokens > 0): GPTModel returns the final hidden states (its
post_process off: what a pipeline stage without the output layer returns), and the response positions' states go
through the output layer chunk by chunk with the torch backend's autograd Function (algos.linear_logprobs); for
TP > 1 its vocab-parallel form (each rank its V/TP rows; max and sums all-reduced over the TP group).
train.logprob_chunk_tokens=0: whole logits [B, L, V/TP], vocab-parallel for TP > 1 (megatron's vocab-parallel
cross entropy, entropy a vocab-parallel reduction); for TP = 1 the very functions of the torch backend (algos).

Weights come in from, and go out to, Hugging Face names (policy/megatron_convert.py): state_dict()
gathers the shards (a collective: every rank must call it; rank 0's result is the full HF dict).

Optimizer. On CPU (tests): torch AdamW over each rank's local shards with our own grad sync/clipping
(megatron's DDP and optimizer hard-code CUDA). On GPUs: megatron DDP + megatron optimizer (fp32 master
weights with bf16, distributed optimizer when train.distributed_optimizer).

CPU: megatron-core needs the patches in policy/megatron_cpu.py (tests and development only): GRPO_MEGATRON_CPU_SHIM=1.

Imports. megatron-core (~5 s) and transformers' AutoConfig are imported inside the functions that use them: the
driver imports this module to start its workers (policy_class) and stays light (tests/unit/test_lazy_engines.py),
and megatron-core's import-time notices are filtered first (quiet_megatron_notices, in __init__).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import re
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..algos import LossInputs, entropy_from_logits, local_denominator, spec_policy_loss, token_logprobs
from ..algos.linear_logprobs import linear_logprobs, vocab_parallel_linear_logprobs
from ..spec.schema import Precision, RunSpec
from ..batch import TrainBatch
from . import megatron_convert as mc, megatron_cpu, megatron_hybrid, microbatch
from .hybrid import HybridRollout
from .megatron_families import CPU_SHIM_ENV
from .megatron_pad_row import freeze_lookup_row, hf_padding_idx
from .profile import Profiling, profiled
from .update_log import Diverged, UpdateLog, finite_norm

# megatron-core announces at import what it falls back to without TE/Apex (its local/torch paths are our choice),
# and that the CUDA-graph scope default is deprecated (we capture no graphs): said once here, not in every log
MEGATRON_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "full scope is deprecated")


def quiet_megatron_notices() -> None:
    for text in MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)


def bound_fusion_compiles() -> None:
    """megatron-core wraps its small fusions (squared_relu, bias-dropout-add, SwiGLU, router helpers) in torch.compile
    (megatron.core.jit.jit_fuser). GRPO batches change length every micro-batch, and the logprob pass runs without
    grad, so dynamo recompiled each fusion up to its limit of 8. On an H200 a 1.1B nemotron_h update took 167 s a
    step, and step 1 took 274 s (benchmarks/results/nemotron_gpu.md, 2026-12-06). Here each fusion compiles at most
    twice: once for the logprob pass and once for the update, each for every length (dynamic shapes from the first
    call). A call that would compile again (another stride or rank) runs eagerly and gives the same values. The
    setting is global to the process. That is one worker, and nothing else in it compiles."""
    torch._dynamo.config.assume_static_by_default = False
    torch._dynamo.config.recompile_limit = 2
    logging.getLogger("torch._dynamo.convert_frame").addFilter(_quiet_recompile_limit)  # once: the same function


def _quiet_recompile_limit(record: logging.LogRecord) -> bool:
    """dynamo's "hit recompile_limit" warning: the eager fallback bound_fusion_compiles sets up is the intent."""
    return "recompile_limit" not in record.getMessage()


def _load_cpu_shim():
    if not os.environ.get(CPU_SHIM_ENV):
        raise RuntimeError(
            "train.backend=megatron without a GPU: megatron-core hard-codes CUDA. For CPU tests set "
            f"{CPU_SHIM_ENV}=1 (policy/megatron_cpu.py, tests and development only), or run on GPUs.")
    megatron_cpu.install()
    return megatron_cpu


# ------------------------------------------------------------------------------ model building


def sdpa_attention_class():
    """megatron's local DotProductAttention with torch SDPA inside (flash / memory-efficient kernels)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # lazy: see Imports above

    class SDPAAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_):
            # query [s, b, n, d]; key/value [s, b, g, d] (g query groups, not repeated)
            assert packed_seq_params is None and attention_bias is None, "SDPA core attention: no packing/bias"
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale,
                dropout_p=self.attention_dropout.p if self.training else 0.0, enable_gqa=q.size(1) != k.size(1))
            return o.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)  # [s, b, n·d]

    return SDPAAttention


def transformer_config(arch: mc.Arch, spec: RunSpec, *, use_cpu_init: bool, fused: bool = False,
                       dispatcher: Optional[str] = None, mamba_mem_eff: bool = False):
    """Arch + train.* → megatron-core TransformerConfig (no TE kernels). fused: megatron-core's fusions that need
    neither Transformer Engine nor Apex, its torch.compile'd SwiGLU (the backward recomputes the activation from
    the saved input) and residual add; its RoPE fusion needs TE, its persistent norm and masked-softmax kernels
    Apex (and SDPA does the softmax): those stay off."""
    from megatron.core.transformer import TransformerConfig  # lazy: see Imports above

    t = spec.train
    bf16 = t.precision == Precision.bfloat16 and spec.cluster.gpus_per_node > 0  # CPU: fp32, as the torch backend
    dtype = torch.bfloat16 if bf16 else torch.float32
    kw = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=t.tensor_parallel_size, pipeline_model_parallel_size=t.pipeline_parallel_size,
        context_parallel_size=t.context_parallel_size, expert_model_parallel_size=t.expert_parallel_size,
        expert_tensor_parallel_size=t.expert_tensor_parallel_size, sequence_parallel=t.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, use_cpu_initialization=use_cpu_init,
        # kept on although every weight is loaded right after: with it off megatron also skips setting the
        # tensor_model_parallel attributes its grad-norm/clipping code reads
        bias_activation_fusion=fused, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=fused,
        calculate_per_token_loss=True)  # megatron DDP then SUMs grads over DP (our global denominators)
    if t.activation_checkpointing:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if arch.num_experts:
        kw.update(moe_kwargs(arch, spec, dispatcher))
    if arch.mamba is not None:
        kw.update(megatron_hybrid.config_kwargs(arch, mem_eff=mamba_mem_eff))
        if arch.num_experts:
            kw.update(megatron_hybrid.moe_kwargs(arch))
    return TransformerConfig(**kw)


def moe_kwargs(arch: mc.Arch, spec: RunSpec, dispatcher: Optional[str] = None) -> dict:
    """MoESpec (the seed recipe's settings) → TransformerConfig's moe_* fields (`dispatcher`: the worker's own choice
    in place of train.moe.token_dispatcher, see MegatronPolicyWorker)."""
    m = spec.train.moe
    return dict(
        num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_top_k,
        # HF Qwen3-MoE: softmax over all experts, then top-k, renormalised only with norm_topk_prob
        moe_router_pre_softmax=not arch.moe_norm_topk_prob, moe_router_score_function="softmax",
        moe_router_dtype="fp32" if m.router_dtype == Precision.float32 else None,
        moe_router_load_balancing_type=m.load_balancing_type, moe_aux_loss_coeff=m.aux_loss_coeff,
        moe_token_dispatcher_type=dispatcher or m.token_dispatcher, moe_grouped_gemm=False, moe_permute_fusion=False)


def build_model(arch: mc.Arch, spec: RunSpec, *, pre_process: bool = True, post_process: bool = True,
                use_cpu_init: bool = True, fused: bool = False, dispatcher: Optional[str] = None,
                mamba_mem_eff: bool = False):
    """The rank's megatron-core model: GPTModel, or for nemotron_h the hybrid Mamba model (megatron_hybrid.py)."""
    cfg = transformer_config(arch, spec, use_cpu_init=use_cpu_init, fused=fused, dispatcher=dispatcher,
                             mamba_mem_eff=mamba_mem_eff)
    core = sdpa_attention_class() if spec.train.core_attention == "sdpa" else None
    if arch.mamba is not None:
        model = megatron_hybrid.build_hybrid(arch, cfg, pre_process=pre_process, post_process=post_process,
                                             core_attention=core)
    else:
        model = build_gpt(arch, cfg, pre_process=pre_process, post_process=post_process, core_attention=core)
    if spec.train.moe.freeze_router:
        for name, p in model.named_parameters():
            if ".router." in name:
                p.requires_grad_(False)
    unscale_router_losses(model)
    return model


def unscale_router_losses(model: torch.nn.Module) -> None:
    """calculate_per_token_loss (set for our DDP's sum over replicas) also has megatron's routers multiply their
    balancing and z-losses by the micro-batch's token count, for a finalize_model_grads(num_tokens) that divides every
    gradient by the step's tokens. Ours never divides (the policy loss comes scaled by its global denominator), so
    the routers keep their losses as defined and each micro-step weighs them by its share (scale_router_losses).
    Before: tokens-per-micro-batch x micro-batches times train.moe.aux_loss_coeff."""
    from megatron.core.transformer.moe.router import Router  # lazy: see Imports above

    for m in model.modules():
        if isinstance(m, Router):
            m.calculate_per_token_loss = False


def scale_router_losses(share: float, device: torch.device) -> None:
    """The weight of the routers' losses in this micro-step's backward: its share of the step's loss, as the policy
    loss's (the shares of a step's micro-batches over every replica sum to 1: the step's share-weighted mean)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # lazy: see Imports above

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(share, dtype=torch.float32, device=device))


def build_gpt(arch: mc.Arch, cfg, *, pre_process: bool, post_process: bool, core_attention: Optional[type]):
    from megatron.core.models.gpt import GPTModel  # lazy: see Imports above
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # lazy: see Imports above

    layer_spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                          qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if core_attention is not None:
        layer_spec.submodules.self_attention.submodules.core_attention = core_attention
    return GPTModel(
        config=cfg, transformer_layer_spec=layer_spec, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_embeddings, position_embedding_type="rope",
        rotary_base=arch.rope_theta, rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0)


def load_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


# ------------------------------------------------------------------------------ the worker


class MegatronPolicyWorker(HybridRollout, Profiling):
    def __init__(self, spec: RunSpec, model_dir: str, rank: int, world: int, threads: int = 1):
        self.startup_marks = [("imports", time.time())]  # (phase, its end): the driver's start-up line (train/startup.py)
        from transformers import AutoConfig  # lazy: see Imports above

        self.startup_marks.append(("transformers", time.time()))
        quiet_megatron_notices()
        bound_fusion_compiles()
        torch.set_num_threads(threads)
        self.spec, self.model_dir, self.rank, self.world = spec, str(model_dir), rank, world
        self.arch = mc.arch_from_hf_config(AutoConfig.from_pretrained(model_dir))
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.shim = None if self.cuda else _load_cpu_shim()
        self.startup_marks.append(("device", time.time()))  # CUDA's initialisation (CPU: megatron's shim); the model
        # is built after the process group (init_distributed): the line's `process group` phase
        # the alltoall dispatcher creates a CUDA stream; on CPU the allgather one computes the same layer (derived
        # here, beside the spec: the spec stays the one pre-flight validated, spec/resolve.py)
        cpu_moe = not self.cuda and self.arch.num_experts and spec.train.moe.token_dispatcher == "alltoall"
        self.dispatcher: Optional[str] = "allgather" if cpu_moe else None
        self.steps = 0
        # train.dynamic_batching: token-budget micro-batches cut to their own longest row (policy/microbatch.py);
        # with EP > 1 the ranks of an expert group hold different rows and megatron's allgather dispatcher needs the
        # same shapes on each: fixed row counts at the batch's length there; Mamba-2 layers count rows in whole
        # chunks (their scan's unit)
        on = spec.train.dynamic_batching and spec.train.expert_parallel_size == 1
        self.token_budget, self.cut = on, on
        self.granule = self.arch.mamba.chunk_size if self.arch.mamba else 1
        self.width_multiple = microbatch.WIDTH_MULTIPLE if self.cuda else 1  # (microbatch.widened)

    # ------------------------------------------------------------------ distributed set-up
    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_distributed(self, host: str, port: int) -> None:
        from megatron.core import parallel_state as ps  # lazy: see Imports above
        from megatron.core import tensor_parallel  # lazy: see Imports above

        t = self.spec.train
        if t.pipeline_parallel_size > 1:
            raise NotImplementedError("train.backend=megatron: pipeline parallelism is not wired yet (PP=1)")
        if t.context_parallel_size > 1 or t.sequence_parallel:
            raise NotImplementedError("context/sequence parallelism need Transformer Engine (not available)")
        # the collective timeout matches the driver's deadlines (train/workers.py): deadlines.first_s; unset
        # (deadlines off): the defaults
        limit = os.environ.get("GRPO_COLLECTIVE_TIMEOUT_S")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.cuda else "gloo", init_method=f"tcp://{host}:{port}",
                                    rank=self.rank, world_size=self.world,
                                    timeout=timedelta(seconds=float(limit)) if limit else None)
        ps.initialize_model_parallel(distributed_timeout_minutes=max(1, -(-int(float(limit or 1800)) // 60)),
                                     tensor_model_parallel_size=t.tensor_parallel_size,
                                     pipeline_model_parallel_size=t.pipeline_parallel_size,
                                     context_parallel_size=t.context_parallel_size,
                                     expert_model_parallel_size=t.expert_parallel_size,
                                     expert_tensor_parallel_size=t.expert_tensor_parallel_size)
        seed = self.spec.grpo.seed
        if self.cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            self.shim.after_parallel_init()
        torch.manual_seed(seed + ps.get_data_parallel_rank())
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), t.tensor_parallel_size
        self.ep_rank, self.ep_size = ps.get_expert_model_parallel_rank(), t.expert_parallel_size
        self.mp_group = ps.get_model_parallel_group()
        self.mp_ranks = dist.get_process_group_ranks(self.mp_group)  # global ranks of my replica, in order
        self.layer_offset = 0
        self.expert_offset = self.ep_rank * (self.arch.num_experts // self.ep_size) if self.arch.num_experts else 0

        full = mc.to_full(load_hf_weights(self.model_dir), self.arch)
        self.model = self._build_and_load(full)
        freeze_lookup_row(self.model, hf_padding_idx(self.model_dir))  # as the HF model's nn.Embedding(padding_idx)
        self.ref = None
        if self.spec.loss.kl_coef > 0:
            self.ref = self._build_and_load(full).eval().requires_grad_(False)
        del full
        self._build_optimizer()
        self.init_engine()  # rollout=hf: an HF copy on this device, refit from the gathered weights

    def _build_and_load(self, full: dict[str, torch.Tensor]):
        # train.fused_kernels: null = on with CUDA (megatron-core's own fusions, no Liger); always off on CPU
        fused = self.cuda and self.spec.train.fused_kernels is not False
        mem_eff = False
        if self.arch.mamba is not None and self.cuda:  # fused split-conv1d-scan where causal-conv1d imports
            mem_eff = megatron_hybrid.mem_eff_path_available()
        model = build_model(self.arch, self.spec, use_cpu_init=not self.cuda, fused=fused, dispatcher=self.dispatcher,
                            mamba_mem_eff=mem_eff)
        mc.load_local(model, full, tp_rank=self.tp_rank, tp_size=self.tp_size,
                      layer_offset=self.layer_offset, expert_offset=self.expert_offset,
                      tie=self.arch.tie_embeddings)
        return model.to(self.device)

    def _build_optimizer(self) -> None:
        t = self.spec.train
        self.megatron_opt = self.cuda
        if self.megatron_opt:
            from megatron.core.distributed import (  # lazy: see Imports above
                DistributedDataParallel, DistributedDataParallelConfig)
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lazy: see Imports above

            ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                    use_distributed_optimizer=t.distributed_optimizer,
                                                    check_for_nan_in_grad=True)  # raises before the step
            self.model = DistributedDataParallel(self.model.config, ddp_cfg, self.model)
            bf16 = t.precision == Precision.bfloat16
            self.opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, bf16=bf16, params_dtype=torch.float32,
                clip_grad=t.max_grad_norm, use_distributed_optimizer=t.distributed_optimizer,
                adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8), [self.model])
        else:
            if t.distributed_optimizer:
                raise NotImplementedError("train.distributed_optimizer needs GPUs (megatron's optimizer)")
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        self._set_lr()

    def _lr(self) -> float:
        warm = max(1, self.spec.train.warmup_steps)
        return self.spec.train.lr * min(1.0, (self.steps + 1) / warm)  # = TorchPolicyWorker's LambdaLR

    def _set_lr(self) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self._lr()

    # ------------------------------------------------------------------ replica batches
    def _replica_batch(self, b: TrainBatch) -> tuple[TrainBatch, slice]:
        """All-gather the row shards of my model-parallel group; (their union, my rows in it)."""
        n = len(self.mp_ranks)
        if n == 1:
            return b, slice(0, len(b))
        parts: list = [None] * n
        dist.all_gather_object(parts, b, group=self.mp_group)
        me = self.mp_ranks.index(self.rank)
        start = sum(len(p) for p in parts[:me])
        fields = {}
        for f in b.__dataclass_fields__:
            vals = [getattr(p, f) for p in parts]
            fields[f] = None if vals[0] is None else torch.cat(vals)
        return TrainBatch(**fields), slice(start, start + len(b))

    # ------------------------------------------------------------------ forward pieces
    def _token_stats(self, model, b: TrainBatch, entropy: bool = False
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logprobs [B, T], entropy [B, T] or None) of the response tokens at the sampling temperature: chunks of
        the output layer (train.logprob_chunk_tokens > 0), else whole logits."""
        chunk, temp = self.spec.train.logprob_chunk_tokens, self.spec.rollout.temperature
        if not chunk:
            logits = self._logits(model, b)
            return self._token_logprobs(logits, b.response_ids), (self._entropy(logits) if entropy else None)
        hidden, weight = self._response_hidden(model, b)  # [B, T, H], [V/TP, H]
        tokens = b.response_ids.to(self.device)
        if self.tp_size == 1:
            lp, ent = linear_logprobs(hidden.flatten(0, 1), weight, tokens.flatten(), temperature=temp, chunk=chunk)
        else:
            from megatron.core import parallel_state as ps  # lazy: see Imports above

            lp, ent = vocab_parallel_linear_logprobs(
                hidden.flatten(0, 1), weight, tokens.flatten(), group=ps.get_tensor_model_parallel_group(),
                vocab_start=self.tp_rank * weight.shape[0], temperature=temp, chunk=chunk)  # [B·T] each
        return lp.view(tokens.shape), (ent.view(tokens.shape) if entropy else None)

    def _positions(self, b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids [B, L], position ids [B, L], idx [B, T]): idx[i, t] is the position predicting response token t."""
        ids = b.input_ids.to(self.device)
        B, L = ids.shape
        pos = torch.arange(L, device=self.device)[None].expand(B, L)
        T = b.response_ids.shape[1]
        idx = (b.prompt_lens[:, None] - 1 + torch.arange(T)[None, :]).clamp(max=L - 1).to(self.device)
        return ids, pos, idx

    def _response_hidden(self, model, b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [B, T, H] at the response-predicting positions, the output layer's weight [V/TP, H]:
        this rank's vocabulary rows). Without sequence parallelism every TP rank holds the whole hidden states."""
        gpt = getattr(model, "module", model)  # megatron's DDP wraps the policy on GPUs
        ids, pos, idx = self._positions(b)
        gpt.post_process = False  # GPTModel returns the decoder's output (final norm applied), no output layer
        try:
            hidden = model(ids, pos, None)  # [L, B, H]; causal attention, right padding never seen
        finally:
            gpt.post_process = True
        rows = torch.arange(ids.shape[0], device=self.device)[:, None]  # [B, 1]
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else gpt.output_layer.weight
        return hidden[idx, rows], weight  # indexing saves no [L, B, H] copy for the backward

    def _logits(self, model, b: TrainBatch) -> torch.Tensor:
        """Response logits [B, T, V/TP] (this rank's vocab shard), divided by the sampling temperature."""
        ids, pos, idx = self._positions(b)
        logits = model(ids, pos, None)  # [B, L, V/TP]; causal attention, right padding never seen
        B, T = idx.shape
        out = logits.gather(1, idx[:, :, None].expand(B, T, logits.shape[-1]))
        return out / self.spec.rollout.temperature

    def _token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device)
        if self.tp_size == 1:
            return token_logprobs(logits, tokens)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # lazy: see Imports above

        return -vocab_parallel_cross_entropy(logits.float().clone(), tokens)  # [B, T] float32

    @torch.no_grad()
    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return entropy_from_logits(logits)
        from megatron.core import parallel_state as ps  # lazy: see Imports above

        g = ps.get_tensor_model_parallel_group()
        x = logits.float()
        m = x.amax(-1, keepdim=True)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=g)
        e = (x - m).exp()
        z = e.sum(-1, keepdim=True)
        dist.all_reduce(z, group=g)
        logp = x - m - z.log()
        h = -(e / z * logp.clamp(min=torch.finfo(x.dtype).min)).sum(-1)
        dist.all_reduce(h, group=g)
        return h

    # ------------------------------------------------------------------ logprobs
    @torch.no_grad()
    @profiled("logprobs")
    def logprobs(self, b: TrainBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(prev_logprobs [B, T], ref_logprobs [B, T] or None) for this rank's rows (CPU tensors)."""
        full, mine = self._replica_batch(b)
        self.model.eval()
        prev, ref = [], []
        groups = self._micro_batches(full, self.spec.train.logprob_batch_size)
        for g in groups:
            mb = microbatch.take(full, g, self.cut, self.width_multiple)
            prev.append(self._token_stats(self.model, mb)[0].cpu())
            if self.ref is not None:
                ref.append(self._token_stats(self.ref, mb)[0].cpu())
        self.model.train()
        n, T = len(full), full.response_ids.shape[1]
        prev_t = microbatch.restore(prev, groups, n, T)[mine]
        return prev_t, (microbatch.restore(ref, groups, n, T)[mine] if ref else None)

    def _micro_batches(self, b: TrainBatch, rows: int) -> microbatch.Groups:
        """The row indices of each micro-batch: within a token budget of `rows` full-length rows
        (policy/microbatch.py), or fixed counts of `rows` (self.token_budget off). The ranks of a replica hold the
        same rows and so the same micro-batches; data-parallel replicas reduce gradients once per step."""
        if not self.token_budget:
            return microbatch.fixed(len(b), rows)
        lengths, responses = microbatch.lengths_of(b)
        longest = max(self.spec.train.max_total_sequence_length, b.input_ids.shape[1])
        return microbatch.plan(lengths, responses, rows, longest,
                               max(self.spec.rollout.max_new_tokens, b.response_ids.shape[1]), self.granule)

    # ------------------------------------------------------------------ update
    @profiled("update")
    def update(self, minibatches: list[TrainBatch], denominators: list[float]) -> dict[str, Any]:
        """One optimizer step per minibatch; denominators are global per minibatch (as the torch backend:
        0 = no loss-bearing sample, no step; on-policy minibatches return their old logprobs)."""
        log = UpdateLog()
        reporter = self.mp_ranks.index(self.rank) == 0  # one rank per replica reports (the driver sums ranks)
        on_policy = minibatches[0].prev_logprobs is None
        for b, den in zip(minibatches, denominators):
            if den <= 0:
                log.skipped += 1
                if on_policy:
                    prev, ref = self.logprobs(b)  # collective over my model-parallel group, as the update
                    log.prev.append(prev)
                    log.ref.extend([ref] if ref is not None else [])
                continue
            b, mine = self._replica_batch(b)
            self._zero_grad()
            lps, refs = [], []
            groups = self._micro_batches(b, self.spec.train.micro_batch_size)
            for g in groups:
                mb = microbatch.take(b, g, self.cut, self.width_multiple)
                if on_policy and self.ref is not None:
                    with torch.no_grad():
                        mb = mb.with_(ref_logprobs=self._token_stats(self.ref, mb)[0])
                    refs.append(mb.ref_logprobs.cpu())
                metrics, weight, lp = self._micro_step(mb, den)
                lps.append(lp)
                log.parts.append((metrics, weight if reporter else 0.0))  # the same keys on every rank
            log.grad_norms.append(self._step())
            n, T = len(b), b.response_ids.shape[1]
            log.prev.append(microbatch.restore(lps, groups, n, T)[mine])
            log.ref.extend([microbatch.restore(refs, groups, n, T)[mine]] if refs else [])
        out = log.result(getattr(self, "_lr_used", self._lr()), on_policy)  # its memory figures: before the release
        if torch.cuda.is_available():  # the update's cached blocks back to the device: the next rollout and refit
            torch.cuda.empty_cache()  # reused none of them (nemotron_h_1b, H100: +5.7 GiB from the end of the first
        return out  # update to the second rollout, 12.8 % over the prediction; benchmarks/results/nemotron_gpu.md)

    def _micro_step(self, mb: TrainBatch, den: float) -> tuple[dict[str, float], float, torch.Tensor]:
        lo = self.spec.loss
        lp, ent_tok = self._token_stats(self.model, mb, entropy=True)
        old = lp.detach() if mb.prev_logprobs is None else mb.prev_logprobs
        x = LossInputs.of(mb, old).to(self.device)
        loss, _, m = spec_policy_loss(lp, x, lo, norm_len=self.spec.rollout.max_new_tokens, entropy=ent_tok)
        share = local_denominator(lo.aggregation, x.effective_mask) / den
        if self.arch.num_experts:
            scale_router_losses(share, self.device)
        (loss * share).backward()
        return {"loss": float(loss.detach()), **m}, float(share), old.detach().cpu()

    def _zero_grad(self) -> None:
        if self.megatron_opt:
            self.model.zero_grad_buffer()
        self.opt.zero_grad()

    def _step(self) -> float:
        self._set_lr()
        self._lr_used = self._lr()
        if self.megatron_opt:
            from megatron.core.distributed import finalize_model_grads  # lazy: see Imports above

            try:
                finalize_model_grads([self.model])  # check_for_nan_in_grad: megatron's RuntimeError on NaN/inf
            except RuntimeError as exc:
                if "found NaN" not in str(exc) and "found Inf" not in str(exc):
                    raise
                raise Diverged(f"megatron found non-finite gradients ({exc}): the optimizer step was not "
                               "taken; see train/loss and train/grad_norm of the last steps") from None
            ok, grad_norm, _ = self.opt.step()
            if not ok:
                raise Diverged("megatron's optimizer skipped its step (non-finite gradients)")
        else:
            grad_norm = finite_norm(self._sync_and_clip())
            self.opt.step()
        self.steps += 1
        return float(grad_norm)

    def _sync_and_clip(self) -> float:
        """CPU path: SUM grads over data parallelism, clip by the global norm over all shards."""
        from megatron.core import parallel_state as ps  # lazy: see Imports above

        named = [(mc.local_to_global(n, 0, 0), p) for n, p in self.model.named_parameters() if p.grad is not None]
        params = [p for _, p in named]
        dense = [p for _, p in named if getattr(p, "allreduce", True)]
        experts = [p for _, p in named if not getattr(p, "allreduce", True)]
        # counted once over TP: shards on every rank, replicated tensors on TP rank 0 (our mapping knows which
        # are sharded; megatron's tensor_model_parallel attribute is unset when perform_initialization=False)
        counted = {id(p) for n, p in named if self.tp_rank == 0 or mc.tp_kind(n) is not None}
        if ps.get_data_parallel_world_size() > 1:
            for p in dense:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        if experts and ps.get_expert_data_parallel_world_size() > 1:
            for p in experts:
                dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
        sq = torch.zeros(2, dtype=torch.float64)
        for p in dense:
            if id(p) in counted:
                sq[0] += p.grad.double().square().sum().cpu()
        for p in experts:
            sq[1] += p.grad.double().square().sum().cpu()
        dense_sq, expert_sq = sq[0:1].clone(), sq[1:2].clone()
        if len(self.mp_ranks) > 1:
            dist.all_reduce(dense_sq, group=self.mp_group)
        if ps.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
        norm = float((dense_sq + expert_sq).sqrt())
        coef = self.spec.train.max_grad_norm / (norm + 1e-6)  # = torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    # ------------------------------------------------------------------ weights
    def _megatron_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (and the buffers that are HF weights) under full-form (global) names, TP-sharded."""
        named = {**dict(self.model.named_parameters()), **mc.mapped_buffers(self.model)}
        return {mc.local_to_global(n, self.layer_offset, self.expert_offset): p.detach() for n, p in named.items()}

    def full_state(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Full-form megatron weights, gathered over TP and EP (collective). CPU tensors unless on_device."""
        from megatron.core import parallel_state as ps  # lazy: see Imports above

        local = self._megatron_params()
        out: dict[str, torch.Tensor] = {}
        tp_group = ps.get_tensor_model_parallel_group()
        for name, w in local.items():
            if self.tp_size > 1 and mc.tp_kind(name) is not None and ".local_experts." not in name:
                parts = [torch.empty_like(w) for _ in range(self.tp_size)]
                dist.all_gather(parts, w.contiguous(), group=tp_group)
                w = mc.unshard(name, parts)
            out[name] = w if on_device else w.cpu()
        if self.ep_size > 1:
            experts = {k: v for k, v in out.items() if ".local_experts." in k}
            by_rank: list = [None] * self.ep_size
            dist.all_gather_object(by_rank, experts, group=ps.get_expert_model_parallel_group())
            for p in by_rank:
                out.update(p)
        if self.arch.tie_embeddings:
            out.pop("output_layer.weight", None)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (refit source) on rank 0, {} on the others.

        Collective when the model is sharded (TP/EP > 1): every rank must call it (see the driver diff).
        """
        full = self.full_state()
        return mc.to_hf(full, self.arch) if self.rank == 0 else {}

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on this device, on every rank (collective): the hybrid engine's refit."""
        return mc.to_hf(self.full_state(on_device=True), self.arch)

    def weight_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The refit's pairs, one layer's converted copies at a time (mc.iter_hf): what pre-flight's "refit gather"
        counts, where hf_weights would hold a second copy of every expert at once."""
        return mc.iter_hf(self.full_state(on_device=True), self.arch)

    def save(self, directory: str) -> None:
        """Every rank: its optimizer state; rank 0: HF weights (policy/model.safetensors + config)."""

        path = Path(directory)
        hf = mc.to_hf(self.full_state(), self.arch, per_expert=True)  # collective; checkpoint layout
        if self.rank == 0:
            (path / "policy").mkdir(parents=True, exist_ok=True)
            seen: dict[int, str] = {}
            tensors = {}
            for k, v in hf.items():  # tied: one storage under two names → save a copy
                tensors[k] = v.clone() if id(v) in seen else v.contiguous()
                seen[id(v)] = k
            save_file(tensors, str(path / "policy" / "model.safetensors"), metadata={"format": "pt"})
            for name in ("config.json", "generation_config.json"):
                if (Path(self.model_dir) / name).exists():
                    shutil.copy(Path(self.model_dir) / name, path / "policy" / name)
        if self.megatron_opt and self.spec.train.distributed_optimizer:
            state = {"steps": self.steps, "opt": None}  # sharded optimizer state: not saved (see report)
        else:
            state = {"steps": self.steps, "opt": self.opt.state_dict()}
        torch.save(state, path / f"megatron_optim_rank{self.rank}.pt")
        if self.rank == 0:
            with open(path / "megatron_layout.json", "w") as layout:
                json.dump({"world": self.world, "tp": self.tp_size, "ep": self.ep_size}, layout)
        for f in path.rglob("*"):
            if f.is_file() and (f.name.endswith(f"rank{self.rank}.pt") or self.rank == 0):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())

    def load(self, directory: str) -> None:
        path = Path(directory)
        full = mc.to_full(load_hf_weights(path / "policy"), self.arch)
        module = self.model.module if self.megatron_opt else self.model
        mc.load_local(module, full, tp_rank=self.tp_rank, tp_size=self.tp_size, layer_offset=self.layer_offset,
                      expert_offset=self.expert_offset, tie=self.arch.tie_embeddings)
        optim = path / f"megatron_optim_rank{self.rank}.pt"  # absent in a checkpoint older than the newest:
        fresh: dict[str, Any] = {"steps": 0, "opt": None}  # a fresh optimizer and warm-up (the driver says so)
        state = torch.load(optim, weights_only=True) if optim.is_file() else fresh  # no code runs
        self.steps = state["steps"]
        if state["opt"] is not None:
            self.opt.load_state_dict(state["opt"])
        for g in self.opt.param_groups:  # the loaded state's weight decay: this spec's wins (lr: _set_lr below)
            g["weight_decay"] = self.spec.train.weight_decay
        if self.megatron_opt and hasattr(self.opt, "reload_model_params"):
            self.opt.reload_model_params()  # fp32 master copies ← the loaded weights
        self._set_lr()

    def ping(self) -> float:
        return time.time()


if TYPE_CHECKING:  # mypy holds the class to the contract the driver calls (interfaces.py)
    from ..interfaces import PolicyWorker

    _contract: type[PolicyWorker] = MegatronPolicyWorker
