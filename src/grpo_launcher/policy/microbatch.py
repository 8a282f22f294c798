"""Token-budget micro-batches (dynamic batching) for the update and the logprob pass, both backends.

On with `train.dynamic_batching` (off: `fixed` row counts at the minibatch's length, as before). A micro-batch
costs its padded size: rows × its own longest row, as each is cut to its own longest sequence and
longest response (`trim`), not the minibatch's. The budget is what `train.micro_batch_size` (the logprob pass:
`train.logprob_batch_size`) rows of `train.max_total_sequence_length` tokens, with `rollout.max_new_tokens`
response positions each, hold: the very shape the memory pre-flight counts (preflight/memory_estimate.py:
activations over micro_batch_size × max_total_sequence_length tokens, the output layer over up to that many
positions, megatron's over micro_batch_size × max_new_tokens response positions). A batch of full-length rows is
cut exactly as fixed rows are, shorter rows fill a micro-batch up to the same bound, so the memory pre-flight's
figure holds unchanged, and micro_batch_size ≥ 1 (preflight/sizes.py positive_sizes) always admits one
full-length row.

Rows are taken longest first (`plan`): a micro-batch takes the next row while rows × its longest row and rows ×
its longest response stay within the budget. The loss is a sum over rows over GLOBAL denominators (algos/loss.py),
so any partition of the rows gives the same loss and gradients up to float summation order (1e-7 relative on
the default CPU run's first steps; a chaotic run amplifies that: benchmarks/results/step_phases.md); per-row
outputs come back in the batch's order (`restore`). Where ranks must run the same number of forwards (FSDP2's
collectives), `even_out` splits the largest micro-batches up to the count the busiest rank needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import torch
from torch import Tensor

from ..batch import TrainBatch

Groups = list[list[int]]  # row indices of each micro-batch, in the order they run
WIDTH_MULTIPLE = 16  # on GPUs, micro-batch widths are padded to a multiple of this (`widened`)


def plan(lengths: list[int], responses: list[int], rows: int, max_len: int, max_resp: int,
         granule: int = 1) -> Groups:
    """Micro-batches of at most rows × max_len padded tokens and rows × max_resp padded response positions each;
    a row longer than max_len (or max_resp) runs alone. granule > 1 (a Mamba-2 model's chunk size): lengths count
    as whole chunks, as its scan processes them (the pure-torch scan pads every row to whole chunks, the kernels
    keep per-chunk state), against a budget of rows × max_len rounded up the same way: the memory pre-flight's
    count (preflight/memory_shapes.py mamba_saved_bytes) holds for many short rows as for full-length ones."""
    whole = lambda n: -(-n // granule) * granule  # noqa: E731
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: Groups = []
    longest = resp = 0
    for i in order:
        g = groups[-1] if groups else None
        r = max(resp, responses[i])
        if g and (len(g) + 1) * longest <= rows * whole(max_len) and (len(g) + 1) * r <= rows * max_resp:
            g.append(i)
            resp = r
        else:
            groups.append([i])
            longest, resp = whole(lengths[i]), responses[i]
    return groups


def mamba_chunk(model: torch.nn.Module) -> int:
    """plan's granule for an HF model: 1 without Mamba-2 layers; with them, its config's chunk size (the hybrids'
    `mamba_chunk_size`: Bamba, Falcon-H1, GraniteMoeHybrid; `chunk_size` beside a Mamba2Mixer: NemotronH, Mamba2), 0
    where the config has none (fixed rows)."""
    hybrid = getattr(model.config, "mamba_chunk_size", None)
    if hybrid is not None:
        return int(hybrid or 0)
    if not any(type(m).__name__.endswith("Mamba2Mixer") for m in model.modules()):
        return 1
    return int(getattr(model.config, "chunk_size", 0) or 0)


def fixed(n: int, rows: int) -> Groups:
    """Consecutive rows, `rows` at a time (the fixed-count micro-batches)."""
    return [list(range(i, min(i + rows, n))) for i in range(0, n, rows)]


def even_out(groups: Groups, count: int) -> Groups:
    """Split the micro-batches with the most rows in two until there are `count` (≤ the number of rows)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups.pop(k)
        groups[k:k] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def lengths_of(b: TrainBatch) -> tuple[list[int], list[int]]:
    """(sequence lengths, response lengths) of the batch's rows."""
    n = b.attention_mask.sum(1)
    return n.tolist(), (n - b.prompt_lens.to(n.device)).tolist()


def padded_tokens(groups: Groups, lengths: list[int], cut: bool = True) -> int:
    """Tokens the forwards process: rows × the micro-batch's longest row (cut) or the batch's longest (not cut)."""
    top = max(lengths)
    return sum(len(g) * (max(lengths[i] for i in g) if cut else top) for g in groups)


def trim(b: TrainBatch) -> TrainBatch:
    """The micro-batch cut to its own longest sequence (right padding) and longest response (≥ 1 position)."""
    n = b.attention_mask.sum(1)
    L, T = int(n.max()), max(1, int((n - b.prompt_lens.to(n.device)).max()))
    out = {}
    for f in fields(b):
        x = getattr(b, f.name)
        if x is not None and x.dim() == 2:
            x = x[:, :L] if f.name in ("input_ids", "attention_mask") else x[:, :T]
        out[f.name] = x
    return TrainBatch(**out)


def take(b: TrainBatch, group: list[int], cut: bool, multiple: int = 1) -> TrainBatch:
    """One micro-batch's rows (cut to its own lengths where `cut`), its width padded up to a `multiple`."""
    idx = torch.tensor(group, device=b.input_ids.device)
    mb = b.select(idx)
    return widened(trim(mb) if cut else mb, multiple)


def widened(b: TrainBatch, multiple: int) -> TrainBatch:
    """The batch right-padded (attention 0) to a width that is a multiple of `multiple`. On GPUs (WIDTH_MULTIPLE):
    Triton specializes each compiled kernel on whether its integer arguments divide by 16, so a width that changes
    from step to step (each micro-batch cut to its own longest row) recompiles mamba-ssm's kernels for every new
    combination, seconds each (benchmarks/results/nemotron_gpu.md); a padded width compiles them once. The pad
    sits after every row's last token: causal attention and the Mamba scan never read it into a real position."""
    width = b.input_ids.shape[1]
    extra = -width % multiple
    if not extra:
        return b
    pad = lambda x: torch.nn.functional.pad(x, (0, extra))  # noqa: E731  (zeros: masked token ids)
    return dataclasses.replace(b, input_ids=pad(b.input_ids), attention_mask=pad(b.attention_mask))


def restore(parts: list[Tensor], groups: Groups, n: int, width: int) -> Tensor:
    """Per-micro-batch outputs [rows_k, T_k] back to the batch's order and width: [n, width] (0 past T_k)."""
    out = parts[0].new_zeros(n, width)
    for part, g in zip(parts, groups):
        out[torch.tensor(g, device=out.device), : part.shape[1]] = part
    return out
