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


def _all_reduce(x: Tensor, group: Any, op: Any = None) -> Tensor:
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


class _VocabParallelLinearLogprob(torch.autograd.Function):
    """_LinearLogprob with the vocabulary split over a tensor-parallel group (megatron's output layer for TP > 1):
    each rank holds weight rows [start, start + V/TP) and the whole hidden states; per chunk the max, the sums
    of exp and of exp·z and the target's logit are all-reduced over the group. The hidden states' gradient is
    the sum of every rank's part (all-reduced, as megatron's copy_to_tensor_model_parallel_region's backward)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float, chunk: int,
                start: int, group: Any) -> tuple[Tensor, Tensor]:
        # hidden: [N, H] (the same on every rank); weight: [V/TP, H]; targets: [N] global ids -> ([N], [N]) fp32
        import torch.distributed as dist

        n, vp = hidden.shape[0], weight.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        local = targets - start  # [N]: this rank's row of the target, if it holds it
        mine = (local >= 0) & (local < vp)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s:s + chunk], weight, inv_temp)  # [n, V/TP]
            m = _all_reduce(z.amax(-1), group, dist.ReduceOp.MAX)  # [n]
            e = torch.exp(z - m[:, None])
            zt = z.gather(-1, local[s:s + chunk, None].clamp(0, vp - 1)).squeeze(-1)
            stats = torch.stack([e.sum(-1), (e * z).sum(-1), torch.where(mine[s:s + chunk], zt, 0.0)])
            total, ez, z_t = _all_reduce(stats, group)  # [n] each: sum exp, sum exp·z, the target's logit
            lse[s:s + chunk] = m + total.log()
            lp[s:s + chunk] = z_t - lse[s:s + chunk]
            ent[s:s + chunk] = lse[s:s + chunk] - ez / total  # H = lse - E_p[z]
        ctx.save_for_backward(hidden, weight, local, mine, lse)
        ctx.inv_temp, ctx.chunk, ctx.group = inv_temp, chunk, group
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:
        # g_lp: [N] -> (d hidden [N, H] summed over the group, d weight [V/TP, H], None x 5)
        hidden, weight, local, mine, lse = ctx.saved_tensors
        inv_temp, chunk, vp = ctx.inv_temp, ctx.chunk, weight.shape[0]
        g_hidden = hidden.new_empty(hidden.shape, dtype=lse.dtype)  # this rank's part, summed below
        g_weight: Tensor | None = None
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], g_lp[s:s + chunk].to(lse.dtype)
            z = _chunk_logits(h, weight, inv_temp)  # [n, V/TP]
            gz = torch.exp(z - lse[s:s + chunk, None]).mul_(-g[:, None])  # -g softmax(z), this rank's columns
            gz.scatter_add_(-1, local[s:s + chunk, None].clamp(0, vp - 1), (g * mine[s:s + chunk])[:, None])
            gz = gz.mul_(inv_temp).to(weight.dtype)
            g_hidden[s:s + chunk] = gz @ weight
            part = gz.t() @ h  # [V/TP, H]
            g_weight = part.to(lse.dtype) if g_weight is None else g_weight.add_(part)
        assert g_weight is not None
        g_hidden = _all_reduce(g_hidden, ctx.group)
        return g_hidden.to(hidden.dtype), g_weight.to(weight.dtype), None, None, None, None, None


def vocab_parallel_linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, group: Any, vocab_start: int,
                                   temperature: float = 1.0, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """linear_logprobs with weight = rows [vocab_start, vocab_start + V/TP) of the output layer on each rank of
    `group` (a torch.distributed group: tensor parallelism) and the same hidden states and targets on every rank.
    Every rank gets the full-vocabulary logprobs and entropies; a collective (every rank of the group calls it)."""
    # hidden: [N, H]; weight: [V/TP, H]; targets: [N] int (global ids) -> (logprobs [N], entropy [N]) float32
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    with torch.autocast(dev, enabled=False):
        out: tuple[Tensor, Tensor] = _VocabParallelLinearLogprob.apply(
            hidden.to(dtype), weight.to(dtype), targets.long(), 1.0 / temperature, chunk, vocab_start, group)
    return out
