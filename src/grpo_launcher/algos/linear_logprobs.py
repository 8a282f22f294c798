"""Sampled-token logprobs and entropies straight from hidden states, never the whole [N, V] logits at once.

The output layer (hidden [N, H] x weight [V, H]) runs in chunks of `chunk` tokens: each chunk's logits
[chunk, V] are made in the compute dtype, log-softmaxed in fp32, and dropped; only the logsumexp per token
is kept for the backward, which recomputes each chunk's logits (one more output-layer GEMM per chunk) and
turns them into the gradient d lp / d z = onehot(target) - softmax(z), scaled by 1 / temperature.
Peak memory of the output layer: a few [chunk, V] fp32 buffers instead of [N, V] logits, their fp32
log-softmax and its gradient. The entropy is a metric (no gradient), as in algos.entropy_from_logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _chunk_logits(h: Tensor, w: Tensor, inv_temp: float) -> Tensor:
    """Logits / temperature of one chunk in fp32 (fp64 for fp64 inputs, as algos.token_logprobs)."""
    # h: [n, H]; w: [V, H] -> [n, V] float32 / float64
    return (h @ w.t()).to(torch.float64 if h.dtype == torch.float64 else torch.float32) * inv_temp


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float,
                chunk: int) -> tuple[Tensor, Tensor]:
        # hidden: [N, H]; weight: [V, H] (one dtype); targets: [N] int -> (logprobs [N], entropy [N]) float32
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s:s + chunk], weight, inv_temp)  # [n, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [n]
            lp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse_c
            ent[s:s + chunk] = lse_c - (torch.softmax(z, dim=-1) * z).sum(-1)  # H = lse - E_p[z]
            lse[s:s + chunk] = lse_c
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:
        # g_lp: [N] -> (d hidden [N, H], d weight [V, H], None, None, None)
        hidden, weight, targets, lse = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        g_hidden = torch.empty_like(hidden)
        g_weight: Tensor | None = None  # accumulated in fp32 over the chunks
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], g_lp[s:s + chunk].to(lse.dtype)
            z = _chunk_logits(h, weight, inv_temp)  # [n, V]
            gz = torch.exp(z - lse[s:s + chunk, None]).mul_(-g[:, None])  # -g softmax(z)
            gz.scatter_add_(-1, targets[s:s + chunk, None], g[:, None])  # + g onehot(target)
            gz = gz.mul_(inv_temp).to(weight.dtype)  # d lp / d (h w^T)
            g_hidden[s:s + chunk] = gz @ weight
            part = gz.t() @ h  # [V, H]
            g_weight = part.to(lse.dtype) if g_weight is None else g_weight.add_(part)
        assert g_weight is not None
        return g_hidden, g_weight.to(weight.dtype), None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                    chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """log softmax(hidden @ weight^T / temperature)[target] and the distribution's entropy, per token, in fp32.

    Differentiable in hidden and weight (not in the entropy). The GEMMs run in the autocast dtype when autocast is
    on (as the output layer would), else in hidden's dtype; `chunk` tokens of logits at a time.
    """
    # hidden: [N, H]; weight: [V, H]; targets: [N] int -> (logprobs [N], entropy [N]) float32
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    with torch.autocast(dev, enabled=False):
        out: tuple[Tensor, Tensor] = _LinearLogprob.apply(hidden.to(dtype), weight.to(dtype), targets.long(),
                                                          1.0 / temperature, chunk)
    return out
