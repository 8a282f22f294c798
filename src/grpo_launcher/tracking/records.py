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
                       batch: TrainBatch, spec: RunSpec, tokenizer: Any, group_size: int,
                       scored: Sequence[Any] = ()) -> Iterator[dict[str, Any]]:
    """group_size: the Plan's (one prompt's samples, contiguous in `gens`); scored: each sample's envs.rewards.Scored
    (None or absent: the env gives no per-function rewards)."""
    G = group_size
    loss = per_token_loss(batch, spec)
    for i, g in enumerate(gens):
        n, p = len(g.response_ids), len(g.prompt_ids)
        zeros = [0.0] * p
        prompt, s = prompts[i // G], scored[i] if i < len(scored) else None
        yield {
            "step": step,
            "agent_ref": prompt.agent_ref,
            "row_id": prompt.source or None,  # "path/train.jsonl:12" for data rows; None for generated prompts
            "answer": prompt.answer,
            "completion": tokenizer.decode(g.response_ids, skip_special_tokens=True),  # as the reward saw it
            "reward_parts": dict(s.parts) if s is not None else {},  # reward function name → its value
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
