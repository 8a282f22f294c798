"""megatron-core on a CPU (gloo): patches for the few places where it hard-codes CUDA. For tests and development
only: `GRPO_MEGATRON_CPU_SHIM=1` turns it on; pre-flight refuses the megatron backend on a CPU without it, and on
GPUs nothing of this is used.

megatron-core hard-codes CUDA in a few places that a CPU forward/backward reaches
(../shared/reference/feasibility-megatron.md §1.2):
  * ``torch.cuda.current_device()`` for RoPE frequencies and the attention scratch buffer;
  * the tensor-parallel RNG tracker (``get_cuda_rng_tracker().fork()``) needs CUDA RNG states;
  * 0.16.1 only: ``moe_utils.te_general_gemm`` is undefined without Transformer Engine;
  * the Mamba mixer (model.family=nemotron_h) calls mamba-ssm's Triton chunk scan and gated RMSNorm, which run on
    CUDA tensors only: they are bound to mamba-ssm's own pure-torch references (``ssd_chunk_scan_combined_ref``,
    ``rms_norm_ref``). The mixer still needs mamba-ssm importable (without its CUDA extension: the GPU kit's build).

Hooks: ``install()`` before any model is built, ``after_parallel_init()`` after
``parallel_state.initialize_model_parallel``.

Imports. megatron-core and mamba-ssm inside the functions: policy/megatron_policy.py imports this module, and the
driver that one (its imports stay light, as megatron_policy's docstring says); mamba-ssm is optional besides.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # RoPE / scratch buffers land on the CPU
    try:  # 0.16.1: the MoE router's gating GEMM names a TE symbol that only exists when TE imports
        from megatron.core.transformer.moe import moe_utils  # lazy: see Imports above

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:
        pass
    _mamba_references()
    _installed = True


def _mamba_references() -> None:
    try:
        from megatron.core.ssm import mamba_mixer  # lazy: see Imports above
    except ImportError:
        return
    if not mamba_mixer.HAVE_MAMBA_SSM:
        return  # the mixer refuses to build (pre-flight names mamba-ssm)
    mamba_mixer.mamba_chunk_scan_combined = chunk_scan_reference
    mamba_mixer.ExtendedRMSNorm.forward = _gated_norm_reference


def chunk_scan_reference(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                         D: Optional[Tensor] = None, z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                         dt_softplus: bool = False, return_final_states: bool = False,
                         initial_states: Optional[Tensor] = None, seq_idx: Optional[Tensor] = None,
                         **_: Any) -> Tensor:
    """mamba_chunk_scan_combined's arguments → mamba-ssm's torch reference of it (no states in or out: training and
    logprobs only). The reference wants whole chunks: the sequence is zero-padded at its end (causal: the padding
    changes no earlier output) and the output cut back."""
    from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref  # lazy: see Imports above

    if return_final_states or initial_states is not None or seq_idx is not None:
        raise NotImplementedError("the CPU Mamba reference has no state passing or packing")
    L, pad = x.shape[1], -x.shape[1] % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        z = None if z is None else F.pad(z, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
    out = ssd_chunk_scan_combined_ref(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    return out[:, :L].to(x.dtype)  # the kernel's output dtype (the reference promotes with the fp32 D)


def _gated_norm_reference(self: Any, x: Tensor, z: Optional[Tensor] = None) -> Tensor:
    from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref  # lazy: see Imports above

    return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                        norm_before_gate=self.norm_before_gate)


def after_parallel_init() -> None:
    # The inference tracker's fork() is a no-op context: dropout (0 here) uses torch's CPU generator.
    from megatron.core.tensor_parallel import random as tpr  # lazy: see Imports above

    tpr.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
