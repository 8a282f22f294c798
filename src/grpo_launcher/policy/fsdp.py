"""FSDP2 for train.backend=torch: shard a transformers causal LM over the data-parallel ranks.

`fully_shard` per decoder layer (the classes the model names in `_no_split_modules`), then the root (embedding,
final norm, output layer). Each rank holds 1/DP of the fp32 weights, gradients and AdamW state; a layer's full
weights exist only while it runs (all-gathered in the compute dtype, freed after its forward and backward).
Gradients are reduce-scattered in fp32 with SUM: every rank's loss already carries its share of the global
denominator (algos.local_denominator), so an update over W ranks equals the 1-rank update on the same batch.

The full weights are gathered for a refit (`full_weights`, every rank calls it) and for a checkpoint (rank 0
writes one HF directory and the full optimizer state: the same files as the unsharded path, so `launch.py
export` and a resume at another DP size read them as they are).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, CheckpointWrapper,
                                                                         apply_activation_checkpointing)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX as CHECKPOINT_PREFIX
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..models.attention import hf_attention
from ..models.rope import pin_longrope

FULL = StateDictOptions(full_state_dict=True)
FULL_ON_RANK0_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the other ranks get {}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the classes it lists in `_no_split_modules` (every HF model does), else the
    children of its longest nn.ModuleList. A block wrapped for activation checkpointing is found as its wrapper."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # pre-order: a wrapper comes before the block it wraps
        inner = m._checkpoint_wrapped_module if isinstance(m, CheckpointWrapper) else m
        if id(m) not in inside and type(inner).__name__ in names:
            found.append(m)
            inside.update(id(x) for x in m.modules())
    if found:
        return found
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best):
            best = list(m.children())
    return best


def checkpoint_layers(model: nn.Module) -> int:
    """train.activation_checkpointing: each decoder layer keeps only its input for the backward and recomputes
    the rest (torch's non-reentrant checkpoint wrapper; works in eval mode, unlike transformers' own switch,
    so dropout stays off). Parameter and state-dict names are unchanged. Returns the number of layers wrapped."""
    layers = {id(m) for m in decoder_layers(model)}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in layers,
                                   checkpoint_wrapper_fn=lambda m: CheckpointWrapper(
                                       m, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return len(layers)


def freeze_routers(model: nn.Module) -> list[str]:
    """train.moe.freeze_router: the MoE routers' parameters (modules named *Router, or a block's `gate`; not
    `gate_proj`) stop training. Returns their names; none found is an error (the key would do nothing)."""
    names = []
    for mod_name, mod in model.named_modules():
        if "Router" in type(mod).__name__ or mod_name.endswith(".gate"):
            for k, p in mod.named_parameters(recurse=False):
                p.requires_grad_(False)
                names.append(f"{mod_name}.{k}")
    if not names:
        raise ValueError(f"train.moe.freeze_router=true, but {type(model).__name__} has no router module")
    return names


def shard(model: nn.Module, bf16: bool, offload: bool = False) -> nn.Module:
    """fully_shard each decoder layer, then the root, in place (the default process group is the DP group).

    bf16: weights all-gathered and computed in bf16 (fp32 master shards, fp32 reduce-scatter); else fp32 throughout.
    offload: the shards, gradients and optimizer state live in host RAM (the optimizer step runs on the CPU).
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mp_policy": mp, **({"offload_policy": CPUOffloadPolicy()} if offload else {})}
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # SUM, not the mean over ranks (see the module doc) ...
            m.set_force_sum_reduction_for_comms(True)  # ... as a plain SUM (gloo has no PREMUL_SUM)
    if isinstance(model, FSDPModule) and hasattr(model, "set_reduce_scatter_unused_params"):  # torch >= 2.10
        model.set_reduce_scatter_unused_params(True)  # experts one rank routed nothing to: zeros, no mismatch
    return model


def load_model(model_dir: str, device: torch.device, sharded: bool, max_len: int) -> nn.Module:
    """The policy's HF model: loaded onto `device`, or (sharded) its modules on the meta device, no memory
    taken until `materialize` fills this rank's shards from rank 0's copy. Longrope is pinned for max_len (the
    engines' max model length: models/rope.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # here: the driver imports this module, not transformers

    attn = hf_attention(model_dir)  # eager where sdpa would drop Gemma-2's attention softcapping (models/attention.py)
    if not sharded:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **attn).to(device)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32, **attn)
    pin_longrope(model, max_len)
    return model


def materialize(models: list[nn.Module], model_dir: str, device: torch.device, max_len: int,
                offload: bool = False) -> None:
    """Sharded meta-device models -> real shards on `device`: rank 0 alone reads the weights (on the CPU), each
    rank receives its shards by broadcast (torch.distributed.checkpoint's broadcast_from_rank0); the buffers a
    state dict leaves out (rotary inverse frequencies, ...) are broadcast as rank 0's copy computed them.
    offload (CPUOffloadPolicy): the shards on the CPU, as FSDP2 requires; the buffers, which it does not manage,
    on `device`, where the layers compute."""
    from transformers import AutoModelForCausalLM  # (the same)

    lead = dist.get_rank() == 0
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if lead else None
    if full is not None:
        pin_longrope(full, max_len)  # its rotary buffers are every rank's (below)
    state = full.state_dict() if full is not None else {}
    buffers = dict(full.named_buffers()) if full is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for model in models:
        model.to_empty(device=torch.device("cpu") if offload else device)
        set_model_state_dict(model, dict(state), options=options)  # a copy: it puts shards in the dict it gets
        in_state = set(model.state_dict())
        for name, buf in model.named_buffers():
            name = name.replace(CHECKPOINT_PREFIX, "")
            if name not in in_state:
                if lead:
                    buf.copy_(buffers[name])
                dist.broadcast(buf, src=0)
        if offload:
            for m in model.modules():
                m._buffers.update({k: b.to(device) for k, b in m._buffers.items() if b is not None})


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def iter_full_weights(model: nn.Module, dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs, gathered one at a time as they are consumed (a collective: every rank
    iterates to the end), each cast to `dtype` and moved to `device` at once. A shard is cast before it is
    gathered: the full tensor exists only in `dtype` (an fp32 gather then a cast held 4 + 2 bytes a parameter of the
    largest tensor, beside the refit's buffer, where pre-flight's "refit gather" counts 2), and the gather moves
    half the bytes."""
    for k, v in model.state_dict().items():
        v = v.detach()
        cast = dtype if dtype is not None and v.is_floating_point() else None
        if isinstance(v, DTensor):
            yield k, (v.to(cast) if cast is not None else v).full_tensor().to(device=device)
        else:
            yield k, v.to(device=device, dtype=cast, copy=device is not None)


def full_weights(model: nn.Module, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """HF-named full weights on every rank (a collective), as `iter_full_weights` gathers them."""
    return dict(iter_full_weights(model, dtype, device))


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: the full weights on the CPU; the other ranks {} (a collective)."""
    return get_model_state_dict(model, options=FULL_ON_RANK0_CPU)


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter names (rank 0 full, on the CPU; others {}). The unsharded path
    writes the same layout, so a checkpoint resumes at any DP size."""
    if is_sharded(model):
        return get_optimizer_state_dict(model, opt, options=FULL_ON_RANK0_CPU)
    return get_optimizer_state_dict(model, opt)


def load_state(model: nn.Module, opt: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
               optim: Optional[dict[str, Any]]) -> None:
    """Full weights and full (name-keyed) optimizer state into a sharded or unsharded model; each rank keeps
    its shard. `optim` None: the weights only (the optimizer stays as built: fresh)."""
    if is_sharded(model):
        set_model_state_dict(model, weights, options=FULL)
        if optim is not None:
            set_optimizer_state_dict(model, opt, named_optimizer_state(model, optim), options=FULL)
        return
    model.load_state_dict(weights, strict=True)
    if optim is not None:
        set_optimizer_state_dict(model, opt, named_optimizer_state(model, optim))


def named_optimizer_state(model: nn.Module, optim: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state keyed by parameter names. Checkpoints written before FSDP2 hold torch's own layout
    (keyed by the index in model.parameters()): mapped to the names in that order."""
    if not optim.get("state") or not all(isinstance(k, int) for k in optim["state"]):
        return optim
    names = [n.replace(CHECKPOINT_PREFIX, "") for n, _ in model.named_parameters()]
    return {"state": {names[i]: v for i, v in optim["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]}


def save_hf(model: nn.Module, state: dict[str, torch.Tensor] | None, path: Path) -> None:
    """One HF directory (rank 0) from the full weights (None: the unsharded model's own); transformers names the
    FSDP class without its prefix in config.json."""
    save = getattr(model, "save_pretrained")
    save(path, **({"state_dict": state} if state is not None else {}))
