"""The loss as the workers call it, and its global denominators.

`spec_policy_loss` is the ONE place where the settings of `loss.*` (a LossSpec) are unpacked into
`policy_loss`; `LossInputs` carries one (micro-)batch's tensors. Both policy backends and the
training-data records call it the same way:

    x = LossInputs.of(mb, old)
    loss, per_token, metrics = spec_policy_loss(lp, x, spec.loss, norm_len=spec.rollout.max_new_tokens)
    share = local_denominator(spec.loss.aggregation, x.effective_mask) / global_denominator

Data parallelism: each rank backpropagates ``loss * share``, where ``share`` is its part of the WHOLE
minibatch's denominator (tokens for token_mean, non-empty sequences otherwise), and gradients are
SUMmed over ranks, so an update over W ranks equals the 1-rank update on the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

import torch
from torch import Tensor

from .core import loss_mask, policy_loss

if TYPE_CHECKING:
    from ..spec.schema import LossSpec


class LossBatch(Protocol):
    """What LossInputs.of reads of a batch (grpo_launcher.batch.TrainBatch has these fields; read-only)."""

    @property
    def advantages(self) -> Tensor: ...  # [B]

    @property
    def response_mask(self) -> Tensor: ...  # [B, T]

    @property
    def sample_mask(self) -> Tensor: ...  # [B]

    @property
    def is_weights(self) -> Optional[Tensor]: ...  # [B, T]

    @property
    def ref_logprobs(self) -> Optional[Tensor]: ...  # [B, T]


@dataclass(frozen=True)
class LossInputs:
    """One (micro-)batch's tensors that the loss reads besides the current logprobs."""

    old_logprobs: Tensor  # [B, T] pi_old: the policy before the update (detached)
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] 1 on response tokens
    sample_mask: Optional[Tensor] = None  # [B] 0 = no loss for this sample (overlong / dynamic sampling)
    is_weights: Optional[Tensor] = None  # [B, T] rollout/training mismatch correction (detached)
    ref_logprobs: Optional[Tensor] = None  # [B, T] the reference policy's (loss.kl_coef > 0)

    @classmethod
    def of(cls, batch: LossBatch, old_logprobs: Tensor) -> LossInputs:
        return cls(old_logprobs, batch.advantages, batch.response_mask, batch.sample_mask, batch.is_weights,
                   batch.ref_logprobs)

    def to(self, device: torch.device | str) -> LossInputs:
        return LossInputs(*(None if t is None else t.to(device) for t in (
            self.old_logprobs, self.advantages, self.mask, self.sample_mask, self.is_weights, self.ref_logprobs)))

    @property
    def effective_mask(self) -> Tensor:
        """[B, T] float: response tokens of the samples that carry loss (algos.loss_mask)."""
        return loss_mask(self.mask, self.sample_mask)


def spec_policy_loss(
    logprobs: Tensor, x: LossInputs, loss: LossSpec, *, norm_len: int, entropy: Tensor | None = None
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """policy_loss with loss.*'s settings; norm_len = rollout.max_new_tokens (Dr. GRPO's constant)."""
    # logprobs: [B, T]; entropy: [B, T] -> (scalar, [B, T] detached, metrics)
    return policy_loss(
        logprobs, x.old_logprobs, x.advantages, x.mask, sample_mask=x.sample_mask,
        clip_low=loss.clip_low, clip_high=loss.clip_high, dual_clip_c=loss.dual_clip_c,
        ratio_level=loss.ratio_level, aggregation=loss.aggregation, is_weights=x.is_weights,
        ref_logprobs=x.ref_logprobs, kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator,
        kl_clamp=loss.kl_clamp, norm_len=norm_len, entropy=entropy)


def local_denominator(aggregation: str, mask: Tensor) -> float:
    """This shard's part of the aggregation's denominator: tokens (token_mean) or non-empty sequences."""
    # mask: [B, T] effective loss mask
    if aggregation == "token_mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())
