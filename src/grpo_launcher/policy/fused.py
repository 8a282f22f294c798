"""train.fused_kernels on the torch backend: Liger's Triton kernels (liger-kernel) for RMSNorm, SwiGLU and RoPE,
patched into the policy's HF model in place (module names and weights unchanged). CUDA only; off by default until
measured on a GPU (benchmarks/results/gpu_step.md: not yet)."""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pre-flight reads FAMILIES without importing torch
    import torch

# model.family -> liger_kernel.transformers' patch function for it
FAMILIES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
            "qwen3": "apply_liger_kernel_to_qwen3"}


def wanted(setting: bool, family: str, device: torch.device) -> bool:
    """train.fused_kernels where it applies (pre-flight refuses true elsewhere; a CPU test worker just skips it)."""
    return setting and device.type == "cuda" and family in FAMILIES and find_spec("liger_kernel") is not None


def apply(model: torch.nn.Module, family: str) -> None:
    """Liger's RMSNorm, SwiGLU MLP and rotary kernels into this model instance (its fused cross-entropy: no; the
    logprobs come from algos.linear_logprobs)."""
    patch = getattr(importlib.import_module("liger_kernel.transformers"), FAMILIES[family])
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
