"""The family conformance matrix: a tiny random model of each transformers causal-LM family users bring, built with
save_pretrained from the family's own config class with its quirks (logit softcapping and scaling, tied embeddings,
an explicit head_dim, biases, partial rotary), checked through the product's own code paths on the CPU in fp32:

- pre-flight accepts the directory (model.path) and the plan names the logprob head the worker builds;
- the policy worker's logprobs and entropies, through the chunked head (the default), through whole logits and over
  packed sequences, equal log_softmax of the model's own HF forward (≤ 1e-5), and the hf engine's sampling logprobs
  equal them;
- one on-policy update gives the same loss and gradients through either head;
- the trained weights, saved as a checkpoint and exported (`launch.py export`), reload to the same logits.

Plus the registry of logit post-processings (logit_heads.py) against transformers' own modeling code, and the
Gemma-2 metric train/gen_vs_policy_logprob_absdiff with the default settings (issue 42: it read 1.54 nats)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_launcher.algos import entropy_from_logits
from grpo_launcher.batch import collate
from grpo_launcher.checkpoint import CheckpointManager
from grpo_launcher.export import export
from grpo_launcher.logit_heads import FAMILY_LOGITS, SOFTCAP, head_choice, head_for, unreproduced_keys
from grpo_launcher.models.attention import hf_attention
from grpo_launcher.models.tiny import build_tokenizer
from grpo_launcher.policy.packing_families import NO_PACKED_MASK, RECURRENT, packing_refusal
from grpo_launcher.policy.torch_policy import LogprobHead, TorchPolicyWorker
from grpo_launcher.rollout.hf import HFEngine
from grpo_launcher.runfiles import write_atomic
from grpo_launcher.spec.compose import load_spec, spec_to_yaml
from grpo_launcher.spec.errors import ConfigError
from nemotron_tiny import CONFIG as NEMOTRON_H

TOL = 1e-5  # fp32 on the CPU
VOCAB = 288  # the byte-level tokenizer's 259 tokens, rounded up
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
# model_type -> its quirks (on COMMON); head_dim 32 where transformers would derive 64 / 4 = 16
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(head_dim=32, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32),
    "mistral": dict(head_dim=32, sliding_window=8),
    "gemma": dict(head_dim=32),  # tied, embeddings scaled by sqrt(hidden)
    "gemma2": dict(head_dim=32, final_logit_softcapping=2.0, attn_logit_softcapping=5.0, query_pre_attn_scalar=16,
                   sliding_window=8),
    "gemma3_text": dict(head_dim=32, final_logit_softcapping=3.0, sliding_window=8),
    "phi": dict(partial_rotary_factor=0.5, qk_layernorm=True),  # lm_head with a bias
    "phi3": dict(),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1),
    "cohere": dict(logit_scale=3.0),  # tied
    "olmo2": dict(),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),  # tied, Conv1D layers
    "gpt_neox": dict(rotary_pct=0.5),  # embed_out, untied
    "stablelm": dict(partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True),
    "nemotron_h": {**NEMOTRON_H, "vocab_size": VOCAB, "initializer_range": 0.1},  # Mamba-2 / attention / MoE
    # MoE (transformers 5's stacked experts; per-expert names in the export)
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, logits_scaling=4.0, embedding_multiplier=2.0),
    "gpt_oss": dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,  # attention sinks
                    layer_types=["sliding_attention", "full_attention"]),
    "cohere2": dict(logit_scale=0.5, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),  # NoPE
    "smollm3": dict(),  # NoPE every 4th layer, tied
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.5),
    "gptj": dict(rotary_dim=8),  # lm_head with a bias, interleaved rotary
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),  # packing refused: its mask ignores position ids
    "bloom": dict(n_head=4),  # ALiBi, tied; packing refused
    "bamba": dict(attn_layer_indices=[1], mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32),  # Mamba-2 + attention
    "jamba": dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,  # Mamba-1, MoE
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8),
    "falcon_h1": dict(head_dim=32, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,  # parallel
                      lm_head_multiplier=0.5),  # Mamba-2 + attention in every layer, logits scaled
    "phimoe": dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, lm_head_bias=True, attention_bias=True),
    "llama_rope_llama3": dict(head_dim=32, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
}
VARIANTS = {"llama_rope_llama3": "llama"}  # FAMILIES name -> model_type where they differ
PROMPTS = ["1234>", "98765>"]  # two prompt lengths: padded rows
SMALL = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "train.global_batch_size=4",
         "train.micro_batch_size=2", "train.logprob_batch_size=4", "rollout.max_new_tokens=6", "logging.mlflow=false"]


def build(root: Path, family: str) -> Path:
    """DIR/family: config.json + model.safetensors (a random model, seed 0) + the byte-level tokenizer."""
    out = root / family
    tok = build_tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    base = {} if family == "nemotron_h" else COMMON
    cfg = AutoConfig.for_model(VARIANTS.get(family, family), **{**base, **FAMILIES[family], **ids})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    head = model.get_output_embeddings()
    if head.bias is not None:  # transformers initialises it to zeros: a bias the head dropped would go unseen
        torch.nn.init.normal_(head.bias, std=1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@dataclasses.dataclass
class Family:
    """One family's workers (chunked head, whole logits), a batch the engine sampled, and the HF reference."""

    name: str
    dir: Path
    root: Path

    def __post_init__(self) -> None:
        spec = load_spec([f"model.path={self.dir}", f"output_root={self.root / 'out'}", f"name={self.name}", *SMALL])
        whole = dataclasses.replace(spec, train=dataclasses.replace(spec.train, logprob_chunk_tokens=0))
        self.spec = spec
        self.chunked = TorchPolicyWorker(spec, str(self.dir), 0, 1)
        self.whole = TorchPolicyWorker(whole, str(self.dir), 0, 1)
        tok = self.chunked.engine.tokenizer
        gens = self.chunked.generate([tok(p)["input_ids"] for p in PROMPTS], 2, seed=3)
        self.batch = collate(gens, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(len(gens)), tok.pad_token_id)
        self.mask = self.batch.response_mask.bool()
        self.ref_lp, self.ref_ent = hf_reference(self.dir, self.batch, spec.rollout.temperature)
        self._updated: dict[str, Any] | None = None

    def updated(self) -> dict[str, Any]:
        """One on-policy update on each worker; the gradients each had before its optimizer step."""
        if self._updated is None:
            grads: dict[str, dict[str, torch.Tensor]] = {"chunked": {}, "whole": {}}
            for kind, w in (("chunked", self.chunked), ("whole", self.whole)):  # the gradients before the step
                w.opt.register_step_pre_hook(lambda *_, w=w, kind=kind: grads[kind].update(
                    {k: p.grad.clone() for k, p in w.model.named_parameters() if p.grad is not None}))
            den = [float(self.batch.response_mask.sum())]
            self._updated = {"chunked": self.chunked.update([self.batch], den),
                             "whole": self.whole.update([self.batch], den), "grads": grads}
        return self._updated


def hf_reference(model_dir: Path, batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, T], entropy [B, T]) of the response tokens from a fresh HF model's own forward, one unpadded
    sequence at a time. Eager attention: the model as its modeling file defines it (transformers' default sdpa
    drops Gemma-2's attn_logit_softcapping)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    lp, ent = torch.zeros(batch.response_ids.shape), torch.zeros(batch.response_ids.shape)
    for i in range(len(batch)):
        n, p = int(batch.attention_mask[i].sum()), int(batch.prompt_lens[i])
        with torch.no_grad():
            logits = model(batch.input_ids[i:i + 1, :n]).logits[0, p - 1:n - 1].float() / temperature  # [T_i, V]
        t = n - p
        lp[i, :t] = logits.log_softmax(-1).gather(-1, batch.input_ids[i, p:n, None]).squeeze(-1)
        ent[i, :t] = entropy_from_logits(logits)
    return lp, ent


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Family objects built on first use, shared by every test of the module."""
    root = tmp_path_factory.mktemp("families")
    made: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in made:
            made[name] = Family(name, build(root / "models", name), root)
        return made[name]

    return get


def worst(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).detach()[mask].abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_equals_the_hf_forward(families, family):
    """The default head: logprobs and entropies (the update's own _token_stats) = log_softmax of HF's logits;
    the plan's head line is what the worker built."""
    f = families(family)
    head = f.chunked.model.get_output_embeddings()
    assert isinstance(head, LogprobHead) and f.chunked.head == head_for(str(f.dir), family, 4096)
    assert (head.transform is not None) == (family in FAMILY_LOGITS)
    lp, ent = f.chunked._token_stats(f.chunked.model, f.batch, entropy=True)
    assert worst(lp, f.ref_lp, f.mask) <= TOL and worst(ent, f.ref_ent, f.mask) <= TOL
    assert worst(f.chunked.logprobs(f.batch)[0], f.ref_lp, f.mask) <= TOL  # the separate logprob pass


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_logits_equal_the_hf_forward(families, family):
    f = families(family)
    assert type(f.whole.model.get_output_embeddings()) is torch.nn.Linear
    lp, ent = f.whole._token_stats(f.whole.model, f.batch, entropy=True)
    assert worst(lp, f.ref_lp, f.mask) <= TOL and worst(ent, f.ref_ent, f.mask) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_equal_the_hf_forward(families, family):
    """train.sequence_packing=true (the rows packed into one, a block-diagonal mask from the position ids; Mamba
    layers per sequence): the chunked head's logprobs and entropies still equal the unpadded HF forward's."""
    f = families(family)
    spec = dataclasses.replace(f.spec, train=dataclasses.replace(f.spec.train, sequence_packing=True))
    w = TorchPolicyWorker(spec, str(f.dir), 0, 1)
    lp, ent = w._token_stats(w.model, f.batch, entropy=True)
    if packing_refusal(VARIANTS.get(family, family)) is None:
        assert worst(lp, f.ref_lp, f.mask) <= TOL and worst(ent, f.ref_ent, f.mask) <= TOL
        return
    # its mask ignores the position ids (falcon 0.65 nats, bloom 0.23) or its recurrent layers run on across the
    # sequences (bamba 0.26, jamba 0.50): pre-flight refuses packing, naming the keys
    assert worst(lp, f.ref_lp, f.mask) > 100 * TOL
    with pytest.raises(ConfigError) as info:
        load_spec([f"model.path={f.dir}", f"output_root={f.root / 'out'}", "train.sequence_packing=true", *SMALL])
    (v,) = [v for v in info.value.violations if "sequence packing on" in v.message]
    assert v.keys == ("train.sequence_packing", "model.path") and v.message.endswith(packing_refusal(family))


@functools.cache
def _modeling_texts() -> tuple[str, ...]:
    """The installed transformers' modeling_*.py sources (read once for the scans below)."""
    return tuple(p.read_text() for p in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"))


def _packed_mask_families() -> set[str]:
    """Causal-LM model_types of the installed transformers whose modeling file passes the position ids to every
    mask-function call (directly, or in the kwargs dict it spreads): where packing's block-diagonal mask is built."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def args(text: str, i: int) -> str:  # the balanced (...) / {...} from just after its opening bracket
        depth, start = 1, i
        while depth:
            depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(text[i], 0)
            i += 1
        return text[start:i]

    def passes_positions(text: str, call: str) -> bool:
        spread = re.search(r"\*\*(\w+)", call)
        name = spread.group(1) if spread else ""
        copied = re.search(rf"\b{name}\s*=\s*(\w+)\.copy\(\)", text) if name else None
        name = copied.group(1) if copied else name
        made = re.search(rf"\b{name}\s*=\s*(dict\(|\{{)", text) if name else None
        return "position_ids" in call or bool(made and "position_ids" in args(text, made.end()))

    texts = _modeling_texts()
    call = re.compile(r"\b(create_(?!bidirectional)\w*mask|create_masks_for_generate|mask_function)\(")
    out = set()
    for family, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        text = next((t for t in texts if f"\nclass {cls}(" in t), "")
        calls = [c for c in (args(text, m.end()) for m in call.finditer(text)) if "embeds" in c or "**" in c]
        if calls and all(passes_positions(text, c) for c in calls):
            out.add(family)
    return out


def test_packing_is_refused_where_transformers_builds_no_packed_mask():
    """Every causal LM of the installed transformers that builds its mask without the position ids is in
    NO_PACKED_MASK (a transformers upgrade that adds one fails here until it is listed); the families the matrix
    packs exactly are not."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    packs = _packed_mask_families()
    assert {"llama", "qwen2", "gemma2", "gemma3_text", "gpt2", "mistral", "nemotron_h"} <= packs
    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - packs <= NO_PACKED_MASK | RECURRENT
    assert {"falcon", "bloom", "opt", "gpt_oss"} <= NO_PACKED_MASK
    layer = re.compile(r"\nclass \w*(Mixer|GatedDeltaNet|LinearAttention|ShortConv|LightningAttention|Rglru)\w*\(")
    texts = _modeling_texts()
    recurrent = {family for family, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                 if layer.search(next((t for t in texts if f"\nclass {cls}(" in t), ""))}
    assert {"qwen3_next", "lfm2", "jamba", "nemotron_h"} <= recurrent
    assert recurrent - {"nemotron_h"} <= RECURRENT | NO_PACKED_MASK  # nemotron_h: policy/packing.py segments it
    assert not {VARIANTS.get(f, f) for f in FAMILIES} & NO_PACKED_MASK - {"falcon", "bloom", "gpt_oss"}
    assert not {VARIANTS.get(f, f) for f in FAMILIES} & RECURRENT - {"bamba", "jamba", "falcon_h1"}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_samples_with_the_hf_forwards_logprobs(families, family):
    """rollout=hf's sampling logprobs (the engine shares the chunked worker's model on the CPU)."""
    f = families(family)
    assert f.mask.sum() > 0
    assert worst(f.batch.generation_logprobs, f.ref_lp, f.mask) <= TOL


def test_longrope_samples_and_trains_on_the_factors_vllm_picks(tmp_path):
    """Phi-3's longrope: transformers picks short or long factors per forward from that call's longest position, so
    rollout=hf's KV-cached decode kept prompt keys on the short factors past original_max_position_embeddings while
    the policy's whole-sequence forward ran the long: 0.65 nats apart, exit 0 (found by the family tester). Both now
    run the factors vLLM picks for the run (long: max_model_len > original), whatever a forward's width."""
    from grpo_launcher.models.rope import PINNED

    tok = build_tokenizer()
    half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    rope = dict(rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=8,
                short_factor=[1.0 + i / half for i in range(half)], long_factor=[4.0 + 2 * i for i in range(half)])
    cfg = AutoConfig.for_model("phi3", **COMMON, rope_parameters=rope, original_max_position_embeddings=8,
                               pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "phi3_lr")
    tok.save_pretrained(tmp_path / "phi3_lr")
    f = Family("phi3_lr", tmp_path / "phi3_lr", tmp_path)  # prompts of 6-7 tokens, 6 new: past 8 while decoding
    assert f.chunked.model.config.rope_parameters["original_max_position_embeddings"] == 8
    assert {m.rope_type for m in f.chunked.model.modules() if hasattr(m, "inv_freq")} == {PINNED}
    assert worst(f.batch.generation_logprobs, f.chunked.logprobs(f.batch)[0], f.mask) <= TOL
    long = f.batch.attention_mask.sum(1) > 8  # HF's own forward runs the long factors on these rows whole
    assert long.any() and worst(f.batch.generation_logprobs[long], f.ref_lp[long], f.mask[long]) <= TOL
    ids = torch.arange(3, 15).view(1, 12)
    with torch.no_grad():  # a prefix's logits do not depend on how long the forward is (6 vs 12 positions)
        short, within = f.whole.model(ids[:, :6]).logits, f.whole.model(ids).logits[:, :6]
    assert float((short - within).abs().max()) <= TOL


@pytest.mark.parametrize("family", sorted(set(FAMILIES) & set(FAMILY_LOGITS)))
def test_the_post_processing_matters_here(families, family):
    """Without its logit post-processing the family's logprobs move by far more than TOL: the checks above see it."""
    f = families(family)
    key, kind, _ = FAMILY_LOGITS[family]
    model = AutoModelForCausalLM.from_pretrained(f.dir, dtype=torch.float32).eval()
    setattr(model.config, key, None if kind == SOFTCAP else 1.0)
    for holder in (model, model.model):  # Cohere keeps its own copy, Falcon-H1 its base model's
        if hasattr(holder, key):
            setattr(holder, key, 1.0)
    i, n, p = 0, int(f.batch.attention_mask[0].sum()), int(f.batch.prompt_lens[0])
    with torch.no_grad():
        lp = model(f.batch.input_ids[:1, :n]).logits[0, p - 1:n - 1].log_softmax(-1)
    plain = lp.gather(-1, f.batch.input_ids[i, p:n, None]).squeeze(-1)
    assert (plain - f.ref_lp[i, :n - p]).abs().max() > 100 * TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_an_update_is_the_same_through_either_head(families, family):
    """On-policy: the update's own old logprobs = HF's; loss, entropy and every gradient match whole logits."""
    f = families(family)
    u = f.updated()
    a, b = u["chunked"], u["whole"]
    assert worst(a["prev_logprobs"], f.ref_lp, f.mask) <= TOL
    m = f.batch.response_mask  # train/gen_vs_policy_logprob_absdiff as train/driver.py computes it
    assert float(((a["prev_logprobs"] - f.batch.generation_logprobs).abs() * m).sum() / m.sum()) <= TOL
    for k in ("loss", "entropy", "grad_norm"):
        assert abs(a[k] - b[k]) <= TOL, k
    ga, gb = u["grads"]["chunked"], u["grads"]["whole"]
    assert ga and ga.keys() == gb.keys()
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6), name


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_to_the_trained_logits(families, family):
    """The trained weights (a checkpoint as the driver saves it, then `launch.py export`) load with
    AutoModelForCausalLM and give the policy's own logits."""
    f = families(family)
    f.updated()
    run_dir = f.root / "out" / f"run-{family}"
    run_dir.mkdir(parents=True)
    write_atomic(run_dir / "spec.yaml", spec_to_yaml(f.spec))
    CheckpointManager(run_dir / "checkpoints", f.spec).save(1, f.chunked.save, {}, {})
    out = export(run_dir, dtype="saved")  # the fp32 master weights as saved (the CLI's default is bf16)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **hf_attention(str(out))).eval()
    ids, attn = f.batch.input_ids, f.batch.attention_mask
    with torch.no_grad():
        want = f.chunked.model(input_ids=ids, attention_mask=attn).logits
        got = reloaded(input_ids=ids, attention_mask=attn).logits
    assert (got - want)[attn.bool()].abs().max() <= TOL
    moved = AutoModelForCausalLM.from_pretrained(f.dir, dtype=torch.float32)(input_ids=ids, attention_mask=attn).logits
    assert (moved - want)[attn.bool()].abs().max() > TOL  # the update changed them: the export carries its weights


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stops_at_the_generation_configs_eos_list(families, family, tmp_path):
    """generation_config.json's eos_token_id list (Llama-3, Qwen3, Gemma-it: the end-of-turn token there): rollout=hf
    stops at its first listed token, keeps it, and samples the same tokens up to it (same seed)."""
    f = families(family)
    tok = f.chunked.engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    free = f.chunked.engine.generate(prompts, 4, seed=5)  # stops at the tokenizer's EOS only
    extra = Counter(t for g in free for t in g.response_ids[:-1]).most_common(1)[0][0]  # sampled before an end
    d = tmp_path / family
    shutil.copytree(f.dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, extra]}))
    engine = HFEngine(f.spec, str(d), torch.device("cpu"), model=f.chunked.model)
    assert engine.stop_ids == (tok.eos_token_id, extra)
    cut = engine.generate(prompts, 4, seed=5)
    for a, b in zip(free, cut):
        end = next((i + 1 for i, t in enumerate(a.response_ids) if t in engine.stop_ids), None)
        assert b.response_ids == a.response_ids[:end] and b.truncated == (end is None)
    assert any(b.response_ids[-1] == extra for b in cut)


# ------------------------------------------------------------------ the registry against transformers


def test_registry_defaults_are_transformers_own():
    """A config.json without the key: the default FAMILY_LOGITS assumes is the config class's."""
    from transformers import CONFIG_MAPPING

    for family, (key, _, default) in FAMILY_LOGITS.items():
        cfg = CONFIG_MAPPING[family]().get_text_config()
        assert getattr(cfg, key) == default, family


def _causal_lm_sources() -> dict[str, str]:
    """model_type -> the source of its *ForCausalLM forward after the output layer's call (transformers' files)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    texts = _modeling_texts()
    out = {}
    for family, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for text in texts:
            start = text.find(f"\nclass {cls}(")
            if start >= 0:
                end = text.find("\nclass ", start + 1)
                body = text[start:end if end > 0 else None]
                forward = body[body.find("def forward"):]
                if "lm_head(" in forward:
                    out[family] = forward[forward.find("lm_head("):][:1500]
                break
    return out


# families whose forward post-processes the logits in a way FAMILY_LOGITS leaves to whole logits: their key
UNREGISTERED = {"xlstm": "output_logit_soft_cap", "cohere_compass_text": "logit_scale"}
POST = re.compile(r"logits\s*=\s*logits\s*[*/]|tanh|lm_head\([^\n]*\)\s*[*/]|logits\s*[*/]=|logits\[[^\n]*\]\s*=")


def test_every_logit_post_processing_in_transformers_is_reproduced_or_left_to_whole_logits():
    """Scans transformers' causal LMs: each forward that changes the logits after lm_head is in FAMILY_LOGITS with
    its key and operation, or its key makes head_choice take whole logits. A transformers upgrade that adds one
    fails here until it is listed."""
    sources = _causal_lm_sources()
    ops = {"softcap": "tanh", "multiply": "*", "divide": "/"}
    found = {family for family, src in sources.items() if POST.search(src)}
    assert {"gemma2", "granite", "cohere"} <= found
    for family in found:
        if family in UNREGISTERED:
            key = UNREGISTERED[family]
            assert key in sources[family] and unreproduced_keys({"model_type": family, key: 2.0}), family
            assert head_choice({"model_type": family, key: 2.0}, 4096).chunk == 0
            continue
        assert family in FAMILY_LOGITS, f"{family}: its forward post-processes the logits; add it to FAMILY_LOGITS"
        key, kind, _ = FAMILY_LOGITS[family]
        assert key in sources[family] and ops[kind] in sources[family], family
    assert set(FAMILY_LOGITS) <= set(sources) | {"gemma3", "gemma3n", "gemma4", "gemma4_unified"}  # multimodal:
    # their text model's config is what read_text_config reads


def test_head_choice_reads_config_json_as_transformers_does():
    assert head_choice({"model_type": "gemma2"}, 64).transform.softcap == 30.0  # absent: the class default
    assert head_choice({"model_type": "gemma2", "final_logit_softcapping": None}, 64).transform is None
    assert head_choice({"model_type": "gemma3_text"}, 64).transform is None  # Gemma-3 caps nothing by default
    assert head_choice({"model_type": "cohere"}, 64).transform.multiply == 0.0625
    assert head_choice({"model_type": "granite", "logits_scaling": 8}, 64).transform.divide == 8.0
    assert head_choice({"model_type": "granite", "logits_scaling": 1.0}, 64).transform is None
    assert head_choice({"model_type": "hyperclovax", "logits_scaling": 2}, 64).transform.multiply == 2.0
    odd = head_choice({"model_type": "newfam", "output_logit_soft_cap": 30.0}, 64)
    assert odd.chunk == 0 and "output_logit_soft_cap=30.0" in odd.why and "whole logits" in odd.why
    assert head_choice({"model_type": "newfam", "attn_logit_softcapping": 50.0}, 64).chunk == 64  # attention's
    assert head_choice({"model_type": "gemma2"}, 0).chunk == 0


# ------------------------------------------------------------------ the metric users read


def test_gemma2_default_settings_sample_and_train_on_the_same_logprobs(families, launch_here, tmp_path):
    """Issue 42: with the default train.logprob_chunk_tokens, Gemma-2's train/gen_vs_policy_logprob_absdiff read
    1.54 nats (the chunked head dropped final_logit_softcapping). The driver's metric over a step of the default
    spec (on-policy: the old logprobs come from the update's forward), and the plan says which head runs."""
    f = families("gemma2")
    spec = load_spec([f"model.path={f.dir}", f"output_root={tmp_path}", "logging.mlflow=false"])
    assert spec.train.logprob_chunk_tokens > 0  # the default: chunked
    w = TorchPolicyWorker(spec, str(f.dir), 0, 1)
    tok = w.engine.tokenizer
    n = spec.grpo.num_generations_per_prompt
    prompts = [tok(p)["input_ids"] for p in (PROMPTS * spec.grpo.num_prompts_per_step)[:spec.grpo.num_prompts_per_step]]
    gens = w.generate(prompts, n, seed=1)
    batch = collate(gens, torch.linspace(-1, 1, len(gens)), torch.ones(len(gens)), tok.pad_token_id)
    out = w.update([batch], [float(batch.response_mask.sum())])
    prev = out["prev_logprobs"] if "prev_logprobs" in out else w.logprobs(batch)[0]
    diff = (prev - batch.generation_logprobs).abs() * batch.response_mask  # train/driver.py Trainer.update
    assert float(diff.sum() / batch.response_mask.sum().clamp(min=1)) <= TOL
    r = launch_here(tmp_path, f"model.path={f.dir}", f"output_root={tmp_path}", "dry_run=true", "logging.mlflow=false")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"logprob head\s+: chunked, 4096 tokens; logits = cap·tanh\(z/cap\), cap=2 "
                     r"\(config.json final_logit_softcapping=2\)", r.stdout), r.stdout


def test_megatron_is_refused_a_family_that_post_processes_its_logits(families, tmp_path):
    """megatron's GPTModel applies no softcapping or scaling: pre-flight refuses it, naming the config.json key."""
    f = families("gemma2")
    with pytest.raises(ConfigError) as info:
        load_spec([f"model.path={f.dir}", f"output_root={tmp_path}", "train.backend=megatron", "logging.mlflow=false"])
    (v,) = [v for v in info.value.violations if v.rule == "megatron_logits_as_the_family_makes_them"]
    assert "final_logit_softcapping=2" in v.message and "train.backend=torch" in v.fix


@pytest.mark.parametrize("rope", [dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
                                  dict(rope_type="linear", factor=2.0),
                                  dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=16)])
def test_megatron_is_refused_a_rope_scaling_it_does_not_map(tmp_path, monkeypatch, rope):
    """megatron_convert maps no RoPE scaling but llama3 with megatron-core's fixed factors: a llama / qwen config with
    yarn or linear scaling passed pre-flight and the worker stopped at start-up (NotImplementedError: rope type
    'yarn' is not mapped, rc 1). Pre-flight refuses it naming model.path; llama3 with the fixed factors passes."""
    from grpo_launcher.policy.megatron_families import CPU_SHIM_ENV

    monkeypatch.setenv(CPU_SHIM_ENV, "1")
    tok = build_tokenizer()
    for name, params in (("bad", rope), ("llama3", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=8192))):
        AutoConfig.for_model("llama", **COMMON, head_dim=32, rope_parameters=dict(params, rope_theta=1e4),
                             eos_token_id=tok.eos_token_id).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    args = [f"output_root={tmp_path}", "train.backend=megatron", "logging.mlflow=false"]
    load_spec([f"model.path={tmp_path / 'llama3'}", *args])
    with pytest.raises(ConfigError) as info:
        load_spec([f"model.path={tmp_path / 'bad'}", *args])
    (v,) = [v for v in info.value.violations if "RoPE" in v.message]
    assert v.keys == ("model.path", "train.backend") and "train.backend=torch" in v.fix


# ------------------------------------------------------------------ what the engines run (rollout=vllm, rollout=hf)


def test_attention_softcapping_is_computed_where_transformers_default_drops_it(families):
    """transformers' default sdpa drops attn_logit_softcapping (Gemma-2): the policy and rollout=hf load with eager
    (models/attention.py), the only implementation that caps. The cap matters on this model: sdpa's logprobs move by
    far more than TOL (at 0aff0b9 the policy ran sdpa, and rollout=vllm, which caps, sat 0.013 nats off it)."""
    f = families("gemma2")
    assert hf_attention(str(f.dir)) == {"attn_implementation": "eager"}
    assert f.chunked.model.config._attn_implementation == "eager"
    assert hf_attention(str(families("gemma3_text").dir)) == {}  # caps nothing in attention: the default stays
    sdpa = AutoModelForCausalLM.from_pretrained(f.dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    n, p = int(f.batch.attention_mask[0].sum()), int(f.batch.prompt_lens[0])
    with torch.no_grad():
        lp = sdpa(f.batch.input_ids[:1, :n]).logits[0, p - 1:n - 1].log_softmax(-1)
    uncapped = lp.gather(-1, f.batch.input_ids[0, p:n, None]).squeeze(-1)
    assert (uncapped - f.ref_lp[0, :n - p]).abs().max() > 100 * TOL


@pytest.mark.parametrize("family", ["gemma2", "gemma", "llama", "qwen3"])
def test_a_refit_sends_the_names_the_checkpoint_file_holds(tmp_path, family):
    """The refit (rollout/checkpoint_names.py) sends what save_pretrained wrote, and a tied lm_head.weight (not in the
    file) where vLLM's model has that module. vLLM's Gemma-2 has none: at 0aff0b9 the first refit of the tiny gemma2
    stopped at "There is no module or parameter named 'lm_head' in Gemma2ForCausalLM". Without it a tied llama's or
    qwen3's head kept the engine's start-up dummy weights (0.67 nats off; families.md)."""
    from safetensors.torch import load_file

    from grpo_launcher.rollout.checkpoint_names import CheckpointNames

    d = build(tmp_path, family)  # tied but qwen3
    on_disk = load_file(str(d / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    sent = dict(CheckpointNames(str(d))(model.state_dict().items()))
    alias = {"lm_head.weight"} if model.config.tie_word_embeddings and family != "gemma2" else set()
    assert set(sent) == set(on_disk) | alias and all(torch.equal(sent[k], on_disk[k]) for k in on_disk)
    assert all(torch.equal(sent[k], on_disk["model.embed_tokens.weight"]) for k in alias)


def test_vllm_attends_over_the_policys_sliding_window(tmp_path):
    """vLLM 0.32's Cohere2 attends to sliding_window + 1 tokens, transformers (the policy) to sliding_window: past the
    window the tiny cohere2's engine logprobs sat 0.22 nats off. The engine gets the window one smaller
    (hf_overrides); other windowed families are left as config.json has them (gemma2, mistral: the same in both)."""
    from grpo_launcher.rollout.vllm_compat import hf_overrides

    cfgs = {"cohere2": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            "mistral": dict(head_dim=32, sliding_window=8), "gemma2": FAMILIES["gemma2"]}
    for family, quirks in cfgs.items():
        AutoConfig.for_model(family, **{**COMMON, **quirks}).save_pretrained(tmp_path / family)
    assert hf_overrides(str(tmp_path / "cohere2")) == {"hf_overrides": {"sliding_window": 7}}
    assert hf_overrides(str(tmp_path / "mistral")) == {} and hf_overrides(str(tmp_path / "gemma2")) == {}


def test_rollout_vllm_is_refused_a_family_it_runs_off_the_policy(families, tmp_path):
    """vLLM 0.32's in-place refit of gpt_oss loads nothing into its attention (sinks) and routed experts ('OAIAttention:
    Failed to load weights'): `python launch.py model.path=<tiny gpt_oss> rollout=vllm grpo.max_steps=2` ran rc 0 with
    train/gen_vs_policy_logprob_absdiff 0.58 nats. bloom's tied head: the first refit stopped at "no module or
    parameter named 'lm_head' in BloomModel" (rc 1), and without that alias the head kept its dummy weights (1.11
    nats). phimoe: vLLM's PhiMoE sat 0.79-0.83 nats off (not diagnosed), a transformers-5-saved config stopped in
    vLLM's Transformers backend (rc 1). Pre-flight refuses them, naming rollout.backend and model.path."""
    for family, what in (("gpt_oss", "sinks"), ("bloom", "ParallelLMHead"), ("phimoe", "0.79")):
        args = [f"model.path={families(family).dir}", f"output_root={tmp_path}", "logging.mlflow=false"]
        with pytest.raises(ConfigError) as info:
            load_spec([*args, "rollout=vllm"])
        (v,) = [v for v in info.value.violations if "vLLM's refit" in v.message or "as transformers does" in v.message]
        assert v.keys == ("rollout.backend", "model.path") and what in v.message and "rollout=hf" in v.fix
        load_spec(args)  # rollout=hf


def test_rollout_vllm_is_refused_qkv_clipping_its_model_does_not_apply(families, tmp_path):
    """vLLM 0.32's olmoe.py (and olmo.py) never clamp Q/K/V to config.json's clip_qkv, transformers does: the tiny
    olmoe (clip_qkv 0.5, head_dim 32) ran `launch.py rollout=vllm grpo.max_steps=2` rc 0 with rollouts 1.24 nats off
    the policy (5e-7 without clip_qkv). Pre-flight refuses it, naming the value."""
    args = [f"model.path={families('olmoe').dir}", f"output_root={tmp_path}", "logging.mlflow=false"]
    with pytest.raises(ConfigError) as info:
        load_spec([*args, "rollout=vllm"])
    (v,) = [v for v in info.value.violations if v.rule == "vllm_model_reads_the_checkpoint"]
    assert v.keys == ("rollout.backend", "model.path") and "clip_qkv=0.5" in v.message


def test_rollout_vllm_is_refused_a_switch_its_model_does_not_read(tmp_path):
    """vLLM 0.32's StableLM has no q/k LayerNorm and no parallel residual: with qk_layernorm the tiny stablelm_v's
    first refit stopped at "no module or parameter named '...self_attn.k_layernorm'" (rc 1 after start-up). Pre-flight
    refuses it (rc 2), naming rollout.backend and model.path; rollout=hf and a StableLM without them pass the rule."""
    d = build(tmp_path, "stablelm")  # qk_layernorm=True
    args = [f"model.path={d}", f"output_root={tmp_path}", "logging.mlflow=false"]
    with pytest.raises(ConfigError) as info:
        load_spec([*args, "rollout=vllm"])
    (v,) = [v for v in info.value.violations if v.rule == "vllm_model_reads_the_checkpoint"]
    assert v.keys == ("rollout.backend", "model.path") and "qk_layernorm=true" in v.message
    assert "rollout=hf" in v.fix
    load_spec(args)  # rollout=hf
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "qk_layernorm": False}))
    try:
        load_spec([*args, "rollout=vllm"])
    except ConfigError as e:  # head_dim 16: vLLM's CPU attention refuses it, not this rule
        assert not [v for v in e.violations if v.rule == "vllm_model_reads_the_checkpoint"]
