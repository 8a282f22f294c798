"""train.fused_kernels on the torch backend: Liger's Triton kernels (liger-kernel) for RMSNorm, SwiGLU and RoPE,
patched into the policy's HF model in place (module names and weights unchanged). CUDA only; null = on where it
applies (a GPU, a family below, liger-kernel importable), as measured in benchmarks/results/gpu_step.md."""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pre-flight reads FAMILIES without importing torch
    import torch

# model.family -> liger_kernel.transformers' patch function for it
FAMILIES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
            "qwen3": "apply_liger_kernel_to_qwen3"}


def wanted(setting: bool | None, family: str, device: torch.device) -> bool:
    """train.fused_kernels resolved: true/false as set; null = a CUDA device, a mapped family and Liger installed."""
    if setting is not None:
        return setting
    return device.type == "cuda" and family in FAMILIES and find_spec("liger_kernel") is not None


def apply(model: torch.nn.Module, family: str) -> None:
    """Liger's RMSNorm, SwiGLU MLP and rotary kernels into this model instance (its fused cross-entropy: no; the
    logprobs come from algos.linear_logprobs)."""
    patch = getattr(importlib.import_module("liger_kernel.transformers"), FAMILIES[family])
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
