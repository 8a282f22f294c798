"""Batch containers passed between the driver and the workers: the data types every room shares.

`Generation` is what every rollout backend returns per sample (the same fields from every path).
`TrainBatch` is the right-padded tensor form the policy workers consume: row i is prompt_i ++ response_i.
Imported by train/, policy/, rollout/, gym/ and tracking/; imports nothing of the package itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    response_ids: list[int]  # up to and including EOS (no EOS when truncated)
    logprobs: list[float]  # the engine's logprob of each response token
    truncated: bool  # hit max_new_tokens without EOS


@dataclass(frozen=True)
class TrainBatch:
    input_ids: Tensor  # [B, L] prompt ++ response, right-padded
    attention_mask: Tensor  # [B, L]
    prompt_lens: Tensor  # [B]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] 1 on real response tokens (token_loss_mask)
    generation_logprobs: Tensor  # [B, T]
    advantages: Tensor  # [B]
    sample_mask: Tensor  # [B] 0 = no loss for this sample (overlong filtering)
    prev_logprobs: Optional[Tensor] = None  # [B, T] the policy's logprobs before the update
    ref_logprobs: Optional[Tensor] = None  # [B, T] the reference policy's (when loss.kl_coef > 0)
    is_weights: Optional[Tensor] = None  # [B, T] rollout/training mismatch correction (detached)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor | slice) -> "TrainBatch":
        return TrainBatch(**{f.name: _take(getattr(self, f.name), rows) for f in fields(self)})

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self)})

    def with_(self, **changes: Optional[Tensor]) -> "TrainBatch":
        return replace(self, **changes)


def _take(x: Optional[Tensor], rows: Tensor | slice) -> Optional[Tensor]:
    return None if x is None else x[rows]


def collate(gens: list[Generation], advantages: Tensor, sample_mask: Tensor, pad_id: int) -> TrainBatch:
    """Generations → right-padded tensors. T = the longest response, L = the longest prompt+response."""
    B = len(gens)
    T = max(1, max(len(g.response_ids) for g in gens))
    L = max(len(g.prompt_ids) + len(g.response_ids) for g in gens)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    response = torch.full((B, T), pad_id, dtype=torch.long)
    rmask = torch.zeros((B, T), dtype=torch.float32)
    gen_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, g in enumerate(gens):
        seq = g.prompt_ids + g.response_ids
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        n = len(g.response_ids)
        if n:
            response[i, :n] = torch.tensor(g.response_ids)
            rmask[i, :n] = 1.0
            gen_lp[i, :n] = torch.tensor(g.logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention,
        prompt_lens=torch.tensor([len(g.prompt_ids) for g in gens]), response_ids=response,
        response_mask=rmask, generation_logprobs=gen_lp, advantages=advantages.float(),
        sample_mask=sample_mask.float())


def response_logits(logits: Tensor, prompt_lens: Tensor, T: int) -> Tensor:
    """Pick the logits that predict each response token: position prompt_len - 1 + j for token j."""
    # logits: [B, L, V]; prompt_lens: [B] -> [B, T, V]
    B, L, V = logits.shape
    steps = torch.arange(T, device=logits.device)
    idx = (prompt_lens.to(logits.device)[:, None] - 1 + steps[None, :]).clamp(min=0, max=L - 1)  # [B, T]
    return logits.gather(1, idx[:, :, None].expand(B, T, V))


def shard_rows(n: int, parts: int, part: int) -> slice:
    """Contiguous equal shard `part` of `n` rows over `parts` ranks (n % parts == 0 by validation)."""
    size = n // parts
    return slice(part * size, (part + 1) * size)
