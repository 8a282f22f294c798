"""train.sequence_packing on the torch backend: sequences laid end to end in rows of a fixed length.

Each row holds whole sequences (prompt ++ response) back to back, next-fit in batch order, then padding; the
position ids restart at 0 at every sequence. The model is called with those position ids and no attention mask:
transformers then builds a block-diagonal causal mask from where the position ids restart
(masking_utils.find_packed_sequence_indices; sdpa / eager / flex attention), so attention stays within each
sequence and rotary positions are the unpacked ones. Logprobs are gathered back to the [B, T] response layout,
so the loss, its denominators and the driver see the unpacked batch. Next-fit in order keeps every micro-batch a
contiguous slice of the minibatch (the update's per-micro-batch outputs concatenate in batch order).

Mamba-2 layers (model.family=nemotron_h) have no such mask: their recurrent state would run on from one
sequence into the next. `segment_mamba_mixers` gives each Mamba mixer a forward that takes the `mamba_segments`
keyword (`MambaSegments`). Where mamba-ssm's kernels run (CUDA; models/nemotron_h.py varlen_mamba), the mixer runs
on the packed rows with `seq_idx` [R, C], the sequence of each position: the Triton chunk scan (and causal-conv1d's
conv, the fused path, or the torch conv1d made seq_idx-aware) restart the state at every sequence, true varlen.
transformers' pure-torch scan takes no `seq_idx` (CPU, or no mamba-ssm): there the mixer runs on the sequences
themselves, as right-padded batches of similar lengths (causal: a sequence's outputs never see its padding), and
writes the outputs back in the packed layout; only the Mamba layers pay for padding, at most as many tokens again
as they hold, in groups of at most one row's tokens (`mamba_groups`). The attention and MoE layers keep the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..batch import TrainBatch
from ..models.nemotron_h import varlen_mamba


@dataclass(frozen=True)
class Packed:
    input_ids: Tensor  # [R, C] sequences end to end, then pad
    position_ids: Tensor  # [R, C] 0.. per sequence
    targets: Tensor  # [R, C] the next token where a response token is predicted, -1 elsewhere
    index: Tensor  # [B, T] flat position in R*C predicting response token j of sequence i (0 past its end)
    segments: MambaSegments | None  # pack(mamba=True) only


@dataclass(frozen=True)
class MambaSegments:
    """How the Mamba-2 mixers see the packed rows: `seq_idx` where the kernels take it, else padded groups."""

    seq_idx: Tensor | None  # [R, C] int32: the sequence of each position along its row (`sequence_index`)
    # per group: [S, L] flat position in R*C of token t of its sequence s (0 past its end), [S, L] True where that
    # token exists; empty where seq_idx is set
    groups: tuple[tuple[Tensor, Tensor], ...]


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


def pack(b: TrainBatch, capacity: int, pad_id: int = 0, mamba: bool = False) -> Packed:
    """The batch's sequences in rows of `capacity` tokens (each sequence fits: capacity ≥ L); with `mamba`, also
    how the Mamba layers see them (`segments`: seq_idx where the bound kernels take it, else per-sequence groups)."""
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
    flat = []  # the flat positions of each sequence's tokens
    start = 0
    for i, (n, p, r) in enumerate(zip(lengths, prompt, rows)):
        start = 0 if i == 0 or r != rows[i - 1] else start
        ids[r, start:start + n] = b.input_ids[i, :n]
        pos[r, start:start + n] = torch.arange(n, device=dev)
        targets[r, start + p - 1:start + n - 1] = b.input_ids[i, p:n]  # position p-1+j predicts response token j
        index[i, :n - p] = r * C + start + p - 1 + torch.arange(n - p, device=dev)
        flat.append(r * C + start + torch.arange(n, device=dev))
        start += n
    return Packed(ids, pos, targets, index, _mamba_segments(pos, lengths, flat, C) if mamba else None)


def _mamba_segments(pos: Tensor, lengths: list[int], flat: list[Tensor], capacity: int) -> MambaSegments:
    if pos.device.type == "cuda" and varlen_mamba():
        return MambaSegments(sequence_index(pos), ())
    return MambaSegments(None, tuple(_padded([flat[i] for i in g]) for g in mamba_groups(lengths, capacity)))


def sequence_index(pos: Tensor) -> Tensor:
    """[R, C] position ids → [R, C] int32 seq_idx: the sequence of each position along its row, a new one where the
    position restarts at 0 (a row's trailing padding keeps counting on: its last sequence's, inert as it is causal)."""
    return torch.cumsum((pos == 0).int(), 1, dtype=torch.int32) - 1


def mamba_groups(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequences grouped for the Mamba layers' padded batches: longest first, a group takes the next sequence while
    its padded size stays within `capacity` and that sequence is at least half the group's longest (so padding
    never exceeds the tokens it pads)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * lengths[g[0]] <= capacity and 2 * lengths[i] >= lengths[g[0]]:
            g.append(i)
        else:
            groups.append([i])
    return groups


def _padded(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """[S, Lmax] positions (0 as padding) and the [S, Lmax] mask of real ones."""
    index = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    n = torch.tensor([len(r) for r in rows], device=index.device)
    return index, torch.arange(index.shape[1], device=index.device) < n[:, None]


def unpack(out: Tensor, p: Packed) -> Tensor:
    """Per-position outputs of the packed rows → the response layout."""
    # out: [R, C, X] -> [B, T, X]
    return out.flatten(0, 1)[p.index]


SEGMENTS = "mamba_segments"  # the model's keyword (transformers hands a model's extra keywords to its mixers)


def segment_mamba_mixers(model: torch.nn.Module) -> int:
    """Give every Mamba-2 mixer of the model the per-sequence forward (`_segmented`); returns how many. The class
    is swapped as FSDP2 does it: parameters and state dict unchanged, a deepcopy keeps it, and activation
    checkpointing recomputes with the same keyword."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if cls.__name__.endswith("Mamba2Mixer") and not getattr(cls, "per_sequence", False):
            m.__class__ = _segmented(cls)
            n += 1
    return n


_SEGMENTED: dict[type[torch.nn.Module], type[torch.nn.Module]] = {}  # one subclass per mixer class


def _segmented(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    if cls in _SEGMENTED:
        return _SEGMENTED[cls]

    def forward(self: torch.nn.Module, hidden_states: Tensor, *args: Any, mamba_segments: MambaSegments | None = None,
                **kwargs: Any) -> Tensor:
        if mamba_segments is None:
            return cls.forward(self, hidden_states, *args, **kwargs)
        kwargs.pop("attention_mask", None)  # each group brings its own; the packed rows' padding is causal: inert
        if mamba_segments.seq_idx is not None:  # the kernels restart the state at every sequence
            return cls.forward(self, hidden_states, *args, seq_idx=mamba_segments.seq_idx, **kwargs)
        R, C, _ = hidden_states.shape  # [R, C, H] packed rows
        x = hidden_states.flatten(0, 1)
        at, ys = [], []
        for index, mask in mamba_segments.groups:  # [S, L] each
            y = cls.forward(self, x[index], *args, attention_mask=mask, **kwargs)  # [S, L, H]
            at.append(index[mask])
            ys.append(y[mask])
        y = torch.cat(ys)
        # a row's trailing padding gets 0 (nothing real attends to it)
        return y.new_zeros(R * C, y.shape[-1]).index_put((torch.cat(at),), y).view(R, C, -1)

    _SEGMENTED[cls] = type(cls.__name__, (cls,), {"forward": forward, "per_sequence": True, "__module__": __name__})
    return _SEGMENTED[cls]
