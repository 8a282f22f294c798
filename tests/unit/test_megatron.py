"""train.backend=megatron: HF ↔ Megatron mapping, pre-flight rules, and the worker on CPU (gloo + the test shim).

Fast tests need no megatron-core; the @slow ones import it (extra `megatron`) and start processes:
TP=2 vs TP=1 vs the torch backend on one batch, EP=2 vs EP=1 on a tiny Qwen3-MoE, HF logits parity,
and a 5-step GRPO run through launch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_launcher.policy import megatron_convert as mc
from helpers import tiny_model

SHIM = "1"  # GRPO_MEGATRON_CPU_SHIM: megatron-core on CPU (policy/megatron_cpu.py)


# ------------------------------------------------------------------------------ tiny HF models


def _tiny_hf(kind: str, out: Path, tie: bool = False) -> Path:
    """A tiny random HF checkpoint (fp32) of the given family, saved with safetensors."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=128, **common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, head_dim=16, **common))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common))
    else:
        raise ValueError(kind)
    path = out / f"{kind}{'-tied' if tie else ''}"
    model.to(torch.float32).save_pretrained(path)
    return path


def _tiny_qwen2(tmp_path: Path) -> Path:
    return tiny_model()  # the default run's tiny Qwen2, built once per machine


def _hf_state(path: Path) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict(), model.config


# ------------------------------------------------------------------------------ mapping (fast)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen3-tied"])
def test_hf_megatron_hf_round_trip_is_bit_exact(tmp_path, kind):
    path = _tiny_qwen2(tmp_path) if kind == "qwen2" else _tiny_hf(kind.removesuffix("-tied"), tmp_path,
                                                                      tie=kind.endswith("-tied"))
    hf, cfg = _hf_state(path)
    arch = mc.arch_from_hf_config(cfg)
    full = mc.hf_to_full(hf, arch)
    back = mc.full_to_hf(full, arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    if arch.num_experts:  # the on-disk checkpoint layout (per expert) round-trips too
        from grpo_launcher.policy.megatron_policy import load_hf_weights

        disk = load_hf_weights(path)
        back_disk = mc.full_to_hf(mc.hf_to_full(disk, arch), arch, per_expert=True)
        assert set(back_disk) == set(disk)
        assert all(torch.equal(back_disk[k], v) for k, v in disk.items())
        assert all(torch.equal(mc.hf_to_full(disk, arch)[k], v) for k, v in full.items())
    # every TP shard layout puts the tensors back exactly
    for tp in (2, 4) if arch.num_kv_heads % 4 == 0 else (2,):
        for name, w in full.items():
            parts = [mc.shard(name, w, r, tp) for r in range(tp)]
            assert torch.equal(mc.unshard(name, parts), w), (name, tp)


def test_qkv_layout_matches_megatron_grouping():
    """linear_qkv rows are [q of group g (n/g heads), k_g, v_g] per KV group g."""
    a = mc.Arch("llama", 1, 8, 4, 2, 2, 16, 32, 64, 1e-6, 1e4, False, False, False)
    q = torch.arange(8.)[:, None].expand(8, 8)       # head h rows: 2h, 2h+1
    k = 100 + torch.arange(4.)[:, None].expand(4, 8)
    v = 200 + torch.arange(4.)[:, None].expand(4, 8)
    fused = mc._qkv_fuse(q, k, v, a)[:, 0].tolist()
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_unsupported_family_is_refused():
    with pytest.raises(NotImplementedError, match="nemotron_h"):
        mc.arch_from_hf_config({"model_type": "nemotron_h"})


def _source_names(rel: str, cls: str) -> set[str]:
    """Attribute and parameter names a megatron-core class gives itself, read from its source (no import: the
    Mamba and TE modules need kernels this machine lacks): `self.X = ...` targets and register_* string names."""
    import ast
    from importlib.util import find_spec

    root = Path(find_spec("megatron.core").submodule_search_locations[0])
    tree = ast.parse((root / rel).read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    names = set()
    for n in ast.walk(node):
        for t in getattr(n, "targets", [getattr(n, "target", None)]):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "").startswith("register_") and n.args \
                and isinstance(n.args[0], ast.Constant):
            names.add(n.args[0].value)
    return names


@pytest.mark.skipif(not __import__("importlib").util.find_spec("megatron"), reason="needs megatron-core's source")
def test_nemotron_h_mapping_uses_mamba_model_names_and_round_trips():
    """nemotron_h on paper: HF NemotronH ↔ megatron-core MambaModel (mamba_stack_spec). Every HF weight is mapped,
    the round trip is bit-exact, and each megatron name's parts are ones megatron-core's classes define (read
    from its source: MambaModel cannot be built here without mamba-ssm and Transformer Engine)."""
    from importlib.util import find_spec

    from transformers import AutoModelForCausalLM

    from nemotron_tiny import tiny_nemotron_h

    path = tiny_nemotron_h()
    cfg = json.loads((path / "config.json").read_text())
    kinds = mc.hybrid_kinds(cfg)
    assert kinds == ["mamba", "moe", "attention", "moe"]
    a = mc.Arch("nemotron_h", len(kinds), cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                cfg["head_dim"], cfg["moe_intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"],
                cfg["layer_norm_epsilon"], 0.0, False, False, False, num_experts=cfg["n_routed_experts"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    full = mc.hybrid_hf_to_full(hf, kinds, a)
    back = mc.hybrid_full_to_hf(full, kinds, a)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in full
    assert "decoder.layers.3.mlp.experts.linear_fc2.weight3" in full
    core = Path(find_spec("megatron.core").submodule_search_locations[0])
    owns = {  # the module a name part belongs to -> what megatron-core's class defines
        "model": _source_names("models/mamba/mamba_model.py", "MambaModel"),
        "stack": _source_names("ssm/mamba_block.py", "MambaStack"),
        "mamba_layer": _source_names("ssm/mamba_layer.py", "MambaLayer"),
        "mixer": _source_names("ssm/mamba_mixer.py", "MambaMixer"),
        "layer": _source_names("transformer/transformer_layer.py", "TransformerLayer"),
        "attention": _source_names("transformer/attention.py", "Attention") | _source_names(
            "transformer/attention.py", "SelfAttention"),
        "moe": _source_names("transformer/moe/moe_layer.py", "MoELayer"),
        "router": _source_names("transformer/moe/router.py", "Router") | _source_names(
            "transformer/moe/router.py", "TopKRouter"),
        "mlp": _source_names("transformer/mlp.py", "MLP"),
        "grouped": _source_names("transformer/moe/experts.py", "TEGroupedMLP"),
    }
    assert {"embedding", "decoder", "output_layer"} <= owns["model"] and {"layers", "final_norm"} <= owns["stack"]
    assert "mixer" in owns["mamba_layer"]
    assert {"in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj"} <= owns["mixer"]
    assert {"self_attention", "pre_mlp_layernorm", "mlp"} <= owns["layer"]
    assert {"linear_qkv", "linear_proj"} <= owns["attention"]
    assert {"router", "experts", "shared_experts"} <= owns["moe"] and {"weight", "expert_bias"} <= owns["router"]
    assert {"linear_fc1", "linear_fc2"} <= owns["mlp"] & owns["grouped"]
    assert "weight{i}" in (core / "transformer/moe/experts.py").read_text()  # grouped experts: weight0, weight1, ...
    spec = (core / "models/mamba/mamba_layer_specs.py").read_text()  # pre-norms fused: layer_norm_weight
    assert "in_proj=TELayerNormColumnParallelLinear" in spec and "linear_qkv=TELayerNormColumnParallelLinear" in spec
    assert "pre_mlp_layernorm=TENorm" in spec
    parts = {p for k in full for p in k.split(".") if not p.isdigit()}
    assert parts <= set().union(*owns.values()) | {"word_embeddings", "weight", "bias", "layer_norm_weight",
                                                    *{f"weight{e}" for e in range(a.num_experts)}}


# ------------------------------------------------------------------------------ rules (fast)


def _spec(*overrides: str):
    from grpo_launcher.spec.compose import load_spec

    return load_spec(list(overrides))


def _violations(*overrides: str) -> set[str]:
    from grpo_launcher.spec.errors import ConfigError

    try:
        _spec(*overrides)
    except ConfigError as err:
        return {v.rule for v in err.violations}
    return set()


def test_memory_counts_megatron_chunked_logits_over_response_tokens():
    """preflight/memory_estimate.py, megatron: the output layer's chunks run over the response tokens only (the worker picks
    their hidden states first), so the logits term is one chunk + the saved hidden states, not 6·V·L + 16·V·T;
    TP=2: chunks of the rank's V/2 vocabulary rows."""
    from dataclasses import replace

    from grpo_launcher.preflight import memory_estimate as mem
    from grpo_launcher.spec.schema import ModelSpec, Precision, RunSpec, TrainBackend, TrainSpec

    llama = ModelSpec(name="llama1b", family="llama", num_layers=24, hidden_size=2048, num_attention_heads=16,
                      num_kv_heads=4, ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=4096,
                      dtype=Precision.bfloat16)
    s = RunSpec(model=llama, train=TrainSpec(backend=TrainBackend.megatron, precision=Precision.bfloat16,
                                             micro_batch_size=2, logprob_batch_size=8, max_total_sequence_length=4096))
    s = replace(s, cluster=replace(s.cluster, gpus_per_node=2), rollout=replace(s.rollout, max_new_tokens=1024))
    chunked = mem.estimate(s).policy
    rtok, lp_rtok = 2 * 1024, 8 * 1024
    assert chunked["logits"].bytes == 12 * 32000 * 2048 + (2 * 2048 + 16) * rtok  # one chunk of 4096 > 2048 tokens
    assert chunked["logprob logits"].bytes == 10 * 32000 * 4096 + (2 * 2048 + 16) * lp_rtok
    whole = mem.estimate(replace(s, train=replace(s.train, logprob_chunk_tokens=0))).policy
    assert whole["logits"].bytes == 6 * 32000 * 2 * 4096 + 16 * 32000 * rtok
    tp2 = replace(s, train=replace(s.train, tensor_parallel_size=2))
    assert mem.estimate(tp2).policy["logits"].bytes == 12 * 16000 * 2048 + (2 * 2048 + 16) * rtok
    tp2_whole = mem.estimate(replace(tp2, train=replace(tp2.train, logprob_chunk_tokens=0))).policy
    assert tp2_whole["logits"].bytes == 6 * 16000 * 2 * 4096 + 16 * 16000 * rtok

def test_fused_kernels_on_megatron_are_its_own_fusions_on_gpus_only(monkeypatch):
    """train.fused_kernels with train.backend=megatron: megatron-core's torch.compile'd SwiGLU and residual add
    (no Liger needed); true on a CPU run is refused naming GPUs; the worker turns them on only with CUDA."""
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.spec.errors import ConfigError

    monkeypatch.setenv("GRPO_MEGATRON_CPU_SHIM", SHIM)
    with pytest.raises(ConfigError) as info:
        load_spec(["train.backend=megatron", "train.fused_kernels=true"])  # the default run: CPU
    (v,) = [v for v in info.value.violations if "train.fused_kernels" in v.keys]
    assert "megatron-core's fused kernels need GPUs" in v.message
    spec = load_spec(["train.backend=megatron", "train.fused_kernels=true", "cluster=slurm", "dry_run=true"])
    pytest.importorskip("megatron.core")
    from grpo_launcher.policy.megatron_policy import quiet_megatron_notices, transformer_config

    quiet_megatron_notices()
    arch = mc.arch_from_hf_config(_hf_state(_tiny_qwen2(None))[1])
    for fused in (False, True):
        cfg = transformer_config(arch, spec, use_cpu_init=True, fused=fused)
        assert (cfg.bias_activation_fusion, cfg.bias_dropout_fusion) == (fused, fused)
        assert not (cfg.apply_rope_fusion or cfg.masked_softmax_fusion or cfg.persist_layer_norm)  # TE / Apex

def test_rules_moe_with_tp_needs_sequence_parallel():
    base = ["train.backend=megatron", "cluster.cpu_workers_per_node=2", "model.num_experts=4", "model.moe_top_k=2",
            "train.tensor_parallel_size=2", "train.global_batch_size=32", "train.micro_batch_size=8",
            "train.logprob_batch_size=8"]
    assert "megatron_moe" in _violations(*base)
    assert "megatron_moe" not in _violations(*base, "train.sequence_parallel=true")


def test_rules_te_only_features_refused_without_te():
    bad = _violations("train.backend=megatron", "train.transformer_engine=false", "cluster.cpu_workers_per_node=2",
                      "train.tensor_parallel_size=2", "train.sequence_parallel=true")
    assert "megatron_needs_transformer_engine" in bad
    ok = _violations("train.backend=megatron", "cluster.cpu_workers_per_node=2", "train.tensor_parallel_size=2",
                     "train.sequence_parallel=true")  # TE not asserted absent: left to the worker
    assert "megatron_needs_transformer_engine" not in ok


def test_rules_moe_settings_and_shapes():
    bad = _violations("train.backend=megatron", "model.num_experts=4", "model.moe_top_k=2",
                      "train.moe.load_balancing_type=bogus", "train.moe.token_dispatcher=nope",
                      "train.moe.router_dtype=bfloat16")
    assert "megatron_moe" in bad
    shape = _violations("train.backend=megatron", "cluster.cpu_workers_per_node=4", "train.tensor_parallel_size=4",
                        "train.global_batch_size=32", "train.micro_batch_size=8", "train.logprob_batch_size=8")
    assert "megatron_shapes" in shape  # 2 KV heads cannot be split over TP=4
    ep = _violations("train.backend=megatron", "model.num_experts=4", "model.moe_top_k=2",
                     "train.expert_parallel_size=2")  # EP=2 on one worker slot
    assert "expert_parallelism" in ep


def test_rules_recipe_still_validates():
    assert _spec("+recipe=nanov3", "cluster=slurm", "cluster.partition=batch", "cluster.account=a",
                 "dry_run=true").train.backend.value == "megatron"


def test_megatron_on_cpu_without_the_shim_is_a_config_error(tmp_path, monkeypatch):
    """A user's `launch.py train.backend=megatron` on a CPU machine: refused at pre-flight, not a traceback."""
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.spec.errors import ConfigError

    args = ["train.backend=megatron", f"output_root={tmp_path}"]
    monkeypatch.delenv("GRPO_MEGATRON_CPU_SHIM", raising=False)
    with pytest.raises(ConfigError) as err:
        load_spec(args)
    assert [v.keys for v in err.value.violations if v.rule == "build_implements_run"] == \
        [("train.backend", "cluster.gpus_per_node")]
    monkeypatch.setenv("GRPO_MEGATRON_CPU_SHIM", SHIM)  # the repo's own CPU tests
    load_spec(args)
