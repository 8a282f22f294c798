"""Which families train.sequence_packing keeps exact on the torch backend, readable without torch (pre-flight).

Packing (policy/packing.py) calls the model with position ids that restart at every sequence and no attention
mask: transformers' mask functions (masking_utils.create_causal_mask and the sliding-window / chunked ones) then
build a block-diagonal causal mask from the position ids. A family whose model builds its mask without the position
ids (its own mask code, or a mask function called without them), or that carries a recurrent state from token to
token outside the Mamba-2 mixers policy/packing.py segments, lets each packed sequence attend to (or carry state
from) the ones before it in the row: logprobs silently off (tiny random models, the torch worker's packed logprobs
vs the unpacked HF forward: falcon 0.65 nats, bloom 0.23, opt 1.40, gpt_oss 1.42; qwen3_next's gated delta net
0.54, lfm2's short convolutions 0.20). Pre-flight refuses packing for these (policy/rules.py packing_gaps).

NO_PACKED_MASK: transformers 5.19's causal-LM families whose modeling file calls no mask function with the position
ids (tests/unit/test_families.py scans the installed transformers and fails on a family missing here).
RECURRENT: families with recurrent layers (Mamba mixers, gated delta nets, linear / lightning attention, short
convolutions, RG-LRU) that the torch path runs without per-sequence state (transformers takes `cu_seq_lens_q` /
`seq_idx` where it can, and packing passes neither); nemotron_h's Mamba-2 mixers are the ones packing segments.
"""

from __future__ import annotations

NO_PACKED_MASK = frozenset("""
    afmoe bart bert bert-generation big_bird bigbird_pegasus biogpt blenderbot blenderbot-small bloom camembert cpmant
    data2vec-text electra ernie falcon falcon_mamba fuyu gemma4_assistant gemma4_unified_assistant got_ocr2 gpt_oss
    granitemoehybrid mamba mamba2 marian mbart megatron-bert mpt musicgen musicgen_melody mvp openai-gpt opt pegasus
    plbart prophetnet reformer rembert roberta roberta-prelayernorm roc_bert roformer rwkv trocr xglm xlm xlm-roberta
    xlm-roberta-xl xlnet xlstm xmod""".split())
RECURRENT = frozenset("""
    bamba falcon_h1 inkling_text jamba kimi_linear lfm2 lfm2_moe minimax olmo_hybrid qwen3_5 qwen3_5_moe
    qwen3_5_moe_text qwen3_5_text qwen3_next qwen4_exp qwen4_exp_text recurrent_gemma zamba zamba2""".split())


def packing_refusal(family: str) -> str | None:
    """Why train.sequence_packing would train this model_type on logprobs other than its own (a sentence), or None."""
    if family in NO_PACKED_MASK:
        return (f"transformers' {family} builds its attention mask without the position ids, so packed sequences "
                "would attend to the sequences before them in their row")
    if family in RECURRENT:
        return (f"{family}'s recurrent layers would carry their state from one packed sequence into the next "
                "(policy/packing.py segments nemotron_h's Mamba-2 mixers only)")
    return None
