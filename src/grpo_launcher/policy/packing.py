"""train.sequence_packing on the torch backend: sequences laid end to end in rows of a fixed length.

Each row holds whole sequences (prompt ++ response) back to back, next-fit in batch order, then padding; the
position ids restart at 0 at every sequence. The model is called with those position ids and no attention mask:
transformers then builds a block-diagonal causal mask from where the position ids restart
(masking_utils.find_packed_sequence_indices; sdpa / eager / flex attention), so attention stays within each
sequence and rotary positions are the unpacked ones. Logprobs are gathered back to the [B, T] response layout,
so the loss, its denominators and the driver see the unpacked batch. Next-fit in order keeps every micro-batch a
contiguous slice of the minibatch (the update's per-micro-batch outputs concatenate in batch order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import TrainBatch


@dataclass(frozen=True)
class Packed:
    input_ids: Tensor  # [R, C] sequences end to end, then pad
    position_ids: Tensor  # [R, C] 0.. per sequence
    targets: Tensor  # [R, C] the next token where a response token is predicted, -1 elsewhere
    index: Tensor  # [B, T] flat position in R*C predicting response token j of sequence i (0 past its end)


def next_fit_rows(lengths: list[int], capacity: int) -> list[int]:
    """The row of each sequence when packed next-fit in order into rows of `capacity` tokens."""
    rows: list[int] = []
    used = capacity
    for n in lengths:
        if used + n > capacity:
            rows.append(len(rows) and rows[-1] + 1)
            used = 0
        else:
            rows.append(rows[-1])
        used += n
    return rows


def packed_slices(lengths: list[int], capacity: int, rows_per_batch: int) -> list[slice]:
    """Contiguous slices of the sequences whose packing fills at most `rows_per_batch` rows each."""
    rows = next_fit_rows(lengths, capacity)
    bounds = [i for i in range(1, len(rows)) if rows[i] // rows_per_batch != rows[i - 1] // rows_per_batch]
    edges = [0, *bounds, len(rows)]
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


def pack(b: TrainBatch, capacity: int, pad_id: int = 0) -> Packed:
    """The batch's sequences in rows of `capacity` tokens (each sequence fits: capacity ≥ L)."""
    # b.input_ids: [B, L] right-padded; -> Packed with R rows of C = capacity
    lengths = b.attention_mask.sum(1).tolist()
    prompt = b.prompt_lens.tolist()
    rows = next_fit_rows(lengths, capacity)
    R, C, T = rows[-1] + 1, capacity, b.response_ids.shape[1]
    dev = b.input_ids.device
    ids = torch.full((R, C), pad_id, dtype=torch.long, device=dev)
    # a row's padding (always at its end) keeps these positions: causal attention never lets a token before it see it
    pos = torch.arange(C, device=dev).repeat(R, 1)
    targets = torch.full((R, C), -1, dtype=torch.long, device=dev)
    index = torch.zeros(len(b), T, dtype=torch.long, device=dev)
    start = 0
    for i, (n, p, r) in enumerate(zip(lengths, prompt, rows)):
        start = 0 if i == 0 or r != rows[i - 1] else start
        ids[r, start:start + n] = b.input_ids[i, :n]
        pos[r, start:start + n] = torch.arange(n, device=dev)
        targets[r, start + p - 1:start + n - 1] = b.input_ids[i, p:n]  # position p-1+j predicts response token j
        index[i, :n - p] = r * C + start + p - 1 + torch.arange(n - p, device=dev)
        start += n
    return Packed(ids, pos, targets, index)


def unpack(out: Tensor, p: Packed) -> Tensor:
    """Per-position outputs of the packed rows → the response layout."""
    # out: [R, C, X] -> [B, T, X]
    return out.flatten(0, 1)[p.index]
