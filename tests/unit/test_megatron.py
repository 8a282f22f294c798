"""train.backend=megatron: HF ↔ Megatron mapping, pre-flight rules, and the worker on CPU (gloo + the test shim).

Fast tests need no megatron-core; the @slow ones import it (extra `megatron`) and start processes:
TP=2 vs TP=1 vs the torch backend on one batch, EP=2 vs EP=1 on a tiny Qwen3-MoE, HF logits parity,
and a 5-step GRPO run through launch.py.
"""

from __future__ import annotations

import json
import logging
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
    lazy = list(mc.iter_hf(full, arch))  # the refit's pairs, one layer at a time
    assert [k for k, _ in lazy] == list(back) and all(torch.equal(back[k], v) for k, v in lazy)
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
    with pytest.raises(NotImplementedError, match="falcon_h1"):
        mc.arch_from_hf_config({"model_type": "falcon_h1"})


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

def test_bf16_is_a_gpu_setting_on_both_backends(monkeypatch):
    """train.precision=bfloat16 on CPU: the torch backend computed in fp32 without a word, and megatron's CPU build
    trained bf16 weights with torch's Adam (no fp32 master) against an fp32 engine (logprob gap 4.7e-3 vs 3e-7). Both
    compute in fp32 on CPU now, and the plan says so."""
    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec

    monkeypatch.setenv("GRPO_MEGATRON_CPU_SHIM", SHIM)
    cpu = load_spec(["train.backend=megatron", "train.precision=bfloat16"])
    gpu = load_spec(["train.backend=megatron", "train.precision=bfloat16", "cluster=slurm", "cluster.gpus_per_node=1",
                     "dry_run=true"])
    assert make_plan(cpu).compute.startswith("fp32 (train.precision=bfloat16 applies on GPUs")
    assert make_plan(gpu).compute.startswith("bf16 compute, fp32 master weights")
    pytest.importorskip("megatron.core")
    from grpo_launcher.policy.megatron_policy import quiet_megatron_notices, transformer_config

    quiet_megatron_notices()
    arch = mc.arch_from_hf_config(_hf_state(_tiny_qwen2(None))[1])
    assert not transformer_config(arch, cpu, use_cpu_init=True).bf16
    assert transformer_config(arch, gpu, use_cpu_init=True).params_dtype == torch.bfloat16


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


# ------------------------------------------------------------------------------ nemotron_h (hybrid)


def _mamba_ssm_imports() -> bool:
    """megatron-core's Mamba mixer builds (its module imports mamba-ssm; on CPU the shim binds its torch references):
    the GPU kit's mamba-ssm, built without its CUDA extension, installed here."""
    try:
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except Exception:
        return False
    return True


needs_mamba_ssm = pytest.mark.skipif(not _mamba_ssm_imports(), reason="needs mamba-ssm importable (the GPU kit's "
                                     "build, no CUDA extension: scripts/gpu-kit.sh)")


def _nemotron_h_dir(tmp_path: Path) -> Path:
    """tests/nemotron_tiny.py's NemotronH (Mamba, MoE, attention, MoE) with a non-zero router score-correction bias
    and routed scaling 2.5, so that the router's mapping is exercised (the tiny one has zeros and 1)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from nemotron_tiny import tiny_nemotron_h

    src = tiny_nemotron_h()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.routed_scaling_factor = 2.5
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    out = tmp_path / "nemotron_h"
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy2(f, out / f.name)
    return out


def test_nemotron_h_hf_megatron_hf_round_trip_is_bit_exact(tmp_path):
    """NemotronH ↔ megatron's hybrid model with our local spec (policy/megatron_hybrid.py): the in-memory state dict
    (refit) and the checkpoint files' layout (backbone.*, one tensor per expert) both round-trip bit for bit."""
    from transformers import AutoModelForCausalLM

    from grpo_launcher.policy.megatron_policy import load_hf_weights

    path = _nemotron_h_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf, a = model.state_dict(), mc.arch_from_hf_config(model.config)
    assert (a.pattern, a.moe_score, a.moe_scaling_factor, a.num_experts) == ("ME*E", "sigmoid", 2.5, 4)
    full = mc.to_full(hf, a)
    back = mc.to_hf(full, a)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    lazy = list(mc.iter_hf(full, a))  # the refit's pairs, one layer at a time: the same names, order and values
    assert [k for k, _ in lazy] == list(back) and all(torch.equal(back[k], v) for k, v in lazy)
    assert {"decoder.layers.0.norm.weight", "decoder.layers.0.mixer.conv1d.weight", "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.2.self_attention.linear_qkv.weight", "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight",
            "decoder.layers.3.mlp.shared_experts.linear_fc1.weight", "decoder.final_norm.weight"} <= full.keys()
    disk = load_hf_weights(path)
    assert "backbone.layers.1.mixer.experts.0.up_proj.weight" in disk
    from_disk = mc.to_full(disk, a)
    assert from_disk.keys() == full.keys() and all(torch.equal(from_disk[k], v) for k, v in full.items())
    to_disk = mc.to_hf(full, a, per_expert=True)
    assert to_disk.keys() == disk.keys() and all(torch.equal(to_disk[k], v) for k, v in disk.items())
    # megatron-core 0.19's mixer holds its conv as parameters (conv1d_weight): the same full-form name
    assert mc.local_to_global("module.decoder.layers.0.mixer.conv1d_weight", 0, 0) == "decoder.layers.0.mixer.conv1d.weight"


@pytest.mark.parametrize("change,refusal", [
    ({"n_group": 2, "topk_group": 1}, "group-limited routing"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"layers_block_type": ["mamba", "mlp", "attention", "moe"]}, "dense MLP layers"),
    ({"layer_norm_epsilon": 1e-6}, "gated norm uses 1e-05"),
    ({"mlp_hidden_act": "silu"}, "activations"),
])
def test_nemotron_h_configs_the_local_spec_cannot_reproduce_are_refused(change, refusal):
    from nemotron_tiny import CONFIG

    cfg = {**CONFIG, "model_type": "nemotron_h"}
    assert mc.arch_from_hf_config(cfg).pattern == "ME*E"
    with pytest.raises(NotImplementedError, match=refusal):
        mc.arch_from_hf_config({**cfg, **change})


DENSE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("family,change,refusal", [
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    ("qwen3", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act=gelu"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4}, "sliding-window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4}, "sliding-window"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "dense layers in between"),
])
def test_dense_configs_the_mapping_cannot_reproduce_are_refused(tmp_path, monkeypatch, family, change, refusal):
    """Each of these ran at 3ae9508: the biases crashed the first refit (KeyError: o_proj.bias), gelu and a sliding
    window trained on logprobs 0.07 and 0.6 nats off the engine's (benchmarks/results/families.md). Now refused by
    the converter and, before anything starts, by pre-flight (build_implements_run, naming model.path)."""
    cfg = {**DENSE, "model_type": family}
    mc.arch_from_hf_config(cfg)  # the plain config maps
    with pytest.raises(NotImplementedError, match=refusal):
        mc.arch_from_hf_config({**cfg, **change})
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>", "pad_token": "<p>"}))
    monkeypatch.setenv("GRPO_MEGATRON_CPU_SHIM", SHIM)
    found = [v for v in _config_errors(f"model.path={d}", "train.backend=megatron", f"output_root={tmp_path}",
                                       "train.max_total_sequence_length=64") if refusal in v.message]
    assert len(found) == 1 and found[0].keys == ("model.path", "train.backend"), found


def _config_errors(*overrides: str) -> list:
    from grpo_launcher.spec.errors import ConfigError

    try:
        _spec(*overrides)
    except ConfigError as err:
        return list(err.violations)
    return []


def test_rules_nemotron_h_on_megatron(tmp_path, monkeypatch):
    """nemotron_h on megatron passes pre-flight where mamba-ssm imports (else a build gap names it and the kit);
    TP > 1 is a build gap naming Transformer Engine; a config.json the local spec cannot reproduce is named."""
    from grpo_launcher.models.nemotron_h import mamba_packages

    from nemotron_tiny import tiny_nemotron_h

    monkeypatch.setenv("GRPO_MEGATRON_CPU_SHIM", SHIM)
    base = ["model=nemotron_h_tiny", "train.backend=megatron", f"output_root={tmp_path}"]
    gaps = [v for v in _config_errors(*base) if v.rule == "build_implements_run"]
    assert [("mamba-ssm" in v.message, "scripts/gpu-kit.sh" in v.fix) for v in gaps] == \
        ([] if mamba_packages()[0] else [(True, True)])
    tp = [v for v in _config_errors(*base, "train.tensor_parallel_size=2", "cluster.cpu_workers_per_node=2")
          if v.keys == ("train.tensor_parallel_size", "model.family")]
    assert len(tp) == 1 and "Transformer Engine" in tp[0].message
    cfg = json.loads((tiny_nemotron_h() / "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "n_group": 2}))
    named = [v for v in _config_errors(*base, f"model.path={tmp_path / 'm'}") if v.keys == ("model.path", "train.backend")]
    assert any("group-limited routing" in v.message for v in named), named


def test_nemotron_h_transformer_config_keeps_squared_relu_unfused():
    """On GPUs the worker turns on megatron's fusions (train.fused_kernels=null); megatron fuses only gelu / swiglu
    with their bias and refuses the config otherwise: nemotron_h's squared-ReLU experts keep bias-activation fusion
    off (the residual-add fusion stays on), its router sigmoid with a fixed expert bias."""
    pytest.importorskip("megatron.core")
    from grpo_launcher.policy.megatron_policy import quiet_megatron_notices, transformer_config

    from nemotron_tiny import CONFIG

    quiet_megatron_notices()
    arch = mc.arch_from_hf_config({**CONFIG, "model_type": "nemotron_h"})
    spec = _spec("model=nemotron_h_tiny", "train.backend=megatron", "cluster=slurm", "dry_run=true")
    cfg = transformer_config(arch, spec, use_cpu_init=True, fused=True)
    assert (cfg.bias_activation_fusion, cfg.bias_dropout_fusion, cfg.gated_linear_unit) == (False, True, False)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim) == (4, 16, 2, 16)
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias, cfg.moe_router_bias_update_rate,
            cfg.moe_shared_expert_intermediate_size) == ("sigmoid", True, 0.0, 64)


def test_megatron_fusions_compile_once_per_grad_mode_for_every_length():
    """megatron-core's jit_fuser functions are torch.compile'd. GRPO's changing lengths and the no-grad logprob pass
    recompiled each one up to dynamo's limit: a 1.1B nemotron_h update took 167 s a step on an H200. With the
    worker's setting each fusion compiles once per grad mode, for any length. Other variants run eagerly and give
    the same values."""
    from torch._dynamo.utils import counters
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    from grpo_launcher.policy.megatron_policy import bound_fusion_compiles

    saved = torch._dynamo.config.assume_static_by_default, torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    counters.clear()
    try:
        bound_fusion_compiles()
        for n, grad in [(12, False), (13, True), (40, False), (7, True), (64, False)]:  # logprob pass, update, ...
            x = torch.randn(n, 2, 8, requires_grad=grad)
            r = torch.randn(n, 2, 8)
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(squared_relu(x), torch.relu(x) ** 2)
                torch.testing.assert_close(bias_dropout_add_fused_train((x, None), r, 0.0), x + r)
        x2 = torch.randn(9, 8)  # another rank: eager
        torch.testing.assert_close(squared_relu(x2), torch.relu(x2) ** 2)
        assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])  # 2 fusions × 2 grad modes
        bound_fusion_compiles()  # a second worker in the same process (tests make several): one log filter
        assert len(logging.getLogger("torch._dynamo.convert_frame").filters) == 1
    finally:
        torch._dynamo.config.assume_static_by_default, torch._dynamo.config.recompile_limit = saved
        torch._dynamo.reset()
