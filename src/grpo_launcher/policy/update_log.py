"""What one `update()` call of a policy worker returns, the same for both backends.

Micro-batch metrics are combined with `algos.combine_metrics` (weighted by each micro-batch's share of the
global denominator, maxima kept as maxima), averaged over the minibatches that stepped; a minibatch with no
loss-bearing sample (global denominator 0, the same on every rank) takes no optimizer step and is counted.
"""

from __future__ import annotations

import torch

from ..algos import METRIC_REDUCTIONS, combine_metrics


class UpdateLog:
    def __init__(self) -> None:
        self.parts: list[tuple[dict[str, float], float]] = []
        self.grad_norms: list[float] = []
        self.skipped = 0
        self.prev: list[torch.Tensor] = []  # on-policy: old logprobs of this rank's rows, in order
        self.ref: list[torch.Tensor] = []

    def result(self, lr: float, on_policy: bool) -> dict:
        out = combine_metrics(self.parts)
        stepped = max(len(self.grad_norms), 1)
        out = {k: v if METRIC_REDUCTIONS.get(k) == "max" else v / stepped for k, v in out.items()}
        out.update(grad_norm=sum(self.grad_norms) / stepped, lr=lr, skipped_optimizer_steps=float(self.skipped))
        if on_policy:
            out["prev_logprobs"] = torch.cat(self.prev)
            out["ref_logprobs"] = torch.cat(self.ref) if self.ref else None
        return out
