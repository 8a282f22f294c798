"""The names vLLM's `load_weights` reads: a checkpoint file's, not a transformers module's.

transformers 5 fuses in memory what some families' files keep apart: MoE experts stacked `[E, ...]` under one
name (`model.layers.1.mixer.experts.up_proj` for nemotron_h, `mlp.experts.gate_up_proj` for qwen3_moe) where the
files hold one tensor per expert (`backbone.layers.1.mixer.experts.0.up_proj.weight`). A policy's weights are
named the first way (the torch backend's state_dict; megatron's `to_hf`), and vLLM loads the second: a refit
with in-memory names stops at the first expert (`KeyError: 'layers.1.mixer.experts.up_proj'`, nemotron_h_1b on a
GPU). `CheckpointNames` turns one into the other with transformers' own conversion mapping (the one
`save_pretrained` reverts), tensor by tensor, so a refit still streams.

Tied weights: a tied model's file holds the source only (`model.embed_tokens.weight`), the state dict both names.
Where vLLM's model has no `lm_head` module at all (VLLM_HEADLESS: its logits reuse the embedding) the alias is not
sent: the first refit of a tied gemma2 stopped at "There is no module or parameter named 'lm_head'". Elsewhere it
is: vLLM 0.32's in-place reload leaves a tied llama / qwen3 head on the start-up dummy weights unless
`lm_head.weight` comes too (0.67 nats off, benchmarks/results/families.md). Over CUDA IPC to a family the engine
loads directly (`vllm_compat.DIRECT_REFIT`, no layerwise reload) it is not sent either (`ipc=True`): the copy into
the embedding is the head's (one Parameter), and vLLM's tied models skip `lm_head.*` on load.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from .vllm_compat import DIRECT_REFIT

Item = tuple[str, torch.Tensor]
# model_type: vLLM 0.32's causal LM computes its logits from model.embed_tokens and has no lm_head (gemma2.py,
# commandr.py, cohere2_moe.py)
VLLM_HEADLESS = ("gemma2", "cohere", "cohere2", "cohere2_moe")


class CheckpointNames:
    """Built once per model dir (a model on the meta device: no memory); call it on (name, tensor) pairs."""

    def __init__(self, model_dir: str, ipc: bool = False):
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        self.renamed: dict[str, str] = {}  # in-memory name → file name, where only the name changes
        for name, t in self.model.state_dict().items():
            out = revert_weight_conversion(self.model, {name: t})
            if len(out) == 1 and next(iter(out.values())).shape == t.shape:
                self.renamed[name] = next(iter(out))
        # alias -> source where the config ties them (lm_head.weight -> model.embed_tokens.weight); {} when untied
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        kind = self.model.config.model_type
        self.tied = set(tied) if kind in VLLM_HEADLESS or (ipc and kind in DIRECT_REFIT) else set()

    def __call__(self, items: Iterable[Item]) -> Iterator[Item]:
        for name, t in items:
            if name in self.tied:  # an alias of the embedding, which vLLM's headless model reads its logits from
                continue
            if name in self.renamed:
                yield self.renamed[name], t
            else:  # a fused tensor: split as save_pretrained splits it (views of `t`)
                yield from revert_weight_conversion(self.model, {name: t}).items()
