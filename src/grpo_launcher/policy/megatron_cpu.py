"""megatron-core on a CPU (gloo): patches for the few places where it hard-codes CUDA. For tests and development
only: `GRPO_MEGATRON_CPU_SHIM=1` turns it on; pre-flight refuses the megatron backend on a CPU without it, and on
GPUs nothing of this is used.

megatron-core hard-codes CUDA in a few places that a CPU forward/backward reaches
(../shared/reference/feasibility-megatron.md §1.2):
  * ``torch.cuda.current_device()`` for RoPE frequencies and the attention scratch buffer;
  * the tensor-parallel RNG tracker (``get_cuda_rng_tracker().fork()``) needs CUDA RNG states;
  * 0.16.1 only: ``moe_utils.te_general_gemm`` is undefined without Transformer Engine.

Hooks: ``install()`` before any model is built, ``after_parallel_init()`` after
``parallel_state.initialize_model_parallel``.
"""

from __future__ import annotations

import torch

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # RoPE / scratch buffers land on the CPU
    try:  # 0.16.1: the MoE router's gating GEMM names a TE symbol that only exists when TE imports
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:
        pass
    _installed = True


def after_parallel_init() -> None:
    # The inference tracker's fork() is a no-op context: dropout (0 here) uses torch's CPU generator.
    from megatron.core.tensor_parallel import random as tpr

    tpr.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
