"""train.backend=megatron: HF ↔ Megatron mapping, pre-flight rules, and the worker on CPU (gloo + the test shim).

Fast tests need no megatron-core; the @slow ones import it (extra `megatron`) and start processes:
TP=2 vs TP=1 vs the torch backend on one batch, EP=2 vs EP=1 on a tiny Qwen3-MoE, HF logits parity,
and a 5-step GRPO run through launch.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_launcher.policy import megatron_convert as mc
from helpers import ROOT, share_models, tiny_model

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


# ------------------------------------------------------------------------------ worker on CPU (slow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(B: int, vocab: int, seed: int = 0):
    from grpo_launcher.batch import Generation, collate

    g = torch.Generator().manual_seed(seed)
    gens = []
    for i in range(B):
        p = torch.randint(3, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        gens.append(Generation(p, r, [-1.0] * len(r), truncated=False))
    adv = torch.randn(B, generator=g)
    return collate(gens, adv, torch.ones(B), pad_id=0)


def _worker_job(rank: int, world: int, spec, model_dir: str, batch, out: str, port: int) -> None:
    """What the driver does for one step, on one rank: logprobs → update → refit weights."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker
    from grpo_launcher.algos import local_denominator
    from grpo_launcher.batch import shard_rows

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    prev, _ = w.logprobs(batch.select(shard_rows(len(batch), world, rank)))
    parts = [None] * world
    dist.all_gather_object(parts, prev)
    prev = torch.cat(parts)
    noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    b = batch.with_(prev_logprobs=prev + noise)  # ratios ≠ 1: clipping is exercised
    den = max(local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None]), 1.0)
    m = w.update([b.select(shard_rows(len(b), world, rank))], [den])
    metrics = [None] * world
    dist.all_gather_object(metrics, m)
    ids = batch.input_ids[:2]
    sd = w.state_dict()
    if rank == 0:
        summed = {k: sum(x[k] for x in metrics) for k in m if k not in ("grad_norm", "lr")}
        summed.update(grad_norm=m["grad_norm"], lr=m["lr"])
        torch.save({"prev": prev, "metrics": summed, "sd": sd, "ids": ids}, out)
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, spec, model_dir: Path, batch, out: Path) -> dict:
    import torch.multiprocessing as mp

    mp.start_processes(_worker_job, args=(world, spec, str(model_dir), batch, str(out), _free_port()),
                       nprocs=world, start_method="spawn", join=True)
    return torch.load(out, weights_only=False)


def _megatron_spec(**train):
    from grpo_launcher.spec.schema import LossSpec, RunSpec, TrainBackend, TrainSpec

    t = dict(backend=TrainBackend.megatron, lr=1e-3, micro_batch_size=4, logprob_batch_size=4,
             global_batch_size=8, max_grad_norm=0.05)
    t.update(train)
    return RunSpec(train=dataclasses.replace(TrainSpec(), **t), loss=LossSpec())


@pytest.mark.slow
def test_tp2_equals_tp1_equals_torch_backend(tmp_path):
    """One driver step (logprobs, GRPO update with clipping) on the tiny Qwen2: TP=2 ≡ TP=1 ≡ torch backend."""
    pytest.importorskip("megatron.core")
    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    model_dir = _tiny_qwen2(tmp_path)
    batch = _batch(8, 259)
    tp1 = _run(1, _megatron_spec(), model_dir, batch, tmp_path / "tp1.pt")
    tp2 = _run(2, _megatron_spec(tensor_parallel_size=2), model_dir, batch, tmp_path / "tp2.pt")

    spec = dataclasses.replace(_megatron_spec(), train=dataclasses.replace(_megatron_spec().train, backend="torch"))
    tw = TorchPolicyWorker(spec, str(model_dir), 0, 1)
    prev, _ = tw.logprobs(batch)
    noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    b = batch.with_(prev_logprobs=prev + noise)
    den = local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None])
    tm = tw.update([b], [den])
    tsd = tw.state_dict()

    mask = batch.response_mask.bool()
    for other in (tp2, {"prev": prev, "metrics": tm, "sd": tsd}):
        assert torch.allclose(tp1["prev"][mask], other["prev"][mask], atol=1e-5, rtol=0)
        for k in ("loss", "pg_loss", "clip_fraction", "entropy", "grad_norm"):
            assert tp1["metrics"][k] == pytest.approx(other["metrics"][k], rel=1e-4, abs=1e-6), k
        assert set(tp1["sd"]) == set(other["sd"])
        for k, v in tp1["sd"].items():
            assert torch.allclose(v, other["sd"][k], atol=2e-5, rtol=0), k
    assert tp1["metrics"]["clip_fraction"] > 0  # the check above covered clipped tokens too
    # the update moved the weights (refit carries the new policy)
    hf, _ = _hf_state(model_dir)
    assert max((tp1["sd"][k] - hf[k]).abs().max().item() for k in hf) > 1e-4
    # refit: the rollout worker's strict load accepts the HF-named state dict
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).load_state_dict(tp2["sd"], strict=True)


def _logits_job(rank: int, world: int, spec, model_dir: str, ids, out: str, port: int) -> None:
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        logits = w.model(ids, pos, None)
    sd = w.state_dict()
    if rank == 0:
        torch.save({"logits": logits, "sd": sd}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind,world,train", [
    ("llama", 2, {"tensor_parallel_size": 2}),
    pytest.param("qwen3-tied", 1, {}, marks=pytest.mark.extended),
    pytest.param("qwen3_moe", 1, {"moe": {"token_dispatcher": "allgather", "router_dtype": "float32",
                                          "freeze_router": True}}, marks=pytest.mark.extended),
    pytest.param("qwen3_moe", 2, {"expert_parallel_size": 2, "moe": {"token_dispatcher": "allgather"}},
                 marks=pytest.mark.extended),
])
def test_megatron_logits_match_hf_and_export_is_exact(tmp_path, kind, world, train):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from grpo_launcher.spec.schema import MoESpec, Precision

    path = _tiny_hf(kind.removesuffix("-tied"), tmp_path, tie=kind.endswith("-tied"))
    if "moe" in train:
        moe = dict(train.pop("moe"))
        if "router_dtype" in moe:
            moe["router_dtype"] = Precision(moe["router_dtype"])
        train["moe"] = MoESpec(**moe)
    spec = _megatron_spec(**train)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "out.pt"
    mp.start_processes(_logits_job, args=(world, spec, str(path), ids, str(out), _free_port()), nprocs=world,
                       start_method="spawn", join=True)
    res = torch.load(out, weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    local_v = res["logits"].shape[-1]
    assert torch.allclose(res["logits"], ref[..., :local_v], atol=1e-4, rtol=0)  # rank 0's vocab shard
    sd = hf.state_dict()
    assert set(res["sd"]) == set(sd)
    for k, v in sd.items():
        assert torch.equal(res["sd"][k], v), k  # load → export without an update: bit-exact


@pytest.mark.slow
def test_grpo_run_with_megatron_backend(tmp_path):
    """`python launch.py train.backend=megatron grpo.max_steps=5` completes on CPU (shim via env)."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ, GRPO_MEGATRON_CPU_SHIM=SHIM)
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), "train.backend=megatron", "grpo.max_steps=5",
           "logging.mlflow=false", f"output_root={share_models(tmp_path)}", "logging.profile_step=3"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ckpts = list((tmp_path / "tiny-grpo" / "checkpoints").rglob("model.safetensors"))
    assert ckpts, proc.stdout[-2000:]
    # logging.profile_step=3: step 3's phases by kernel class, as printed and as written per rank
    assert "grpo-launcher: profile of step 3" in proc.stdout
    phases = json.loads((tmp_path / "tiny-grpo" / "profile" / "step_3" / "rank_0" / "rank_0.json").read_text())
    assert {"generate", "update"} <= set(phases) and phases["update"]["classes_ms"]["gemm"] > 0


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



def _grads_job(rank: int, world: int, spec, model_dir: str, batch, out: str, port: int) -> None:
    """One worker, two output-layer paths (train.logprob_chunk_tokens 0 = whole logits, then 3): each path's
    logprob pass and one micro-step's loss, metrics and gradients, from the same weights (no optimizer step)."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    from grpo_launcher.batch import shard_rows

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    den = local_denominator(spec.loss.aggregation.value, batch.response_mask * batch.sample_mask[:, None])
    rows = shard_rows(len(batch), world, rank)
    batch = batch.select(rows)  # TP=2: the replica gathers both ranks' rows
    res = {}
    for chunk in (0, 3):
        w.spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, logprob_chunk_tokens=chunk))
        prev, ref = w.logprobs(batch)
        noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1 + rank))
        b = batch.with_(prev_logprobs=prev + noise, ref_logprobs=ref)
        w._zero_grad()
        metrics, _, _ = w._micro_step(w._replica_batch(b)[0], den)  # TP ranks step on the same rows
        grads = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
        res[chunk] = {"prev": prev, "ref": ref, "step": metrics, "grads": grads}
    if rank == 0:  # TP=2: rank 0's rows and weight shards
        torch.save({**res, "rows": rows}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tie,tp", [(False, 1), pytest.param(True, 1, marks=pytest.mark.extended),
                                    pytest.param(False, 2, marks=pytest.mark.extended)], ids=["untied", "tied", "tp2"])
def test_chunked_output_layer_equals_whole_logits(tmp_path, tie, tp):
    """The output layer in chunks of 3 tokens (algos.linear_logprobs over GPTModel's final hidden states; TP=2:
    its vocab-parallel form) gives the whole-logits path's logprobs (policy and reference), loss, entropy, KL and
    gradients (TP=2: rank 0's rows and shards), at a sampling temperature of 0.7."""
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from grpo_launcher.spec.schema import LossSpec

    model_dir = _tiny_hf("qwen3", tmp_path, tie=tie)
    spec = _megatron_spec(tensor_parallel_size=tp)
    spec = dataclasses.replace(spec, loss=LossSpec(kl_coef=0.1),
                               rollout=dataclasses.replace(spec.rollout, temperature=0.7))
    batch, out = _batch(4, 256), tmp_path / "out.pt"
    mp.start_processes(_grads_job, args=(tp, spec, str(model_dir), batch, str(out), _free_port()), nprocs=tp,
                       start_method="spawn", join=True)
    res = torch.load(out, weights_only=False)
    whole, chunked = res[0], res[3]
    mask = batch.response_mask[res["rows"]].bool()
    for k in ("prev", "ref"):
        assert torch.allclose(chunked[k][mask], whole[k][mask], atol=1e-5, rtol=0), k
    for k in ("loss", "pg_loss", "entropy", "kl"):
        assert chunked["step"][k] == pytest.approx(whole["step"][k], rel=1e-5, abs=1e-7), k
    assert set(chunked["grads"]) == set(whole["grads"]) and whole["grads"]
    for k, g in whole["grads"].items():
        assert torch.allclose(chunked["grads"][k], g, atol=1e-6, rtol=1e-4), k


def _vocab_parallel_job(rank: int, world: int, out: str, port: int) -> None:
    import torch.distributed as dist

    from grpo_launcher.algos.linear_logprobs import vocab_parallel_linear_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 30, (11,), generator=g)
    h = hidden.clone().requires_grad_()
    w = weight.chunk(world)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_linear_logprobs(h, w, targets, group=None, vocab_start=rank * 30 // world,
                                             temperature=0.7, chunk=4)
    (lp * torch.arange(11.0, dtype=torch.float64)).sum().backward()  # a different weight per token
    parts = [torch.empty_like(w.grad) for _ in range(world)]
    dist.all_gather(parts, w.grad)
    if rank == 0:
        torch.save({"lp": lp.detach(), "ent": ent, "h_grad": h.grad, "w_grad": torch.cat(parts)}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_linear_logprobs_equal_the_whole_vocabulary(tmp_path):
    """algos.vocab_parallel_linear_logprobs on 2 gloo ranks (each 15 of 30 vocabulary rows, chunks of 4 of 11
    tokens) = linear_logprobs over the whole weight in fp64: logprobs, entropy and both gradients."""
    import torch.multiprocessing as mp

    from grpo_launcher.algos import linear_logprobs

    out = tmp_path / "vp.pt"
    mp.start_processes(_vocab_parallel_job, args=(2, str(out), _free_port()), nprocs=2, start_method="spawn",
                       join=True)
    res = torch.load(out, weights_only=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 30, (11,), generator=g)
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=0.7, chunk=4)
    (lp * torch.arange(11.0, dtype=torch.float64)).sum().backward()
    for got, want in ((res["lp"], lp), (res["ent"], ent), (res["h_grad"], hidden.grad), (res["w_grad"], weight.grad)):
        assert torch.allclose(got, want.detach(), atol=1e-12, rtol=0)
