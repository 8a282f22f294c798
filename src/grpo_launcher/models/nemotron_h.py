"""model.family=nemotron_h built here (no hub): Nemotron 3 Nano's shape at any size, for model.path=null.

The layer kinds follow Nano's hybrid pattern (Mamba-2 `M`, MoE `E`, attention `*`), cut to model.num_layers;
the MoE layers route top-k of model.num_experts sigmoid-scored experts plus one shared expert of twice the
expert width (Nano: 1856 / 3712); the Mamba-2 mixer has expand 2, Nano's 8 groups where the width allows.
transformers' pure-torch path runs it on CPU; on GPUs mamba-ssm's Triton kernels when they import (`mamba_path`).

Imports. torch and transformers inside the functions that use them: pre-flight imports this module (its rules and
memory model read the shapes here) and imports neither (tests/unit/test_preflight_light.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from ..logit_heads import read_text_config
from ..spec.model_dir import model_facts
from ..spec.schema import ModelSpec, RunSpec, TrainBackend
from ..spec.versions import node_packages_decide

# NVIDIA-Nemotron-3-Nano-30B-A3B's hybrid_override_pattern: 23 Mamba-2, 23 MoE, 6 attention layers
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
KINDS = {"M": "mamba", "E": "moe", "*": "attention"}


def layer_pattern(num_layers: int) -> str:
    """Nano's pattern cut to num_layers (repeated past 52)."""
    return "".join(NANO_PATTERN[i % len(NANO_PATTERN)] for i in range(num_layers))


def layer_kinds(num_layers: int) -> list[str]:
    return [KINDS[c] for c in layer_pattern(num_layers)]


def moe_layers(spec: ModelSpec) -> bool:
    """The model has MoE layers: num_experts > 0 and, for nemotron_h, an `E` in its layer pattern (config.json's
    hybrid_override_pattern or layers_block_type; the one built here for model.path=null)."""
    if spec.num_experts <= 0:
        return False
    if spec.family != "nemotron_h":
        return True
    if spec.path is None:
        return "E" in layer_pattern(spec.num_layers)
    cfg = read_text_config(spec.path) or {}
    layers = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type")
    return layers is None or any(kind in ("E", "moe") for kind in layers)


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
    import torch  # lazy: see Imports above
    from transformers import NemotronHConfig, NemotronHForCausalLM  # lazy: see Imports above

    torch.manual_seed(seed)
    cfg = NemotronHConfig(**nemotron_h_config(spec, max(spec.vocab_size, len(tokenizer)), tokenizer.eos_token_id,
                                              tokenizer.pad_token_id))
    with torch.device(device):
        model = NemotronHForCausalLM(cfg).to(torch.float32)
    bind_mamba_kernels(model, on_cuda=device.startswith("cuda"))  # its warm start trains on the workers' path
    return model


def memory_layout(spec: ModelSpec) -> dict[str, Any]:
    """The layer counts and Mamba / expert sizes of the model built here, as preflight/memory_shapes.py's
    HYBRID_LAYOUTS."""
    cfg = nemotron_h_config(spec, spec.vocab_size, 2, 0)
    kinds = layer_kinds(spec.num_layers)
    return dict(attention=kinds.count("attention"), mlp=0, moe=kinds.count("moe"), mamba=kinds.count("mamba"),
                gated=False, shared_ffn=cfg["moe_shared_expert_intermediate_size"], head_dim=cfg["head_dim"],
                mamba_heads=cfg["mamba_num_heads"], mamba_head_dim=cfg["mamba_head_dim"], groups=cfg["n_groups"],
                state=cfg["ssm_state_size"], conv=cfg["conv_kernel"], chunk=cfg["chunk_size"])


# transformers 5.17-5.19's modeling_nemotron_h.py: each Mamba-2 function below is bound ONCE, when that module is
# imported (integrations/hub_kernels.py use_kernel_func_from_hub_with_fallback): the package's kernel when
# `import <package>` and the attribute lookup succeed, else the function's torch reference (the one
# `inspect.unwrap` returns). No device, version or train-mode check there. The mixer's forward then calls, in
# train mode without a cache, mamba2_split_conv1d_scan_combined first (its torch reference returns None: fall
# through), else causal_conv1d_fn + mamba2_chunk_scan; generating, causal_conv1d_update + selective_state_update.
MAMBA_FUNCTIONS = {  # modeling_nemotron_h name -> (package, the kernel's module path inside it)
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update"),
    "mamba2_split_conv1d_scan_combined": ("mamba_ssm", "ops.triton.ssd_combined.mamba_split_conv1d_scan_combined"),
    "mamba2_selective_state_update": ("mamba_ssm", "ops.triton.selective_state_update.selective_state_update"),
    "mamba2_chunk_scan": ("mamba_ssm", "ops.triton.ssd_combined.mamba_chunk_scan_combined"),
}
# mamba-ssm's fused split-conv1d-scan calls causal-conv1d's own functions, which it binds to None when
# causal-conv1d does not import: with mamba-ssm alone, train mode would fail inside it ('NoneType' is not callable)
FUSED = "mamba2_split_conv1d_scan_combined"


def mamba_kernels(mamba_ssm: bool, causal_conv1d: bool, on_cuda: bool) -> dict[str, bool]:
    """modeling_nemotron_h function -> True where the torch backend runs the package's kernel (`bind_mamba_kernels`
    makes it so), False where the torch reference: kernels on CUDA only, the fused path only with both packages."""
    have = {"mamba_ssm": mamba_ssm and on_cuda, "causal_conv1d": causal_conv1d and on_cuda}
    kernels = {name: have[package] for name, (package, _) in MAMBA_FUNCTIONS.items()}
    kernels[FUSED] = have["mamba_ssm"] and have["causal_conv1d"]
    return kernels


def mamba_path(mamba_ssm: bool, causal_conv1d: bool, on_cuda: bool) -> str:
    """Which Mamba-2 path the torch backend runs nemotron_h on, in words (the plan prints it)."""
    k = mamba_kernels(mamba_ssm, causal_conv1d, on_cuda)
    if not on_cuda:
        return "pure torch (CPU: transformers' reference Mamba-2; no Triton kernel runs on CPU tensors)"
    conv = "causal-conv1d's conv1d" if k["causal_conv1d_fn"] else "torch conv1d (causal-conv1d absent)"
    if not k["mamba2_chunk_scan"]:
        return f"pure torch scan (mamba-ssm does not import: ~20x the step time, ~6x the peak), {conv}"
    fused = "; training: the fused split-conv1d-scan" if k[FUSED] else "; training: unfused (needs causal-conv1d)"
    return f"mamba-ssm Triton kernels (chunk scan, state update), {conv}{fused}"


def mamba_packages() -> tuple[bool, bool]:
    """(mamba-ssm, causal-conv1d) would import in this interpreter, judged from files (pre-flight imports neither):
    mamba-ssm with triton and einops, and its CUDA extension or the GPU kit's optional import of it
    (scripts/gpu_kit.py); causal-conv1d with its CUDA extension."""
    def found(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    spec = importlib.util.find_spec("mamba_ssm")
    interface = Path(spec.origin).parent / "ops" / "selective_scan_interface.py" if spec and spec.origin else None
    kit_build = interface is not None and interface.is_file() and "grpo-launcher gpu-kit" in interface.read_text()
    mamba = spec is not None and found("triton") and found("einops") and (found("selective_scan_cuda") or kit_build)
    return mamba, found("causal_conv1d") and found("causal_conv1d_cuda")


def planned_packages(s: RunSpec) -> tuple[bool, bool] | None:
    """(mamba-ssm, causal-conv1d) as the run's workers will find them, judged from this interpreter's packages (the
    plan's line and the memory model read the same); None where the node's packages decide (cluster.python /
    container_image: another interpreter)."""
    c = s.cluster
    return None if node_packages_decide(c) else mamba_packages()


def mamba_train_path(mamba_ssm: bool, causal_conv1d: bool, on_cuda: bool) -> str:
    """The code that trains a Mamba-2 mixer, as preflight/memory_shapes.py's MAMBA_PATHS names it: "fused"
    (mamba_split_conv1d_scan_combined), "kernels" (the Triton chunk scan, torch conv1d) or "torch"."""
    k = mamba_kernels(mamba_ssm, causal_conv1d, on_cuda)
    return "fused" if k[FUSED] else "kernels" if k["mamba2_chunk_scan"] else "torch"


def plan_line(s: RunSpec) -> str:
    """The plan's line for nemotron_h on the torch backend: the Mamba-2 path its workers will run; "" otherwise."""
    if s.model.family != "nemotron_h" or s.train.backend != TrainBackend.torch:
        return ""
    packages = planned_packages(s)
    if packages is None:
        path = "the node's packages decide (cluster.python / container_image): mamba-ssm's Triton kernels where it " \
               "imports on GPUs, else pure torch"
    else:
        path = mamba_path(*packages, on_cuda=s.cluster.gpus_per_node > 0)
        path += " (judged from this interpreter's packages)" if s.cluster.gpus_per_node > 0 else ""
    return f"Mamba-2 path         : {path}"


def _imports(package: str, path: str) -> bool:
    """What transformers' decorator found: the package imports and the kernel is at `path` inside it."""
    try:
        obj: Any = importlib.import_module(package)
        for part in path.split("."):
            obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")
        return callable(obj)
    except Exception:  # as the decorator: any failure means the torch reference
        return False


# what bind_mamba_kernels last bound, process-wide as the binding itself: modeling_nemotron_h name -> kernel runs
BOUND: dict[str, bool] = {}


def bind_mamba_kernels(model: Any, on_cuda: bool) -> str:
    """For a NemotronH model, rebind modeling_nemotron_h's Mamba-2 functions that transformers bound to a kernel
    where the torch backend must not run it (CPU; the fused path without causal-conv1d) to their torch
    references, and return the path in words; "" for other models. Where mamba-ssm's chunk scan runs without
    causal-conv1d, the torch conv1d becomes `seq_idx_conv1d` (packed rows pass seq_idx: policy/packing.py).
    Process-wide, as transformers' own binding."""
    if getattr(getattr(model, "config", None), "model_type", None) != "nemotron_h":
        if not on_cuda:
            torch_references(model)
        return ""
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling  # lazy: see Imports above

    packages = {p: _imports(p, MAMBA_FUNCTIONS[f][1]) for f, p in (("mamba2_chunk_scan", "mamba_ssm"),
                                                                  ("causal_conv1d_fn", "causal_conv1d"))}
    width = in_proj_width(model.config)
    conv = packages["causal_conv1d"] and width % 8 == 0
    wanted = mamba_kernels(packages["mamba_ssm"], conv, on_cuda)
    for name, kernel in wanted.items():
        if packages[MAMBA_FUNCTIONS[name][0]] and not kernel:  # transformers bound the kernel: its torch reference
            setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))
    aware = getattr(modeling.causal_conv1d_fn, "seq_idx_aware", False)
    if wanted["mamba2_chunk_scan"] and not wanted["causal_conv1d_fn"] and not aware:  # torch conv1d + Triton scan
        modeling.causal_conv1d_fn = seq_idx_conv1d(modeling.causal_conv1d_fn)
    elif aware and not (wanted["mamba2_chunk_scan"] and not wanted["causal_conv1d_fn"]):
        modeling.causal_conv1d_fn = modeling.causal_conv1d_fn.__wrapped__  # as it was before
    BOUND.clear()
    BOUND.update(wanted)
    path = mamba_path(packages["mamba_ssm"], conv, on_cuda)
    if packages["causal_conv1d"] and not conv and on_cuda:
        path += f"; causal-conv1d installed but not used: its kernels need the Mamba in_proj width ({width}) " \
                "to be a multiple of 8"
    return path


# Mamba / Mamba-2 functions other families' modeling modules (bamba, falcon_h1, granitemoehybrid, zamba2; jamba,
# zamba) bind to mamba-ssm's / causal-conv1d's kernels wherever those import
OTHER_FAMILIES_KERNELS = (*MAMBA_FUNCTIONS, "mamba_selective_scan", "mamba_selective_state_update")


def torch_references(model: Any) -> None:
    """On a CPU: rebind the kernel-bound Mamba functions of the model's own modeling module to their torch references
    (the functions transformers wrapped). mamba-ssm importable without a GPU (the GPU kit's build, the CPU tests'
    venv) otherwise sends CPU tensors into its Triton / CUDA kernels: the tiny bamba, falcon_h1, granitemoehybrid,
    zamba2 and jamba stopped at the worker's first forward (TypeError in _mamba_chunk_scan_combined_fwd,
    'NoneType' object has no attribute 'fwd'), rc 1 after start-up. Process-wide, as transformers' own binding."""
    module = inspect.getmodule(type(model))
    for name in OTHER_FAMILIES_KERNELS:
        fn = getattr(module, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(module, name, inspect.unwrap(fn))


def in_proj_width(config: Any) -> int:
    """A NemotronH Mamba-2 mixer's in_proj output width (z, x, B, C, dt): causal-conv1d reads x/B/C as a strided
    view of it, and its channel-last kernels need that stride to be a multiple of 8 (a RuntimeError otherwise,
    seen on an H200 with causal-conv1d 1.6.0 and 4 Mamba heads: width 196)."""
    inner = config.mamba_num_heads * config.mamba_head_dim
    return 2 * inner + 2 * config.n_groups * config.ssm_state_size + config.mamba_num_heads


def varlen_mamba() -> bool:
    """The Mamba-2 layers bound last (`BOUND`) honour `seq_idx` (packed rows as separate sequences): mamba-ssm's
    chunk scan, with causal-conv1d's kernel, the fused path or `seq_idx_conv1d`. transformers' torch scan ignores
    it (its reference takes no seq_idx): False there."""
    return bool(BOUND.get("mamba2_chunk_scan"))


def seq_idx_conv1d(reference: Any) -> Any:
    """transformers' torch causal_conv1d_fn (`reference`), taking causal-conv1d's `seq_idx` [b, s] as its kernel
    does: a position's depthwise causal conv reads only the earlier positions of its own sequence (K taps, the ones
    before the sequence's start read as 0). Without seq_idx: the reference itself."""
    import torch  # lazy: see Imports above
    import torch.nn.functional as F  # lazy: see Imports above

    @functools.wraps(reference)
    def conv(hidden_states: Any, weight: Any, bias: Any = None, activation: Any = None, seq_idx: Any = None,
             **kwargs: Any) -> Any:
        if seq_idx is None:
            return reference(hidden_states, weight, bias, activation=activation, **kwargs)
        # hidden_states [b, d, s]; weight [d, K]; seq_idx [b, s]: tap k reads x[t - k] where seq_idx[t - k] = seq_idx[t]
        dtype = torch.get_autocast_dtype(hidden_states.device.type) if torch.is_autocast_enabled(
            hidden_states.device.type) else weight.dtype
        x, w = hidden_states.to(dtype), weight.to(dtype)
        K, s = w.shape[-1], x.shape[-1]
        out = x * w[:, K - 1, None]
        for k in range(1, K):
            same = (F.pad(seq_idx, (k, 0), value=-1)[:, :s] == seq_idx)[:, None, :]  # [b, 1, s]
            out = out + F.pad(x, (k, 0))[..., :s] * w[:, K - 1 - k, None] * same
        if bias is not None:
            out = out + bias.to(dtype)[:, None]
        if activation is not None:
            out = F.silu(out) if activation in ("silu", "swish") else getattr(F, activation)(out)
        return out.to(hidden_states.dtype)

    conv.seq_idx_aware = True  # type: ignore[attr-defined]
    return conv
