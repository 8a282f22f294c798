"""The per-step training-data records (the seed's richer log): one dict per sample, same fields on every path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from .. import algos
from ..spec.schema import RunSpec

if TYPE_CHECKING:
    from ..batch import Generation, TrainBatch
    from ..envs.base import Prompt


def per_token_loss(batch: TrainBatch, spec: RunSpec) -> torch.Tensor:
    """Each response token's loss at the start of the update (ratio 1), same math as the policy workers."""
    x = algos.LossInputs.of(batch, batch.prev_logprobs)
    _, per_token, _ = algos.spec_policy_loss(batch.prev_logprobs, x, spec.loss, norm_len=spec.rollout.max_new_tokens)
    return per_token * batch.response_mask * batch.sample_mask[:, None]


def train_data_records(step: int, prompts: Sequence[Prompt], gens: Sequence[Generation], rewards: Sequence[float],
                       batch: TrainBatch, spec: RunSpec, tokenizer: Any, group_size: int) -> Iterator[dict[str, Any]]:
    """group_size: the Plan's (one prompt's samples, contiguous in `gens`)."""
    G = group_size
    loss = per_token_loss(batch, spec)
    for i, g in enumerate(gens):
        n, p = len(g.response_ids), len(g.prompt_ids)
        zeros = [0.0] * p
        yield {
            "step": step,
            "agent_ref": prompts[i // G].agent_ref,
            "content": tokenizer.decode(g.prompt_ids + g.response_ids, skip_special_tokens=False),
            "rewards": float(rewards[i]),
            "token_ids": g.prompt_ids + g.response_ids,
            "token_loss_mask": [0] * p + [1] * n,
            "sample_loss_mask": int(batch.sample_mask[i]),
            "advantages": float(batch.advantages[i]),
            "generation_logprobs": zeros + g.logprobs,
            "prev_logprobs": zeros + batch.prev_logprobs[i, :n].tolist(),
            "token_loss": zeros + loss[i, :n].tolist(),
            "truncated": bool(g.truncated),
        }
