"""What one `update()` call of a policy worker returns, the same for both backends.

Micro-batch metrics are combined with `algos.combine_metrics` (weighted by each micro-batch's share of the
global denominator, maxima kept as maxima), averaged over the minibatches that stepped; a minibatch with no
loss-bearing sample (global denominator 0, the same on every rank) takes no optimizer step and is counted.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..algos import METRIC_REDUCTIONS, combine_metrics
from ..tracking import metric_names as M


class Diverged(FloatingPointError):
    """Training produced non-finite numbers: the update's gradients (its optimizer step not taken) or the rollout's
    logprobs (the last update broke the weights). The run stops FAILED; its last checkpoint stands."""


def finite_norm(norm: float, loss: float | None = None) -> float:
    """The gradient norm, or Diverged before an optimizer step would write NaN/inf into every weight (a
    reward past float32, a learning rate that blew the weights up last step: the run stops, its last checkpoint
    whole)."""
    if math.isfinite(norm):
        return norm
    at = f" (loss {loss:g})" if loss is not None else ""
    raise Diverged(f"the update's gradient norm is {norm}{at}: the optimizer step was not taken and the "
                          "run stops with the weights of the last step; look at train/reward_mean, train/loss and "
                          "train/grad_norm of the last steps (a reward or advantage out of range, train.lr too high)")


class UpdateLog:
    def __init__(self) -> None:
        self.parts: list[tuple[dict[str, float], float]] = []
        self.grad_norms: list[float] = []
        self.skipped = 0
        self.prev: list[torch.Tensor] = []  # on-policy: old logprobs of this rank's rows, in order
        self.ref: list[torch.Tensor] = []

    def result(self, lr: float, on_policy: bool) -> dict:
        combined = combine_metrics(self.parts)
        stepped = max(len(self.grad_norms), 1)
        out: dict[str, Any] = {k: v if METRIC_REDUCTIONS.get(k) == "max" else v / stepped for k, v in combined.items()}
        out.update(grad_norm=sum(self.grad_norms) / stepped, lr=lr, skipped_optimizer_steps=float(self.skipped))
        if torch.cuda.is_available():  # what this process holds after the update: a leak shows as steady growth
            out["memory"] = {M.MEMORY_POLICY_ALLOCATED_GIB: torch.cuda.memory_allocated() / 2**30,
                             M.MEMORY_POLICY_RESERVED_GIB: torch.cuda.memory_reserved() / 2**30}
        if on_policy:
            out["prev_logprobs"] = torch.cat(self.prev)
            out["ref_logprobs"] = torch.cat(self.ref) if self.ref else None
        return out


class RouterLoad:
    """MoE router load per layer over one update's forwards (train/moe/* each step), counted by forward hooks on
    the routers (modules named *Router whose output ends with the top-k expert indices [tokens, k], as
    transformers' MoE routers return them; nothing for a dense model). Padding positions are routed too and
    counted. Over DP ranks the counts are summed first (a collective every rank joins in `metrics`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts: dict[str, torch.Tensor] = {}  # layer -> [E] tokens routed to each expert
        self.on = False
        self.layers: list[str] = []
        for name, mod in model.named_modules():
            experts = getattr(mod, "n_routed_experts", None) or getattr(mod, "num_experts", None)
            if "Router" in type(mod).__name__ and experts:
                self.layers.append(name)
                mod.register_forward_hook(self._hook(name, int(experts)))

    def _hook(self, name: str, experts: int) -> Callable[[torch.nn.Module, object, object], None]:
        def count(_mod: torch.nn.Module, _args: object, out: object) -> None:
            if not self.on or not isinstance(out, tuple) or out[-1].is_floating_point():
                return
            idx = out[-1].reshape(-1)  # [tokens * k] expert indices
            seen = torch.bincount(idx, minlength=experts).detach().to("cpu", torch.float64)
            self.counts[name] = self.counts.get(name, 0) + seen
        return count

    def metrics(self, world: int, device: torch.device) -> dict[str, float]:
        """This rank's share of each global figure (the driver sums the ranks' metrics); {} for a dense model.
        Counts taken under activation checkpointing include the recomputed forwards: the shares are the same."""
        if not self.layers:
            return {}
        experts = max((c.numel() for c in self.counts.values()), default=1)
        local = torch.stack([self.counts.get(n, torch.zeros(experts, dtype=torch.float64)) for n in self.layers])
        glob = local.to(device, copy=True)  # local stays this rank's (on the CPU .to would alias it)
        if world > 1 and dist.is_initialized():
            dist.all_reduce(glob)  # every rank's update calls this once
        glob = glob.cpu()
        self.counts = {}
        share = float(local.sum() / glob.sum()) if glob.sum() > 0 else 1.0 / world
        return {k: v * share for k, v in router_balance(glob, self.layers).items()}


def router_balance(counts: torch.Tensor, layers: list[str]) -> dict[str, float]:
    """counts [L, E] tokens routed per layer and expert -> moe/<layer>/max_load (the busiest expert's token share
    over the mean share: 1 = balanced, E = one expert takes all), moe/<layer>/entropy (of the routing
    distribution over experts, / log E: 1 = uniform), and over layers moe/max_load (max) and moe/entropy (mean)."""
    p = counts / counts.sum(-1, keepdim=True).clamp(min=1)  # [L, E]
    E = counts.shape[-1]
    max_load = p.max(-1).values * E  # [L]
    ent = -(p * p.clamp(min=1e-30).log()).sum(-1) / max(torch.log(torch.tensor(float(E))).item(), 1e-30)  # [L]
    out = {"moe/max_load": float(max_load.max()), "moe/entropy": float(ent.mean())}
    for i, name in enumerate(layers):
        short = name.split("layers.")[-1].split(".")[0] if "layers." in name else str(i)
        out[f"moe/layer_{short}/max_load"] = float(max_load[i])
        out[f"moe/layer_{short}/entropy"] = float(ent[i])
    return out
