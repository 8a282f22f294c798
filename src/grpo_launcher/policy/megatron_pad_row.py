"""The input embedding's padding row, trained as the HF model trains it.

Most transformers families build `nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)`: the pad token's
lookup passes no gradient to its row (a tied output layer's gradient still reaches it), so the torch backend never
moves that row through the lookup. megatron-core's VocabParallelEmbedding has no padding_idx, so on the megatron
backend the row trained wherever the pad token was an input (a prompt, a packed or multi-turn sequence). With a
zero pad row (random models; some checkpoints) RMSNorm's gradient at 0 is ~1/sqrt(eps): step 1's grad norm read
2011 against the torch backend's 1.40 on a tiny Qwen3, and the clip to train.max_grad_norm scaled every other
gradient down by that factor (found by the family tester). freeze_lookup_row gives megatron's lookup HF's rule.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def hf_padding_idx(model_dir: str) -> Optional[int]:
    """The row the family's HF input embedding never trains through its lookup (its padding_idx), or None."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: the driver imports the policy modules

    with torch.device("meta"):  # the module tree only: no weights read, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return getattr(model.get_input_embeddings(), "padding_idx", None)


def freeze_lookup_row(model: Any, row: Optional[int]) -> bool:
    """The megatron model's word-embedding lookup of token `row` passes no gradient to the weight (its value
    unchanged); False where there is nothing to do (no such row, or no embedding on this pipeline stage)."""
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if row is None or emb is None:
        return False
    lookup = emb.forward

    def forward(input_: torch.Tensor) -> torch.Tensor:
        out = lookup(input_)  # [b, s, h], or [s/TP, b, h] this rank's part of the sequence (sequence parallel)
        hit = input_ == row  # [b, s]
        if emb.reduce_scatter_embeddings:
            n, rank = out.shape[0], dist.get_rank(emb.tp_group)
            hit = hit.transpose(0, 1)[rank * n:(rank + 1) * n]
        return torch.where(hit[..., None], out.detach(), out)

    emb.forward = forward
    return True
