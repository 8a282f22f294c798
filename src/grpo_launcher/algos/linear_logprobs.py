"""Sampled-token logprobs and entropies straight from hidden states, never the whole [N, V] logits at once.

The output layer (hidden [N, H] x weight [V, H] + bias [V]) runs in chunks of `chunk` tokens: each chunk's
logits [chunk, V] are made in the compute dtype, put through the family's own logit post-processing in fp32
(`transform`: Gemma's softcapping, Granite's and Cohere's scaling; logit_heads.py), log-softmaxed in fp32, and
dropped; only the logsumexp per token is kept for the backward, which recomputes each chunk's logits (one more
output-layer GEMM per chunk) and turns them into the gradient d lp / d z = onehot(target) - softmax(z), times
the transform's slope and 1 / temperature.
Peak memory of the output layer: a few [chunk, V] fp32 buffers instead of [N, V] logits, their fp32
log-softmax and its gradient. The entropy is a metric (no gradient), as in algos.entropy_from_logits.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

# what a family's forward does to lm_head's output (logit_heads.LogitTransform): f(z) and its slope at f(z)
Transform = Optional[Any]


def _chunk_logits(h: Tensor, w: Tensor, b: Tensor | None, inv_temp: float, transform: Transform
                  ) -> tuple[Tensor, Tensor]:
    """(logits / temperature, the family's logits) of one chunk in fp32 (fp64 for fp64 inputs, as
    algos.token_logprobs)."""
    # h: [n, H]; w: [V, H]; b: [V] or None -> ([n, V], [n, V]) float32 / float64
    z = torch.nn.functional.linear(h, w, b).to(torch.float64 if h.dtype == torch.float64 else torch.float32)
    y = transform(z) if transform is not None else z
    return y * inv_temp, y


def _logit_grad(z: Tensor, y: Tensor, lse: Tensor, targets: Tensor, g: Tensor, g_target: Tensor, inv_temp: float,
                transform: Transform, dtype: torch.dtype) -> Tensor:
    """d (g · lp) / d (h w^T + b) of one chunk, in `dtype`: g softmax(z) subtracted, g_target added at the target
    (g, or 0 where another rank holds the target's row), times the transform's slope and 1 / temperature."""
    # z (logits / temperature), y (the family's logits): [n, V]; lse, g, g_target: [n]; targets: [n] -> [n, V]
    gz = torch.exp(z - lse[:, None]).mul_(-g[:, None])  # -g softmax(z)
    gz.scatter_add_(-1, targets[:, None], g_target[:, None])  # + g onehot(target)
    gz = gz.mul_(inv_temp)
    if transform is not None:
        gz = gz.mul_(transform.slope(y))
    return gz.to(dtype)


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, inv_temp: float,
                chunk: int, transform: Transform) -> tuple[Tensor, Tensor]:
        # hidden: [N, H]; weight: [V, H]; bias: [V] or None (one dtype); targets: [N] int
        # -> (logprobs [N], entropy [N]) float32
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, chunk):
            z, _ = _chunk_logits(hidden[s:s + chunk], weight, bias, inv_temp, transform)  # [n, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [n]
            lp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse_c
            ent[s:s + chunk] = lse_c - (torch.softmax(z, dim=-1) * z).sum(-1)  # H = lse - E_p[z]
            lse[s:s + chunk] = lse_c
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.inv_temp, ctx.chunk, ctx.transform = inv_temp, chunk, transform
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:
        # g_lp: [N] -> (d hidden [N, H], d weight [V, H], d bias [V] or None, None x 4)
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        inv_temp, chunk, transform = ctx.inv_temp, ctx.chunk, ctx.transform
        g_hidden = torch.empty_like(hidden)
        g_weight: Tensor | None = None  # accumulated in fp32 over the chunks
        g_bias: Tensor | None = None
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], g_lp[s:s + chunk].to(lse.dtype)
            z, y = _chunk_logits(h, weight, bias, inv_temp, transform)  # [n, V]
            gz = _logit_grad(z, y, lse[s:s + chunk], targets[s:s + chunk], g, g, inv_temp, transform, weight.dtype)
            g_hidden[s:s + chunk] = gz @ weight
            part = gz.t() @ h  # [V, H]
            g_weight = part.to(lse.dtype) if g_weight is None else g_weight.add_(part)
            if bias is not None:
                col = gz.sum(0).to(lse.dtype)  # [V]
                g_bias = col if g_bias is None else g_bias.add_(col)
        assert g_weight is not None
        return (g_hidden, g_weight.to(weight.dtype), None if g_bias is None else g_bias.to(bias.dtype),
                None, None, None, None)


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    dev = hidden.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                    transform: Transform = None, temperature: float = 1.0, chunk: int = 4096
                    ) -> tuple[Tensor, Tensor]:
    """log softmax(f(hidden @ weight^T + bias) / temperature)[target] and the distribution's entropy, per token, in
    fp32; f = `transform` (a logit_heads.LogitTransform: the family's post-processing), else the identity.

    Differentiable in hidden, weight and bias (not in the entropy). The GEMMs run in the autocast dtype when
    autocast is on (as the output layer would), else in hidden's dtype; `chunk` tokens of logits at a time.
    """
    # hidden: [N, H]; weight: [V, H]; bias: [V] or None; targets: [N] int -> (logprobs [N], entropy [N]) float32
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        out: tuple[Tensor, Tensor] = _LinearLogprob.apply(
            hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), targets.long(),
            1.0 / temperature, chunk, transform)
    return out


def _all_reduce(x: Tensor, group: Any, op: Any = None) -> Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


class _VocabParallelLinearLogprob(torch.autograd.Function):
    """_LinearLogprob with the vocabulary split over a tensor-parallel group (megatron's output layer for TP > 1):
    each rank holds weight rows [start, start + V/TP) and the whole hidden states; per chunk the max, the sums
    of exp and of exp·z and the target's logit are all-reduced over the group. The hidden states' gradient is
    the sum of every rank's part (all-reduced, as megatron's copy_to_tensor_model_parallel_region's backward)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float, chunk: int,
                start: int, group: Any, transform: Transform) -> tuple[Tensor, Tensor]:
        # hidden: [N, H] (the same on every rank); weight: [V/TP, H]; targets: [N] global ids -> ([N], [N]) fp32
        n, vp = hidden.shape[0], weight.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        local = targets - start  # [N]: this rank's row of the target, if it holds it
        mine = (local >= 0) & (local < vp)
        for s in range(0, n, chunk):
            z, _ = _chunk_logits(hidden[s:s + chunk], weight, None, inv_temp, transform)  # [n, V/TP]
            m = _all_reduce(z.amax(-1), group, dist.ReduceOp.MAX)  # [n]
            e = torch.exp(z - m[:, None])
            zt = z.gather(-1, local[s:s + chunk, None].clamp(0, vp - 1)).squeeze(-1)
            stats = torch.stack([e.sum(-1), (e * z).sum(-1), torch.where(mine[s:s + chunk], zt, 0.0)])
            total, ez, z_t = _all_reduce(stats, group)  # [n] each: sum exp, sum exp·z, the target's logit
            lse[s:s + chunk] = m + total.log()
            lp[s:s + chunk] = z_t - lse[s:s + chunk]
            ent[s:s + chunk] = lse[s:s + chunk] - ez / total  # H = lse - E_p[z]
        ctx.save_for_backward(hidden, weight, local, mine, lse)
        ctx.inv_temp, ctx.chunk, ctx.group, ctx.transform = inv_temp, chunk, group, transform
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:
        # g_lp: [N] -> (d hidden [N, H] summed over the group, d weight [V/TP, H], None x 6)
        hidden, weight, local, mine, lse = ctx.saved_tensors
        inv_temp, chunk, vp, transform = ctx.inv_temp, ctx.chunk, weight.shape[0], ctx.transform
        g_hidden = hidden.new_empty(hidden.shape, dtype=lse.dtype)  # this rank's part, summed below
        g_weight: Tensor | None = None
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], g_lp[s:s + chunk].to(lse.dtype)
            z, y = _chunk_logits(h, weight, None, inv_temp, transform)  # [n, V/TP]: this rank's columns
            gz = _logit_grad(z, y, lse[s:s + chunk], local[s:s + chunk].clamp(0, vp - 1), g, g * mine[s:s + chunk],
                             inv_temp, transform, weight.dtype)
            g_hidden[s:s + chunk] = gz @ weight
            part = gz.t() @ h  # [V/TP, H]
            g_weight = part.to(lse.dtype) if g_weight is None else g_weight.add_(part)
        assert g_weight is not None
        g_hidden = _all_reduce(g_hidden, ctx.group)
        return g_hidden.to(hidden.dtype), g_weight.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, group: Any, vocab_start: int,
                                   temperature: float = 1.0, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """linear_logprobs with weight = rows [vocab_start, vocab_start + V/TP) of the output layer on each rank of
    `group` (a torch.distributed group: tensor parallelism) and the same hidden states and targets on every rank.
    Every rank gets the full-vocabulary logprobs and entropies; a collective (every rank of the group calls it).
    No logit post-processing: megatron's families have none (pre-flight refuses the others, policy/rules.py)."""
    # hidden: [N, H]; weight: [V/TP, H]; targets: [N] int (global ids) -> (logprobs [N], entropy [N]) float32
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        out: tuple[Tensor, Tensor] = _VocabParallelLinearLogprob.apply(
            hidden.to(dtype), weight.to(dtype), targets.long(), 1.0 / temperature, chunk, vocab_start, group, None)
    return out
