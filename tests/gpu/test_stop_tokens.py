"""Stop tokens as the checkpoint defines them (issue 42, item 1): tokenizer EOS ∪ generation_config's eos_token_id.

Tiny checkpoints in the style of families whose end-of-turn token is listed only in generation_config.json (Qwen3,
Llama-3, Gemma-it, Phi-3), built with save_pretrained and a byte-level tokenizer carrying the family's special
tokens. Each model is made to say its end-of-turn token mid-answer: its greedy continuation is read first, then the
ids of the k-th greedy token and of the end-of-turn token are swapped in the embeddings (a relabelling: the model
computes the same function, only the two ids trade names), so greedy decoding emits the end-of-turn token at step k.
rollout=hf, at a temperature where sampling is greedy, must stop exactly where `transformers.generate` stops (before
this fix it stopped at the tokenizer's EOS only and ran every sample to rollout.max_new_tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_launcher.rollout.hf import HFEngine
from unit.test_stop_tokens import GREEDY, MAX_NEW
from unit.test_stop_tokens import checkpoints  # noqa: F401  (fixtures)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_hf_engine_on_cuda_stops_where_generate_stops(checkpoints, compiled):
    """The CUDA engine (transformers' generate; rollout.hf_compile: static cache + torch.compile) in fp32."""
    from transformers import AutoModelForCausalLM

    spec = dataclasses.replace(GREEDY, rollout=dataclasses.replace(GREEDY.rollout, hf_compile=compiled))
    for style in ("qwen3", "gemma_it"):
        d, prompt, turn_end = checkpoints[style]
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=MAX_NEW)[0, len(prompt):].tolist()
        gens = HFEngine(spec, str(d), torch.device("cuda", 0)).generate([prompt], 2, seed=1)
        assert [g.response_ids for g in gens] == [ref, ref] and ref[-1] == turn_end, (style, gens, ref)
