"""Pre-flight reads config.json as transformers does (issue 42, item 4): an explicit `head_dim` (Qwen3, Gemma,
Mistral) is the attention's head width, for the vLLM head-width rule, the CPU engine's KV cache rule and the memory
model alike (spec/model_dir.py `model_facts`). Before, all three used hidden_size / num_attention_heads: a valid
Qwen3-style checkpoint was refused for rollout=vllm with a fix telling the user to change its architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_launcher.preflight import memory_shapes as mem
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.spec.model_dir import model_facts

# a Qwen3-style config.json: 4 heads of 32 over a hidden size of 64 (hidden / heads = 16)
QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
         "vocab_size": 512, "tie_word_embeddings": False}
VLLM_CPU = ["rollout=vllm", "train.max_total_sequence_length=128"]


def model_dir(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>", "pad_token": "<p>"}))
    return str(path)


def violations(args: list[str]) -> list:
    try:
        load_spec(args)
    except ConfigError as err:
        return err.violations
    return []


def test_qwen3_head_dim_passes_the_vllm_rule_and_sizes_the_kv_cache(tmp_path):
    d = model_dir(tmp_path / "qwen3", QWEN3)
    assert violations([f"model.path={d}", *VLLM_CPU]) == []  # before: "needs head_dim ≥ 32, got 64/4 = 16"
    spec = load_spec([f"model.path={d}", *VLLM_CPU])
    assert spec.model.head_dim == 32 and model_facts(spec.model).kv_dim == 2 * 32
    a = mem.arch_of(spec)
    assert (a.head_dim, a.q_dim, a.kv_dim) == (32, 128, 64)
    assert mem.kv_bytes_per_token(a, 1, 4) == 2 * 2 * 2 * 32 * 4  # K and V × layers × KV heads × head_dim × fp32
    # the CPU engine's KV rule counts the same bytes: 1 KiB/token × one 128-token block = 128 KiB ≤ 1 MiB; with
    # 32 layers 16 KiB/token: 2 MiB (at hidden / heads = 16 it would be 1 MiB, and pass)
    assert violations([f"model.path={d}", *VLLM_CPU, "rollout.kv_cache_memory_mb=1"]) == []
    bigger = model_dir(tmp_path / "deeper", {**QWEN3, "num_hidden_layers": 32})
    (v,) = violations([f"model.path={bigger}", *VLLM_CPU, "rollout.kv_cache_memory_mb=1"])
    assert v.rule == "vllm_engine_memory_and_length" and f"{2 * 32 * 2 * 32 * 4} B/token" in v.message, v


def test_memory_model_counts_the_hf_models_parameters_with_an_explicit_head_dim(tmp_path):
    """q/o projections are heads × head_dim wide (not hidden): the memory model's count is the model's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**QWEN3, "model_type": "llama"}
    d = model_dir(tmp_path / "llama", cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    a = mem.arch_of(load_spec([f"model.path={d}", *VLLM_CPU]))
    assert mem.param_counts(a).total(a) == sum(p.numel() for p in model.parameters())
    assert model.model.layers[0].self_attn.q_proj.weight.shape == torch.Size([a.q_dim, a.hidden])


def test_a_valid_checkpoint_vllm_cpu_cannot_run_is_not_told_to_change_its_architecture(tmp_path):
    d = model_dir(tmp_path / "narrow", {**QWEN3, "head_dim": 16})
    (v,) = violations([f"model.path={d}", *VLLM_CPU])
    assert v.rule == "heads_divide" and "head_dim 16" in v.message and "rollout=hf" in v.fix, v
    assert "model.path" in v.keys and "hidden" not in v.fix and "heads" not in v.fix, v
    assert violations([f"model.path={d}", "train.max_total_sequence_length=128"]) == []  # rollout=hf runs it


def test_tiny_model_head_width_fix_names_its_shape():
    (v,) = violations(["rollout=vllm", "model.hidden_size=64"])  # 64 / 4 heads = 16
    assert v.rule == "heads_divide" and "model.hidden_size" in v.keys and "model.hidden_size=128" in v.fix, v


def test_explicit_head_dim_need_not_split_hidden_and_must_match_the_checkpoint(tmp_path):
    d = model_dir(tmp_path / "odd", {**QWEN3, "hidden_size": 80, "num_attention_heads": 3, "num_key_value_heads": 1})
    assert violations([f"model.path={d}", *VLLM_CPU]) == []  # 80 / 3 does not divide; head_dim 32 is the width
    (v,) = violations([f"model.path={d}", *VLLM_CPU, "model.head_dim=64"])
    assert v.rule == "model_matches_checkpoint" and "model.head_dim=64" in v.message and "head_dim=32" in v.message


def test_without_head_dim_it_is_hidden_over_heads(tmp_path):
    cfg = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    spec = load_spec([f"model.path={model_dir(tmp_path / 'plain', {**cfg, 'hidden_size': 128})}", *VLLM_CPU])
    assert spec.model.head_dim == 32 and mem.arch_of(spec).head_dim == 32


@pytest.mark.parametrize("family,tied", [("gemma", True), ("qwen3", False)])
def test_tied_embeddings_as_the_model_class_defaults_them(tmp_path, family, tied):
    """No tie_word_embeddings in config.json: the class's default, in the spec, the facts and the memory model."""
    cfg = {k: v for k, v in QWEN3.items() if k != "tie_word_embeddings"}
    spec = load_spec([f"model.path={model_dir(tmp_path / family, {**cfg, 'model_type': family})}", *VLLM_CPU])
    assert spec.model.tie_word_embeddings is model_facts(spec.model).tied is mem.arch_of(spec).tied is tied


def test_untied_by_default_is_transformers_own_for_every_causal_lm():
    """config.json without tie_word_embeddings: pre-flight's fallback (spec/model_dir.py UNTIED_BY_DEFAULT) is the
    config class's default for every causal-LM family transformers knows. At 3ae9508, 55 untied families (qwen3_5,
    llama4_text, ministral3, deepseek_v32, ...) were taken as tied: the memory model dropped their output layer's
    weights, gradients and optimizer state (vocab × hidden × 16 bytes)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from grpo_launcher.spec.model_dir import _fallback

    wrong = []
    for family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cfg = CONFIG_MAPPING[family]()
        except Exception:  # noqa: BLE001  (a config class that needs arguments or an optional package: not judged)
            continue
        tied = getattr(cfg.get_text_config(), "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", None))
        if tied is not None and _fallback("tie_word_embeddings", {"model_type": family}, {}) != bool(tied):
            wrong.append(family)
    assert not wrong, f"UNTIED_BY_DEFAULT disagrees with transformers for {wrong}"


def test_qwen2_with_a_head_dim_vllm_ignores_is_refused_for_vllm(tmp_path):
    """vLLM 0.32's qwen2 builds hidden / heads = 16-wide heads whatever config.json's head_dim (32) says; at 3ae9508
    pre-flight passed it and the engine crashed at the first rollout. rollout=hf (transformers reads it) runs it."""
    d = model_dir(tmp_path / "qwen2", {**QWEN3, "model_type": "qwen2"})
    found = [v for v in violations([f"model.path={d}", *VLLM_CPU]) if "ignores head_dim" in v.message]
    assert len(found) == 1 and found[0].keys == ("rollout.backend", "model.path") and "rollout=hf" in found[0].fix
    assert violations([f"model.path={d}", "train.max_total_sequence_length=128"]) == []
    same = model_dir(tmp_path / "qwen2-derived", {**QWEN3, "model_type": "qwen2", "hidden_size": 128})
    assert violations([f"model.path={same}", *VLLM_CPU]) == []  # head_dim = 128 / 4: nothing ignored


@pytest.mark.parametrize("family", ["phi", "gpt_neox"])
def test_families_vllm_cannot_refit_are_refused_for_vllm(tmp_path, family):
    """vLLM 0.32's Transformers backend: phi's refit crashes, gpt_neox's rollouts stay 0.95 nats off the policy
    (benchmarks/results/families.md): refused for rollout=vllm, passed for rollout=hf."""
    d = model_dir(tmp_path / family, {**QWEN3, "model_type": family})
    found = [v for v in violations([f"model.path={d}", *VLLM_CPU]) if "Transformers backend" in v.message]
    assert len(found) == 1 and found[0].keys == ("rollout.backend", "model.path") and "rollout=hf" in found[0].fix
    assert family in found[0].message
    assert violations([f"model.path={d}", "train.max_total_sequence_length=128"]) == []


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "granite", "phi3",
                                    "olmo2", "starcoder2"])
def test_families_vllm_refits_are_not_refused(tmp_path, family):
    d = model_dir(tmp_path / family, {**QWEN3, "model_type": family, "hidden_size": 128})
    assert not [v for v in violations([f"model.path={d}", *VLLM_CPU]) if "Transformers backend" in v.message]
