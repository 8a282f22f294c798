"""HF ↔ megatron-core weight mapping for Llama / Qwen2 / Qwen3 (dense), Qwen3-MoE and NemotronH (hybrid Mamba-2 /
attention / MoE, megatron-core's Mamba/hybrid model), local layer specs.

Our own mapping (megatron-bridge is not installable reliably here: ../shared/reference/feasibility-megatron.md).
Three forms of the weights:

* HF        : a transformers state dict (``model.layers.3.self_attn.q_proj.weight``).
* full      : megatron-core names with GLOBAL layer / expert indices and unsharded tensors
              (``decoder.layers.3.self_attn.linear_qkv.weight``); pure re-layout of HF, no arithmetic.
* local     : what one rank's GPTModel holds: its pipeline stage's layers (local indices), its
              expert-parallel rank's experts (local indices), its tensor-parallel shard.

``hf_to_full`` / ``full_to_hf`` are exact inverses (only cat / split / view: bit-exact round trip).
``shard`` cuts one full tensor for a TP rank; ``unshard`` puts the TP shards back together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from .megatron_families import FAMILIES, dense_refusals, hybrid_pattern, hybrid_refusals


@dataclass(frozen=True)
class MambaShape:
    """A NemotronH Mamba-2 mixer's sizes (TransformerConfig's mamba_* fields and the mixer's own arguments)."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    chunk_size: int


@dataclass(frozen=True)
class Arch:
    """The shape facts the mapping and the TransformerConfig need, read from an HF config."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_top_k: int = 0
    moe_norm_topk_prob: bool = False
    rope_scaling_factor: Optional[float] = None  # llama3-style scaling (megatron's rope_scaling)
    # nemotron_h (hybrid): the layer pattern in megatron's symbols (M Mamba-2, E MoE, * attention), the Mamba sizes,
    # and its MoE's sigmoid router (expert-score correction bias, scaled top-k) with one shared expert
    pattern: str = ""
    mamba: Optional[MambaShape] = None
    moe_score: str = "softmax"
    moe_scaling_factor: Optional[float] = None
    shared_ffn_hidden_size: int = 0


def arch_from_hf_config(cfg) -> Arch:
    """transformers config (or its dict) → Arch; refuses families/features the mapping does not cover."""
    c = cfg if isinstance(cfg, dict) else cfg.to_dict()
    family = c.get("model_type")
    if family not in FAMILIES:
        raise NotImplementedError(f"train.backend=megatron maps {FAMILIES}, not model_type={family!r}")
    if family == "nemotron_h":
        return hybrid_arch(c)
    refusals = dense_refusals(c)
    if refusals:
        raise NotImplementedError(f"{family} on train.backend=megatron: " + "; ".join(refusals))
    heads = c["num_attention_heads"]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)) if rope else c.get("rope_theta", 10000.0))
    factor = None
    if rope_type == "llama3":
        if (rope.get("low_freq_factor"), rope.get("high_freq_factor"),
                rope.get("original_max_position_embeddings")) != (1.0, 4.0, 8192):
            raise NotImplementedError(f"llama3 rope scaling with non-default parameters: {rope}")
        factor = float(rope["factor"])
    elif rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r} is not mapped to megatron-core")
    moe = family == "qwen3_moe"
    return Arch(
        family=family, num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"], norm_eps=float(c["rms_norm_eps"]),
        rope_theta=theta, qkv_bias=family == "qwen2" or bool(c.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_experts=(c.get("num_experts") or c.get("num_local_experts") or 0) if moe else 0,
        moe_ffn_hidden_size=c.get("moe_intermediate_size", 0) if moe else 0,
        moe_top_k=c.get("num_experts_per_tok", 0) if moe else 0,
        moe_norm_topk_prob=bool(c.get("norm_topk_prob", False)) if moe else False,
        rope_scaling_factor=factor)


# ------------------------------------------------------------------------------ HF ↔ full


def _qkv_fuse(q: Tensor, k: Tensor, v: Tensor, a: Arch) -> Tensor:
    """HF q/k/v ([n·d, ...], [g·d, ...]) → megatron's per-group interleave [g·(n/g + 2)·d, ...]."""
    g, d = a.num_kv_heads, a.head_dim
    per = a.num_heads // g
    rest = q.shape[1:]
    qg = q.reshape(g, per * d, *rest)
    kg, vg = k.reshape(g, d, *rest), v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (per + 2) * d, *rest)


def _qkv_split(w: Tensor, a: Arch) -> tuple[Tensor, Tensor, Tensor]:
    g, d = a.num_kv_heads, a.head_dim
    per = a.num_heads // g
    rest = w.shape[1:]
    wg = w.reshape(g, (per + 2) * d, *rest)
    q, k, v = wg.split([per * d, d, d], dim=1)
    return (q.reshape(g * per * d, *rest).clone(), k.reshape(g * d, *rest).clone(),
            v.reshape(g * d, *rest).clone())


def hf_to_full(hf: dict[str, Tensor], a: Arch) -> dict[str, Tensor]:
    """HF state dict → megatron-core names, global indices, unsharded tensors."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not a.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(a.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        at = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
            hf[at + "q_proj.weight"], hf[at + "k_proj.weight"], hf[at + "v_proj.weight"], a)
        if a.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv_fuse(
                hf[at + "q_proj.bias"], hf[at + "k_proj.bias"], hf[at + "v_proj.bias"], a)
        out[m + "self_attention.linear_proj.weight"] = hf[at + "o_proj.weight"]
        if a.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[at + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[at + "k_norm.weight"]
        if a.num_experts:
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            fused = h + "mlp.experts.gate_up_proj" in hf  # in-memory transformers 5 form; checkpoints: per expert
            for e in range(a.num_experts):
                if fused:  # gate_up_proj [E, 2f, h] (gate rows first), down_proj [E, h, f]
                    fc1, fc2 = hf[h + "mlp.experts.gate_up_proj"][e], hf[h + "mlp.experts.down_proj"][e]
                else:
                    x = h + f"mlp.experts.{e}."
                    fc1 = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
                    fc2 = hf[x + "down_proj.weight"]
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
            out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def full_to_hf(full: dict[str, Tensor], a: Arch, *, per_expert: bool = False) -> dict[str, Tensor]:
    """Inverse of hf_to_full. Tied models get lm_head.weight = the embedding (what HF's state_dict holds).

    MoE experts come out fused (``mlp.experts.gate_up_proj`` [E, 2f, h], ``down_proj`` [E, h, f]: the
    in-memory transformers 5 state dict, what refit loads) or, with per_expert, in the checkpoint layout
    (``mlp.experts.{e}.gate_proj.weight`` ...: what safetensors files on disk hold).
    """
    out = _top_to_hf(full, a)
    for i in range(a.num_layers):
        out.update(_layer_to_hf(full, a, i, per_expert))
    return out


def _top_to_hf(full: dict[str, Tensor], a: Arch) -> dict[str, Tensor]:
    emb = full["embedding.word_embeddings.weight"]
    return {"model.embed_tokens.weight": emb, "model.norm.weight": full["decoder.final_layernorm.weight"],
            "lm_head.weight": emb if a.tie_embeddings else full["output_layer.weight"]}


def _layer_to_hf(full: dict[str, Tensor], a: Arch, i: int, per_expert: bool) -> dict[str, Tensor]:
    """Layer i of full_to_hf (its q/k/v and gate/up halves are copies; its experts, stacked, one copy)."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    at, out = h + "self_attn.", {}
    out[h + "input_layernorm.weight"] = full[m + "input_layernorm.weight"]
    out[h + "post_attention_layernorm.weight"] = full[m + "pre_mlp_layernorm.weight"]
    q, k, v = _qkv_split(full[m + "self_attention.linear_qkv.weight"], a)
    out[at + "q_proj.weight"], out[at + "k_proj.weight"], out[at + "v_proj.weight"] = q, k, v
    if a.qkv_bias:
        q, k, v = _qkv_split(full[m + "self_attention.linear_qkv.bias"], a)
        out[at + "q_proj.bias"], out[at + "k_proj.bias"], out[at + "v_proj.bias"] = q, k, v
    out[at + "o_proj.weight"] = full[m + "self_attention.linear_proj.weight"]
    if a.qk_norm:
        out[at + "q_norm.weight"] = full[m + "self_attention.q_layernorm.weight"]
        out[at + "k_norm.weight"] = full[m + "self_attention.k_layernorm.weight"]
    if a.num_experts:
        out[h + "mlp.gate.weight"] = full[m + "mlp.router.weight"]
        ex = m + "mlp.experts.local_experts.{}.linear_fc{}.weight"
        if per_expert:
            for e in range(a.num_experts):
                gate, up = full[ex.format(e, 1)].chunk(2)
                x = h + f"mlp.experts.{e}."
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate.clone(), up.clone()
                out[x + "down_proj.weight"] = full[ex.format(e, 2)]
        else:
            out[h + "mlp.experts.gate_up_proj"] = torch.stack([full[ex.format(e, 1)] for e in range(a.num_experts)])
            out[h + "mlp.experts.down_proj"] = torch.stack([full[ex.format(e, 2)] for e in range(a.num_experts)])
    else:
        gate, up = full[m + "mlp.linear_fc1.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[h + "mlp.down_proj.weight"] = full[m + "mlp.linear_fc2.weight"]
    return out


# ------------------------------------------------------------------------------ TP shards

# How each (suffix of a) full name is split over tensor parallelism in the local spec.
# column: dim 0 (output features); row: dim 1 (input features); fc1: [gate; up] each split on dim 0.
_TP_RULES = (
    (re.compile(r"experts\.local_experts\.\d+\."), None),  # experts: EP-sharded, not TP (ETP = 1)
    (re.compile(r"embedding\.word_embeddings\.weight$"), "column"),
    (re.compile(r"output_layer\.weight$"), "column"),
    (re.compile(r"linear_qkv\.(weight|bias)$"), "column"),
    (re.compile(r"linear_proj\.weight$"), "row"),
    (re.compile(r"mlp\.linear_fc1\.weight$"), "fc1"),
    (re.compile(r"mlp\.linear_fc2\.weight$"), "row"),
)


def tp_kind(name: str) -> Optional[str]:
    for pattern, kind in _TP_RULES:
        if pattern.search(name):
            return kind
    return None  # norms, router: replicated


def shard(name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """The tp_rank-th shard of one full tensor (replicated tensors come back whole)."""
    kind = tp_kind(name)
    if tp_size == 1 or kind is None:
        return full
    if kind == "column":
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])


def unshard(name: str, shards: list[Tensor]) -> Tensor:
    """Inverse of shard over all TP ranks' shards (in rank order)."""
    kind = tp_kind(name)
    if len(shards) == 1 or kind is None:
        return shards[0]
    if kind == "column":
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


# ------------------------------------------------------------------------------ local ↔ global names

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


_CONV1D = re.compile(r"\.mixer\.conv1d_(weight|bias)$")  # megatron-core 0.19's Mamba mixer: conv1d_weight, no Conv1d


def local_to_global(name: str, layer_offset: int, expert_offset: int) -> str:
    """A rank's parameter name → the full-form name (global layer and expert indices; the Mamba conv as
    megatron-core 0.16 and its own checkpoints name it, mixer.conv1d.weight)."""
    name = _CONV1D.sub(r".mixer.conv1d.\1", name.removeprefix("module."))
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


def load_local(model: torch.nn.Module, full: dict[str, Tensor], *, tp_rank: int, tp_size: int,
               layer_offset: int, expert_offset: int, tie: bool = False) -> None:
    """Copy full-form weights into this rank's model (every parameter must be found; shapes checked)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = local_to_global(name, layer_offset, expert_offset)
            if tie and g == "output_layer.weight":  # a last pipeline stage's copy of the tied embedding
                g = "embedding.word_embeddings.weight"
            if g not in full:
                raise KeyError(f"no weight for {name} (global {g})")
            w = shard(g, full[g], tp_rank, tp_size)
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"{g}: converted shape {tuple(w.shape)} ≠ megatron's {tuple(p.shape)}")
            p.copy_(w)
        for name, b in mapped_buffers(model).items():
            g = local_to_global(name, layer_offset, expert_offset)
            if g not in full:
                raise KeyError(f"no weight for the buffer {name} (global {g})")
            b.copy_(full[g])


# buffers that hold weights of the HF model (NemotronH's router score-correction bias: megatron's expert_bias)
MAPPED_BUFFERS = re.compile(r"\.router\.expert_bias$")


def mapped_buffers(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n: b for n, b in model.named_buffers() if MAPPED_BUFFERS.search(n)}


# ------------------------------------------------------------------------------ nemotron_h (hybrid)
# HF NemotronH (transformers 5 module names) ↔ megatron-core's Mamba/hybrid model built from the local layer spec of
# policy/megatron_hybrid.py: every pre-norm its own module (`norm`, `input_layernorm`, `pre_mlp_layernorm`), experts
# one MLP each (`local_experts.{e}`). Checkpoint files name the modules `backbone.*` and hold one tensor per expert.

HYBRID_TOP = (("embedding.word_embeddings.weight", "model.embeddings.weight"),
              ("decoder.final_norm.weight", "model.norm_f.weight"))
HYBRID_LAYER = {  # layer symbol -> (megatron suffix, HF suffix) copied as they are
    "M": (("norm.weight", "norm.weight"), ("mixer.in_proj.weight", "mixer.in_proj.weight"),
          ("mixer.conv1d.weight", "mixer.conv1d.weight"), ("mixer.conv1d.bias", "mixer.conv1d.bias"),
          ("mixer.A_log", "mixer.A_log"), ("mixer.D", "mixer.D"), ("mixer.dt_bias", "mixer.dt_bias"),
          ("mixer.norm.weight", "mixer.norm.weight"), ("mixer.out_proj.weight", "mixer.out_proj.weight")),
    "*": (("input_layernorm.weight", "norm.weight"), ("self_attention.linear_proj.weight", "mixer.o_proj.weight")),
    "E": (("pre_mlp_layernorm.weight", "norm.weight"), ("mlp.router.weight", "mixer.gate.weight"),
          ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias"),
          ("mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight"),
          ("mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight")),
}
_DISK_EXPERT = re.compile(r"^(model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def hybrid_arch(c: dict) -> Arch:
    """An HF NemotronH config dict → Arch; refuses what the local spec cannot reproduce (megatron_families)."""
    refusals = hybrid_refusals(c)
    if refusals:
        raise NotImplementedError("nemotron_h on train.backend=megatron: " + "; ".join(refusals))
    pattern = hybrid_pattern(c)
    heads, moe = c["num_attention_heads"], "E" in pattern
    return Arch(
        family="nemotron_h", num_layers=len(pattern), hidden_size=c["hidden_size"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"], norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        rope_theta=0.0, qkv_bias=False, qk_norm=False, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_experts=c["n_routed_experts"] if moe else 0, moe_ffn_hidden_size=c["moe_intermediate_size"] if moe else 0,
        moe_top_k=c["num_experts_per_tok"] if moe else 0, moe_norm_topk_prob=True, pattern=pattern,
        mamba=MambaShape(c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"],
                         c["conv_kernel"], c["chunk_size"]),
        moe_score="sigmoid", moe_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        shared_ffn_hidden_size=c["moe_shared_expert_intermediate_size"] if moe else 0)


def hybrid_from_disk(d: dict[str, Tensor]) -> dict[str, Tensor]:
    """A NemotronH checkpoint's tensors (backbone.*, one tensor per expert) → the in-memory names (model.*, the
    experts' up_proj / down_proj stacked [E, ...]); in-memory names pass through."""
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    for k, v in d.items():
        k = "model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k
        m = _DISK_EXPERT.match(k)
        if m:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = v
        else:
            out[k] = v
    for (prefix, proj), by_e in experts.items():
        out[f"{prefix}.{proj}"] = torch.stack([by_e[e] for e in range(len(by_e))])
    return out


def hybrid_to_disk(hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of hybrid_from_disk: the layout transformers' save_pretrained writes (vLLM and from_pretrained read)."""
    out: dict[str, Tensor] = {}
    for k, v in hf.items():
        disk = "backbone." + k.removeprefix("model.") if k.startswith("model.") else k
        if k.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            prefix, proj = disk.rsplit(".", 1)
            for e, w in enumerate(v):
                out[f"{prefix}.{e}.{proj}.weight"] = w.clone()  # its own storage: safetensors refuses shared ones
        else:
            out[disk] = v
    return out


def hybrid_hf_to_full(hf: dict[str, Tensor], a: Arch) -> dict[str, Tensor]:
    """NemotronH HF weights (in-memory or checkpoint names) → full-form megatron names (global layer and expert
    indices, unsharded); no arithmetic but the attention's q/k/v interleave (as for GPT layers)."""
    hf = hybrid_from_disk(hf)
    out = {m: hf[h] for m, h in HYBRID_TOP}
    if not a.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i, kind in enumerate(a.pattern):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({m + ms: hf[h + hs] for ms, hs in HYBRID_LAYER[kind]})
        if kind == "*":
            out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
                hf[h + "mixer.q_proj.weight"], hf[h + "mixer.k_proj.weight"], hf[h + "mixer.v_proj.weight"], a)
        if kind == "E":  # squared-ReLU experts: no gate half, fc1 = up_proj[e] [f, h], fc2 = down_proj[e] [h, f]
            ex = m + "mlp.experts.local_experts.{}.linear_fc{}.weight"
            for e, (up, down) in enumerate(zip(hf[h + "mixer.experts.up_proj"], hf[h + "mixer.experts.down_proj"])):
                out[ex.format(e, 1)], out[ex.format(e, 2)] = up, down
    return out


def hybrid_full_to_hf(full: dict[str, Tensor], a: Arch, *, per_expert: bool = False) -> dict[str, Tensor]:
    """Inverse of hybrid_hf_to_full (bit-exact): the in-memory names (refit), or with per_expert the checkpoint's."""
    out = _hybrid_top_to_hf(full, a)
    for i in range(len(a.pattern)):
        out.update(_hybrid_layer_to_hf(full, a, i))
    return hybrid_to_disk(out) if per_expert else out


def _hybrid_top_to_hf(full: dict[str, Tensor], a: Arch) -> dict[str, Tensor]:
    out = {h: full[m] for m, h in HYBRID_TOP}
    out["lm_head.weight"] = full["embedding.word_embeddings.weight" if a.tie_embeddings else "output_layer.weight"]
    return out


def _hybrid_layer_to_hf(full: dict[str, Tensor], a: Arch, i: int) -> dict[str, Tensor]:
    """Layer i of hybrid_full_to_hf, in-memory names (an attention layer's q/k/v: copies; an MoE layer's experts:
    stacked, one copy)."""
    kind, h, m = a.pattern[i], f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {h + hs: full[m + ms] for ms, hs in HYBRID_LAYER[kind]}
    if kind == "*":
        q, k, v = _qkv_split(full[m + "self_attention.linear_qkv.weight"], a)
        out[h + "mixer.q_proj.weight"], out[h + "mixer.k_proj.weight"], out[h + "mixer.v_proj.weight"] = q, k, v
    if kind == "E":
        ex = m + "mlp.experts.local_experts.{}.linear_fc{}.weight"
        for proj, fc in (("up_proj", 1), ("down_proj", 2)):
            out[h + f"mixer.experts.{proj}"] = torch.stack([full[ex.format(e, fc)] for e in range(a.num_experts)])
    return out


def iter_hf(full: dict[str, Tensor], a: Arch) -> Iterator[tuple[str, Tensor]]:
    """to_hf's in-memory pairs, made one layer at a time as they are drawn (the refit): only one layer's copies (q/k/v,
    gate/up halves, stacked experts) exist at once, where to_hf makes every layer's first (a second copy of all
    the experts: a model's worth for an MoE model)."""
    hybrid = a.mamba is not None
    yield from (_hybrid_top_to_hf(full, a) if hybrid else _top_to_hf(full, a)).items()
    for i in range(a.num_layers):
        yield from (_hybrid_layer_to_hf(full, a, i) if hybrid else _layer_to_hf(full, a, i, False)).items()


# ------------------------------------------------------------------------------ any family


def to_full(hf: dict[str, Tensor], a: Arch) -> dict[str, Tensor]:
    """HF weights (a state dict, or a checkpoint's tensors) → full-form megatron names, for the arch's family."""
    return hybrid_hf_to_full(hf, a) if a.mamba is not None else hf_to_full(hf, a)


def to_hf(full: dict[str, Tensor], a: Arch, *, per_expert: bool = False) -> dict[str, Tensor]:
    """Full-form megatron weights → HF names: the in-memory state dict (refit), or with per_expert the checkpoint
    files' layout."""
    if a.mamba is not None:
        return hybrid_full_to_hf(full, a, per_expert=per_expert)
    return full_to_hf(full, a, per_expert=per_expert)
