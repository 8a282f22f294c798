"""Memory pre-flight (preflight/memory_*.py): the formulas on hand-computed cases; refusal and acceptance of plans."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from grpo_launcher.preflight import memory_estimate as mem
from grpo_launcher.preflight import memory_report
from grpo_launcher.preflight import memory_shapes as shapes
from grpo_launcher.spec.compose import compose, load_spec, to_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.spec.resolve import resolve
from grpo_launcher.spec.schema import ModelSpec, Precision, RolloutBackend, RunSpec, TrainBackend, TrainSpec
from helpers import ROOT, launch

NANOV3 = ["+recipe=nanov3", "cluster=slurm", "dry_run=true"]
LLAMA_1B = ModelSpec(name="llama1b", family="llama", num_layers=24, hidden_size=2048, num_attention_heads=16,
                     num_kv_heads=4, ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=4096,
                     dtype=Precision.bfloat16)


def spec_of(overrides: list[str]) -> RunSpec:
    """Composed but not validated (so a plan the rule refuses can still be estimated)."""
    return to_spec(compose(overrides))


# ------------------------------------------------------------------ formulas, by hand


def test_param_count_llama_1b_matches_the_hf_model():
    a = shapes.arch_of(RunSpec(model=LLAMA_1B))
    pc = shapes.param_counts(a)
    # per layer: q 2048² + k, v 2·2048·512 + o 2048² + norm 2048 = 10,487,808; MLP 3·2048·5632 + 2048 = 34,605,056
    assert (pc.attention, pc.mlp) == (10_487_808, 34_605_056)
    # 24 layers + embedding and output 2·32000·2048 + final norm 2048 = the HF LlamaForCausalLM's numel
    assert pc.total(a) == 24 * (10_487_808 + 34_605_056) + 2 * 32000 * 2048 + 2048 == 1_213_302_784


def test_param_count_tiny_qwen2_with_qkv_bias():
    a = shapes.arch_of(RunSpec())  # tiny: 2 layers, h 128, 4 heads / 2 KV (head_dim 32), FFN 256, vocab 512
    pc = shapes.param_counts(a)
    attn = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 128 + (128 + 2 * 64)  # + q/k/v biases
    mlp = 3 * 128 * 256 + 128
    assert (pc.attention, pc.mlp) == (attn, mlp) == (49_536, 98_432)
    assert pc.total(a) == 2 * (attn + mlp) + 2 * 512 * 128 + 128 == 427_136


def test_megatron_bytes_per_param_follow_megatrons_table():
    """megatron-core docs: bf16 params + fp32 grads = 18 B/param; distributed optimizer 6 + 12/d."""
    base = RunSpec(model=LLAMA_1B, train=TrainSpec(backend=TrainBackend.megatron, precision=Precision.bfloat16))
    gpu = replace(base.cluster, gpus_per_node=8, gpu_memory_gib=140.4)
    e = mem.estimate(replace(base, cluster=gpu))
    n = 1_213_302_784
    p = e.policy
    assert p["weights"].bytes == 2 * n and p["grads"].bytes == 4 * n and p["optimizer"].bytes == 12 * n
    e = mem.estimate(replace(base, cluster=gpu, train=replace(base.train, distributed_optimizer=True)))
    assert e.policy["optimizer"].bytes == pytest.approx(12 * n / 8)  # d = DP·CP = 8
    assert e.phases["generate"] == pytest.approx((6 + 12 / 8) * n / shapes.GIB)


def test_torch_backend_bytes_per_param():
    """fp32 weights + fp32 grads + AdamW m, v = 16 B; bf16 autocast copies +2 B; a reference model +4 B."""
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(precision=Precision.bfloat16))
    s = replace(s, cluster=replace(s.cluster, gpus_per_node=1), loss=replace(s.loss, kl_coef=0.1))
    p = mem.estimate(s).policy
    n = 1_213_302_784
    assert [p[k].bytes for k in ("weights", "grads", "optimizer", "autocast copies", "reference")] == [
        4 * n, 4 * n, 8 * n, 2 * n, 4 * n]


def test_torch_backend_shards_with_fsdp2_over_dp():
    """DP 8: weights, grads, AdamW state, the reference and the step temp / 8; the unsharded compute copies of the
    root and two layers (bf16), one layer's gradient (bf16 + its fp32 copy), the refit's full bf16 gather."""
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(precision=Precision.bfloat16))
    s = replace(s, cluster=replace(s.cluster, gpus_per_node=8), loss=replace(s.loss, kl_coef=0.1))
    p = mem.estimate(s).policy
    n = 1_213_302_784
    root = 2 * 32000 * 2048 + 2048  # embedding + output layer + final norm = 131,074,048
    layer = 10_487_808 + 34_605_056  # attention + MLP = 45,092,864
    assert [p[k].bytes for k in ("weights", "grads", "optimizer", "reference", "optimizer step temp")] == [
        4 * n / 8, 4 * n / 8, 8 * n / 8, 4 * n / 8, 4 * n / 8]
    assert "autocast copies" not in p
    assert p["fsdp gathered weights"].bytes == 2 * (root + 2 * layer) == 442_519_552
    assert p["fsdp gradient buffers"].bytes == (2 + 4) * layer
    assert p["refit gather"].bytes == 2 * 32000 * 2048  # one tensor at a time: the largest, the embedding, bf16
    e = mem.estimate(s)
    assert e.phases["refit"] == pytest.approx((20 * n / 8 + 2 * 32000 * 2048) / shapes.GIB)  # resident 20 B / 8
    assert e.host["checkpoint gather (node 0)"].bytes == 12 * n  # full-state save: fp32 weights + m, v on rank 0


def test_activation_bytes_per_token_per_layer():
    a = shapes.arch_of(RunSpec(model=LLAMA_1B))
    h, q, kv, f = 2048, 2048, 512, 5632

    def per_layer(tp: int, sp: bool) -> float:
        k = shapes.layer_activation_bytes(a, "megatron", 2, False, shapes.Layout(tp, 1, 1, 1, 1, sp, 8))
        return k["attention"] + k["mlp"]

    # megatron bf16: two norms 2·(4h + 3·2·h) (fp32 upcast, normalised, the next linear's input), attention
    # 2·(3q + 3kv) (fused QKV kept by the V view, RoPE'd q, k, SDPA output), SwiGLU MLP 5·2·f
    full = 2 * 10 * h + 2 * (3 * q + 3 * kv) + 10 * f
    assert per_layer(1, False) == full == 20 * h + 6 * q + 6 * kv + 10 * f == 112_640
    assert per_layer(2, False) == 2 * 10 * h + (2 * (3 * q + 3 * kv) + 10 * f) / 2 == 76_800  # norms replicated
    assert per_layer(2, True) == full / 2  # Korthikanti eq. 5: SP splits the rest too
    # torch (HF, fp32 residual, bf16 autocast): norms 2·8h, casts 6h + 4h, SDPA 2·(2q + 2kv), SwiGLU 8f
    k = shapes.layer_activation_bytes(a, "torch", 2, True, shapes.Layout(1, 1, 1, 1, 1, False, 1))
    assert k["attention"] + k["mlp"] == 30 * h + 4 * kv + 8 * f == 108_544
    # megatron's fused SwiGLU (GPUs, train.fused_kernels): fc1's output 2·2f and fc2's input 2f, not 5·2·f
    k = shapes.layer_activation_bytes(a, "megatron", 2, False, shapes.Layout(1, 1, 1, 1, 1, False, 8), fused=True)
    assert k["attention"] + k["mlp"] == 20 * h + 6 * q + 6 * kv + 6 * f == 112_640 - 4 * f


def test_megatron_fused_swiglu_saves_only_its_input():
    """What the fused count rests on: megatron-core's SwiGLU Function (MLP.forward's path with
    bias_activation_fusion, the megatron worker's default on GPUs) saves only fc1's gate|up output [tokens, 2f] and
    recomputes silu in its backward; the unfused path megatron's MLP runs (`glu`: silu(gate), up + offset, their
    product) saves the input, silu(gate) and up + offset. fc2 saves the product in both: 3 tensors of f vs 5."""
    torch = pytest.importorskip("torch")
    fused_swiglu = pytest.importorskip("megatron.core.fusions.fused_bias_swiglu")
    tokens, f = 16, 64
    y = torch.randn(tokens, 2 * f, dtype=torch.bfloat16, requires_grad=True) * 1  # fc1's output (non-leaf)

    def unfused() -> None:  # megatron/core/transformer/mlp.py MLP.forward, bias_activation_fusion off
        gate, up = torch.chunk(y, 2, dim=-1)
        torch.nn.functional.silu(gate) * (up + 0.0)

    fused = _saved_storages(lambda: fused_swiglu.bias_swiglu_impl(y, None))
    assert sum(fused.values()) == 2 * 2 * f * tokens  # the input alone: 2 tensors of f in bf16
    assert sum(_saved_storages(unfused).values()) == 2 * 4 * f * tokens  # input (2f) + silu(gate) + up + 0


def test_megatron_activations_count_the_fused_swiglu_where_the_worker_fuses():
    """policy/megatron_policy.py fuses SwiGLU with CUDA unless train.fused_kernels=false; the CPU build never does."""
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(backend=TrainBackend.megatron, precision=Precision.bfloat16,
                                                micro_batch_size=2, max_total_sequence_length=1024))
    gpu = replace(s, cluster=replace(s.cluster, gpus_per_node=1))
    off = replace(gpu, train=replace(gpu.train, fused_kernels=False))
    tokens, saved = 2 * 1024, 4 * 5632  # bytes per token and layer the fusion does not save (2 of 5 f-tensors)
    fused, unfused, cpu = (mem.estimate(x).policy["activations"] for x in (gpu, off, s))
    assert unfused.bytes - fused.bytes == 24 * saved * tokens and "(fused SwiGLU)" in fused.how
    assert cpu.bytes == unfused.bytes and "fused" not in unfused.how


def test_activation_checkpointing_keeps_layer_inputs():
    """Full recomputation: 2·h bytes per token per layer (Korthikanti §5) + the final norm/output input."""
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(backend=TrainBackend.megatron, precision=Precision.bfloat16,
                                                micro_batch_size=2, max_total_sequence_length=1024,
                                                activation_checkpointing=True))
    s = replace(s, cluster=replace(s.cluster, gpus_per_node=1))
    e = mem.estimate(s)
    tokens = 2 * 1024
    final = 10 * 2048 + 4 * 128  # final norm + output layer input, RoPE's fp32 cos/sin
    assert e.policy["activations"].bytes == 24 * 2 * 2048 * tokens + final * tokens
    # one layer re-materialised on a GPU: megatron's fused SwiGLU saves 6f, not 10f (112,640 - 4f B per token)
    assert e.policy["activation work"].bytes == 2 * (112_640 - 4 * 5632) * tokens


def test_torch_activation_checkpointing_keeps_layer_inputs():
    """The torch worker's checkpointed layers keep their input: fp32 (4·h) on one rank (fp32 residual stream),
    bf16 (2·h) under FSDP2's bf16 compute; one layer re-materialised (108,544 B/token, the module doc) + its grads."""
    base = RunSpec(model=LLAMA_1B, train=TrainSpec(precision=Precision.bfloat16, micro_batch_size=2,
                                                   max_total_sequence_length=1024, activation_checkpointing=True))
    tokens = 2 * 1024
    final = 8 * 2048 + 2 * 2048 + 2 * 4 * 128  # final norm (fp32) + the output layer's bf16 input, RoPE cos/sin
    for gpus, res in ((1, 4), (8, 2)):
        e = mem.estimate(replace(base, cluster=replace(base.cluster, gpus_per_node=gpus)))
        assert e.policy["activations"].bytes == 24 * res * 2048 * tokens + final * tokens
        assert e.policy["activation work"].bytes == 2 * 108_544 * tokens


# a Mamba-2 block small enough to count by hand: hidden 8, 2 heads × 4 (d 8), state 3, 1 group (B, C: 3 wide;
# conv width cd = 8 + 2·3 = 14; in_proj out 8 + 14 + 2 = 24), conv 4, chunk 4; rows of s = 6 tokens (c = 2 chunks,
# padded to S = 8), bf16 autocast (act 2)
SMALL_MAMBA = shapes.Arch(hidden=8, heads=1, kv_heads=1, head_dim=8, ffn=8, vocab=16, attention=0, mlp=0, moe=0,
                          mamba=1, mamba_heads=2, mamba_head_dim=4, groups=1, state=3, conv=4, chunk=4, hybrid=True)


def test_mamba_saved_bytes_by_hand_on_each_path():
    a, s = SMALL_MAMBA, 6
    common = s * (8 * 8 + 4 + 2 * 8 + 8)  # block norm in/out + rsqrt, in_proj's input cast, the int64 mask: 552
    conv = 2 * 14 * s + 2 * 14 * (s + 3)  # conv input cast [cd, s], its output [cd, s + K - 1]: 420
    out_proj = 2 * 8 * s  # 96
    real = s * (2 * 2 * 2 + 8 * 2 + 4 * 8)  # softplus/clamp inputs, two fp32 dt casts, x.float(): 336
    # per padded token: 8d + 4hn + 4hQ + 2·2·hQ + 4·2·hn + 3·2·d + 8h = 64 + 24 + 32 + 32 + 48 + 48 + 16 = 264
    padded = 8 * 264
    states = 2 * 2 * 4 * 3 * (3 + 2) + (4 + 2) * 2 * 3 ** 2  # chunk states [c + 1 and c, h, p, n], decay_chunk: 348
    torch_norm = s * (16 * 8 + 4 * 1)  # gated RMSNorm on the fp32 scan output: 792
    assert shapes.mamba_saved_bytes(a, "torch", s, 2) == common + conv + real + padded + states + torch_norm + \
        out_proj == 4656
    scan = s * 2 * (8 + 14 + 24) + 4 * 2 * 8  # output, x/B/C storage, in_proj's output (dt); dA_cumsum [h, c, Q]
    assert shapes.mamba_saved_bytes(a, "kernels", s, 2) == common + conv + scan + s * (16 * 8 + 2 * 8 + 4) + \
        out_proj == 2572
    assert shapes.mamba_saved_bytes(a, "fused", s, 2) == common + s * (2 * 24 + 2 * 8 + 4 * 1) == 960
    assert shapes.mamba_work_bytes(a, "torch", s, 2) == 4656 / 2  # half of one block again
    # kernels: + chunk states and their gradient [c, h, p, n] fp32, C·Bᵀ [c, g, Q, Q] fp32 over S tokens
    assert shapes.mamba_work_bytes(a, "kernels", s, 2) == 2572 + 8 * (8 * 2 * 4 * 3 / 4 + 4 * 1 * 4)
    assert shapes.mamba_fixed_bytes(a, "fused", True) == 2 * 8 * 8 and shapes.mamba_fixed_bytes(a, "kernels", True) == 0


def _saved_storages(fn, skip=lambda t: False) -> dict[int, int]:
    """{storage pointer: bytes} of every tensor autograd saves while fn() runs (but those `skip` names)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        if not skip(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


@pytest.mark.parametrize("seq", [16, 64, 100, pytest.param(300, marks=pytest.mark.extended)])  # 300: ~13 s
def test_mamba_torch_path_counts_what_transformers_saves(seq):
    """mamba_saved_bytes("torch") against what autograd keeps for transformers' NemotronH Mamba-2 block at
    nemotron_h_1b's width (the pure-torch path this CPU runs) under bf16 autocast: rows padded to 1, 2, 5 chunks and
    a full one, within 0.5 % (the parameters and autocast's cached weight casts, the same in two forwards, left out)."""
    import torch
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    from grpo_launcher.models.nemotron_h import bind_mamba_kernels, nemotron_h_config

    spec = load_spec(["model=nemotron_h_1b", "model.num_layers=1"])  # Nano's pattern starts with a Mamba-2 layer
    config = NemotronHConfig(**nemotron_h_config(spec.model, 512, 2, 0))
    bind_mamba_kernels(SimpleNamespace(config=config), on_cuda=False)  # the torch path, as the CPU worker binds it
    block = NemotronHBlock(config, 0)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0  # right padding: the mixer multiplies by the mask
    outs = []  # the first forward's graph kept alive: its storages cannot be reused by the second

    def forward() -> None:  # a fresh input (the block's norm saves it) and mask each time
        x = torch.randn(2, seq, spec.model.hidden_size, requires_grad=True)
        outs.append(block(x, attention_mask=mask.clone()))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = _saved_storages(forward)
        second = _saved_storages(forward)
    measured = sum(n for k, n in second.items() if k not in first)
    assert measured == pytest.approx(2 * shapes.mamba_saved_bytes(shapes.arch_of(spec), "torch", seq, 2), rel=0.005)


def test_logits_peak_vocab_times_tokens():
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(backend=TrainBackend.megatron, precision=Precision.bfloat16,
                                                micro_batch_size=1, max_total_sequence_length=4096,
                                                logprob_chunk_tokens=0))  # whole logits
    s = replace(s, cluster=replace(s.cluster, gpus_per_node=1), rollout=replace(s.rollout, max_new_tokens=2048))
    # 6·V·L (bf16 logits kept by the response gather, its zero-filled gradient, the output layer's contiguous
    # copy) + 16·V·T (fp32 log-softmax, its gradient, bf16 copies)
    assert mem.estimate(s).policy["logits"].bytes == 6 * 32000 * 4096 + 16 * 32000 * 2048 == 1_835_008_000


def test_chunked_output_layer_replaces_the_logits_term():
    """train.logprob_chunk_tokens (torch): one chunk of logits at a time, not [tokens, V] (algos/linear_logprobs)."""
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(precision=Precision.bfloat16, micro_batch_size=4,
                                                logprob_batch_size=64, max_total_sequence_length=2048))
    s = replace(s, cluster=replace(s.cluster, gpus_per_node=1), rollout=replace(s.rollout, max_new_tokens=512))
    whole = mem.estimate(replace(s, train=replace(s.train, logprob_chunk_tokens=0)))
    chunked = mem.estimate(s)
    tokens, lp_tokens = 4 * 2048, 64 * 2048
    assert chunked.policy["logits"].bytes == 12 * 32000 * 4096 + (2 * 2048 + 16) * tokens
    assert chunked.policy["logprob logits"].bytes == 10 * 32000 * 4096 + (2 * 2048 + 16) * lp_tokens
    saved = whole.policy["logprob logits"].bytes - chunked.policy["logprob logits"].bytes
    assert saved > 25 * 2**30  # the 1.21B run's logprob phase (batch 64 x 2048) loses its ~27 GiB of logits
    assert whole.phases["logprobs"] - chunked.phases["logprobs"] == pytest.approx(saved / 2**30)


def test_kv_cache_bytes_per_token():
    a = shapes.arch_of(load_spec(["model=llama3_1_8b", "rollout.max_new_tokens=16", "cluster=slurm",
                               "dry_run=true"]))
    assert shapes.kv_bytes_per_token(a, 1, 2) == 2 * 32 * 8 * 128 * 2 == 131_072  # Llama 3 8B: 128 KiB/token
    assert shapes.kv_bytes_per_token(a, 4, 2) == 131_072 / 4
    assert shapes.kv_bytes_per_token(a, 16, 2) == 2 * 32 * 1 * 128 * 2  # TP > KV heads: replicated, ≥ 1 per rank


def test_phases_peak_and_summary_line():
    spec = spec_of(NANOV3)
    e = mem.estimate(spec)
    assert spec.rollout.gpu_memory_utilization == 0.5  # the seed's value: the engines sleep through the update
    assert e.rollout_gib == pytest.approx(0.5 * 79.6)  # awake, the engine claims its whole budget
    assert e.asleep_gib == pytest.approx(0.75 + 1.3 + 1.0)  # asleep: CUDA context, NCCL (engine TP 4), CUDA graphs
    assert e.policy_phase == max(e.phases, key=e.phases.get) == "train"
    ctx = e.context_gib
    # through the rollout the policy holds its optimizer step's memory (calibrated: benchmarks/results/memory.md)
    held = e.phases["optimizer step"]
    assert e.totals["generate"] == pytest.approx(held + mem.ALLOCATOR_SLACK * (held - e.phases["generate"])
                                                 + e.rollout_gib + ctx)
    assert e.totals["train"] == pytest.approx(e.policy_reserved_gib + e.asleep_gib + ctx)
    assert e.peak_phase == "generate" and e.peak_gib == max(e.totals.values())
    line = memory_report.summary_line(e)
    assert line.startswith("memory per GPU: policy ") and "of 79.6 GiB (" in line and e.fits
    assert "(3.0 asleep through logprobs + update)" in line and line.endswith("in the generate phase")


def test_engines_awake_hold_their_budget_in_every_phase():
    """rollout.sleep_mode=false: every phase is the policy's + the engine's whole budget + contexts; the seed's
    0.5 then peaks at 101 % of an H100 (megatron's train phase), and the refusal names sleep mode as the fix."""
    e = mem.estimate(spec_of([*NANOV3, "rollout.sleep_mode=false"]))
    assert e.asleep_gib is None
    assert e.totals == pytest.approx({p: mem.phase_reserved(e, p) + e.rollout_gib + e.context_gib for p in e.phases})
    assert e.peak_phase == "train" and e.peak_gib == pytest.approx(e.policy_reserved_gib + e.rollout_gib + e.context_gib)
    with pytest.raises(ConfigError) as info:
        load_spec([*NANOV3, "rollout.sleep_mode=false"])
    (v,) = [v for v in info.value.violations if v.rule == "gpu_memory_fits"]
    assert "rollout.sleep_mode" in v.keys and "> 79.6 GiB (105 %) in the train phase" in v.message
    assert v.fix.startswith("cheapest: rollout.sleep_mode=true → peak 59.0 GiB")


def test_sleep_residue_and_the_refit_phase_with_fsdp2():
    """The residue: the engine's CUDA context, + NCCL with engine TP > 1, + CUDA graphs unless eager. FSDP2's refit
    phase wakes the engine's weights (the KV cache waits for the new weights): policy refit + weights + residue."""
    one = spec_of(["rollout=vllm", "cluster=slurm", "dry_run=true", "rollout.enforce_eager=true"])
    assert mem.sleep_residue(one) == 0.75
    assert mem.sleep_residue(replace(one, rollout=replace(one.rollout, tensor_parallel_size=2,
                                                          enforce_eager=False))) == 0.75 + 1.3 + 1.0
    e = mem.estimate(spec_of([*NANOV3, "train.backend=torch"]))
    assert e.totals["refit"] == pytest.approx(mem.phase_reserved(e, "refit") + e.engine_weights_gib + e.asleep_gib
                                              + e.context_gib)
    assert e.engine_weights_gib == pytest.approx(31.6e9 * 2 / 4 / 2**30, rel=0.01)  # bf16 / engine TP 4


def test_nanov3_on_torch_fits_an_h100_on_mamba_kernels_with_the_engines_asleep():
    """The recipe's own command on the torch backend (FSDP2 over 256 GPUs, TP/PP/CP/EP resolved to 1), its Mamba-2
    layers on mamba-ssm's Triton scan: the train phase (policy + the engine's residue) under an H100's 79.6 GiB; awake
    engines would not fit. transformers' pure-torch Mamba-2 on 49k-token rows does not: without mamba-ssm the plan
    is refused, and the fix names it."""
    spec, _ = resolve(to_spec(compose([*NANOV3, "train.backend=torch"])), [])
    e = mem.estimate(spec, mamba="kernels")
    assert e.fits and e.peak_phase == "train" and 60 < e.peak_gib < 79.6
    assert e.totals["generate"] < e.peak_gib  # the shards (1.8 GiB) + the engine's budget
    awake = replace(spec, rollout=replace(spec.rollout, sleep_mode=False))
    assert mem.estimate(awake, mamba="kernels").peak_gib > 79.6
    assert mem.estimate(spec, mamba="torch").peak_gib > 79.6
    if mem.mamba_path_of(spec) == ("torch", True):  # this interpreter has no mamba-ssm: the plan counts pure torch
        (v,) = [v for v in memory_report.violations(spec) if v.rule == "gpu_memory_fits"]
        assert "mamba-ssm where the policy runs" in v.fix and f"peak {e.peak_gib:.1f} GiB" in v.fix


# ------------------------------------------------------------------ refusal and acceptance


def test_nanov3_32_nodes_fits_and_2_nodes_is_refused_with_the_arithmetic():
    load_spec(NANOV3)  # accepted (the memory rule included)
    with pytest.raises(ConfigError) as info:  # DP 1: the whole optimizer on each rank; engines awake (asleep: 97 %)
        load_spec([*NANOV3, "cluster.nodes=2", "rollout.sleep_mode=false"])
    (v,) = [v for v in info.value.violations if v.rule == "gpu_memory_fits"]
    assert "cluster.nodes" in v.keys and "rollout.gpu_memory_utilization" in v.keys
    assert "> 79.6 GiB" in v.message and "optimizer" in v.message and "logits" in v.message
    # calibrated at 0.1-3B on an H200 (benchmarks/results/memory.md): no single key makes 2 nodes fit any more
    assert v.fix.startswith("no single change found")


def test_unknown_gpu_memory_skips_the_check_with_a_warning():
    spec = load_spec([*NANOV3, "cluster.nodes=2", "cluster.gpu_memory_gib=null"])  # no refusal
    text = memory_report.report(spec)
    assert "check skipped" in text.splitlines()[0] and "warning: cluster.gpu_memory_gib is null" in text


def test_h200_budget_and_torch_backend_refusal():
    # an 8B model on one GPU of the torch backend (one rank: nothing to shard, 16 + 2 autocast + 4 step temp
    # B/param) cannot fit an 80 GB card; FSDP2 over more ranks does: the fix names cluster.nodes
    over = ["model=llama3_1_8b", "rollout.max_new_tokens=16", "cluster=slurm", "dry_run=true",
            "cluster.gpus_per_node=8", "train.precision=bfloat16", "train.micro_batch_size=1",
            "train.logprob_batch_size=1", "train.global_batch_size=128"]
    with pytest.raises(ConfigError) as info:
        load_spec([*over, "cluster.gpus_per_node=1"])
    (v,) = [v for v in info.value.violations if v.rule == "gpu_memory_fits"]
    # the policy holds its optimizer step's memory through the next rollout (benchmarks/results/memory.md)
    assert "generate phase" in v.message and "optimizer step temp" in v.message and "cluster.nodes=4 → peak" in v.fix
    spec = load_spec(over)  # 8 GPUs: fits, (4 + 4 + 8) B / 8 resident + the step's 4 B / 8
    n = shapes.param_counts(shapes.arch_of(spec)).total(shapes.arch_of(spec))
    e = mem.estimate(spec)
    assert e.fits and e.phases["optimizer step"] == pytest.approx(20 * n / 8 / shapes.GIB)
    # megatron without the distributed optimizer on an H200: the optimizer step's peak is refused ...
    mega = [*over, "train.backend=megatron", "cluster.gpu_memory_gib=140.4"]
    with pytest.raises(ConfigError) as info:
        load_spec(mega)
    (v,) = [v for v in info.value.violations if v.rule == "gpu_memory_fits"]
    assert "generate phase" in v.message and "train.distributed_optimizer=true → peak" in v.fix
    ok = ["model=llama3_1_8b", "rollout.max_new_tokens=16", "cluster=slurm", "dry_run=true",
          "cluster.gpus_per_node=8", "cluster.gpu_memory_gib=140.4", "train.precision=bfloat16",
          "train.backend=megatron", "train.distributed_optimizer=true", "train.micro_batch_size=1",
          "train.logprob_batch_size=1",
          "train.global_batch_size=128", "train.max_total_sequence_length=2048", "env.max_prompt_tokens=1024"]
    assert mem.estimate(load_spec(ok)).fits


def test_engine_budget_too_small_for_one_sequence():
    with pytest.raises(ConfigError) as info:
        load_spec([*NANOV3, "rollout.gpu_memory_utilization=0.2"])
    keys = [v.keys for v in info.value.violations if v.rule == "gpu_memory_fits"]
    assert any(k[0] == "rollout.gpu_memory_utilization" for k in keys)


def test_cpu_runs_have_no_gpu_budget():
    spec = load_spec([])
    assert memory_report.violations(spec) == []
    assert memory_report.report(spec) == "memory per GPU: CPU run (no GPU budget)"


def test_cli_dry_run_prints_the_line_and_refuses_2_nodes():
    p = launch(*NANOV3, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "memory per GPU: policy " in p.stdout and "GiB of 79.6 GiB (" in p.stdout
    assert "host RAM per node" in p.stdout and "extrapolated" in p.stdout
    p = launch(*NANOV3, "cluster.nodes=2", "rollout.sleep_mode=false", timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("config error")
    assert "gpu_memory_fits" in p.stderr and "fix: " in p.stderr and "Traceback" not in p.stderr


def test_cpu_offload_moves_the_shards_to_the_host():
    """train.cpu_offload (FSDP2's CPUOffloadPolicy, also on one rank): the GPU keeps no weights, grads, AdamW state
    or step temp, only the gathered layers (+ their fp32 shards copied in) and the activations; each node's host
    RAM holds its ranks' 20 B per parameter / DP. An 8B model on one 80 GB GPU: refused as it is, fits offloaded."""
    one = ["model=llama3_1_8b", "rollout.max_new_tokens=16", "cluster=slurm", "dry_run=true",
           "cluster.gpus_per_node=1", "train.precision=bfloat16", "train.micro_batch_size=1",
           "train.logprob_batch_size=1", "train.global_batch_size=128"]
    assert not mem.estimate(spec_of(one)).fits
    e = mem.estimate(spec_of([*one, "train.cpu_offload=true"]))
    n = shapes.param_counts(shapes.arch_of(spec_of(one))).total(shapes.arch_of(spec_of(one)))
    assert e.fits and [e.policy[k].bytes for k in ("weights", "grads", "optimizer", "optimizer step temp")] == [0] * 4
    assert e.phases["generate"] == 0 and e.peak_phase == "train"
    root, layer = 2 * 128256 * 4096 + 4096, e.policy["fsdp gradient buffers"].bytes / 10  # (2 + 4 + 4) B × layer
    assert e.policy["fsdp gathered weights"].bytes == pytest.approx((2 + 4) * (root + 2 * layer))
    assert e.host["offloaded shards"].bytes == 20 * n  # one rank per node, DP 1
    assert e.context_gib == pytest.approx(mem.estimate(spec_of(one)).context_gib + 1.3)  # a 1-rank group: NCCL
    eight = mem.estimate(spec_of([*one, "cluster.gpus_per_node=8", "train.cpu_offload=true"]))
    assert eight.host["offloaded shards"].bytes == pytest.approx(8 * 20 * n / 8)  # 8 ranks per node, DP 8


# ------------------------------------------------------------------ against measured whole-GPU peaks (issue 43)

# The H200 runs of benchmarks/memory_scale.py (raw JSON: nvidia-smi's largest sample of the whole card). The
# 1.5b-megatron awake row was measured while vLLM still sized its KV cache from the memory free during its
# profiling (29.75 of its 42.1 GiB budget beside megatron's init; the engine is given its size now): its whole-GPU
# error keeps that 14.3 GiB on the safe side, so its policy worker is also checked on its own below
CALIBRATION = {"0.1b": "memory_scale_0.1b.json", "1.5b": "memory_scale_1.5b.json",
               "3b-sleep": "memory_scale_3b-sleep.after-fix.json",
               "1.5b-megatron-sleep": "memory_scale_1.5b-megatron-sleep.json",
               "1.5b-megatron": "memory_scale_1.5b-megatron.json"}


def _recorded_row(row: str, tmp_path) -> tuple[dict, mem.Estimate]:
    """The row's raw JSON and the estimate for its overrides (benchmarks/memory_scale.py) on the card it ran on."""
    found = importlib.util.spec_from_file_location("memory_scale", ROOT / "benchmarks" / "memory_scale.py")
    scale = importlib.util.module_from_spec(found)
    found.loader.exec_module(scale)
    measured = json.loads((ROOT / "benchmarks/results/gpu-raw/memory_scale" / CALIBRATION[row]).read_text())
    assert measured["row"] == row and measured["exit"] == 0
    card = measured.get("gpu_gib", 140.4)  # the card the row ran on (H200 rows before the key)
    return measured, mem.estimate(load_spec([*scale.overrides(row, tmp_path, 2, card), "dry_run=true"]))


@pytest.mark.parametrize("row", CALIBRATION)
def test_the_prediction_is_within_minus_3_and_plus_15_percent_of_the_measured_peak(row, tmp_path):
    """The issue's target at 0.1-3B, both backends, engines awake and asleep, prompt- and decode-heavy: the dry run's
    peak never below nvidia-smi's by more than 3 %, never above by more than 15 % (b4e6e4d's model: 1.5b -3.9 %,
    3b-sleep -9.6 %, 1.5b-megatron-sleep -6.2 %; the files' predicted_gib; 1.5b-megatron +24.9 % before the fused
    SwiGLU was counted)."""
    measured, e = _recorded_row(row, tmp_path)
    assert -0.03 <= e.peak_gib / measured["measured_gib"] - 1 <= 0.15, (e.peak_gib, measured["measured_gib"])


@pytest.mark.parametrize("row, worker", [("1.5b", "TorchPolicyWorker"), ("1.5b-megatron", "MegatronPolicyWorker")])
def test_the_decode_heavy_policy_workers_own_peak_is_its_train_phase(row, worker, tmp_path):
    """Decode-heavy (256 × (256 + 1024), micro-batches of 10,240 tokens) the policy process peaks in step 2's train
    phase: nvidia-smi's largest reading of that process against the train phase's reserved GiB + its CUDA context
    (+ NCCL for megatron), within -3 % ... +5 %. Megatron: 71.74 GiB measured, 70.7 predicted; 82.2 when megatron's
    SwiGLU was counted unfused (+14.5 %: its 10f B/token/layer instead of the fused 6f)."""
    measured, e = _recorded_row(row, tmp_path)
    peak = max(mib for name, mib in measured["per_process_mib"].items() if worker in name) / 1024
    outside = mem.CUDA_CONTEXT_GIB + (mem.NCCL_GIB if worker.startswith("Megatron") else 0.0)
    predicted = mem.phase_reserved(e, "train") + outside
    assert -0.03 <= predicted / peak - 1 <= 0.05, (predicted, peak)


# ------------------------------------------------------------------ the path that runs (attention, logprob head)

GEMMA2_2B = dict(model_type="gemma2", num_hidden_layers=26, hidden_size=2304, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000,
                 max_position_embeddings=8192, tie_word_embeddings=True)


def _model_dir(tmp_path, name: str, **config) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _gpu_spec(model_dir: str, family: str, **train) -> RunSpec:
    """A one-GPU torch run (bf16) of the model in model_dir, sized as its config.json says (Gemma-2 2B's shape)."""
    c = GEMMA2_2B
    m = ModelSpec(name=family, family=family, path=model_dir, num_layers=c["num_hidden_layers"],
                  hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
                  num_kv_heads=c["num_key_value_heads"], ffn_hidden_size=c["intermediate_size"],
                  vocab_size=c["vocab_size"], max_position_embeddings=8192, dtype=Precision.bfloat16)
    s = RunSpec(model=m, train=TrainSpec(precision=Precision.bfloat16, **train))
    return replace(s, cluster=replace(s.cluster, gpus_per_node=1, gpu_memory_gib=140.4))


@pytest.mark.parametrize("config, eager", [
    ({}, True),  # absent: Gemma2Config's default cap (50)
    ({"attn_logit_softcapping": 5.0}, True),
    ({"attn_logit_softcapping": None}, False),
    ({"model_type": "gemma3_text"}, False),  # Gemma3TextConfig's default: None
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 20.0}, True),
    ({"model_type": "llama"}, False),
])
def test_eager_attention_is_models_attention_choice(config, eager, tmp_path):
    """memory_shapes.eager_attention reads config.json as files and decides as models/attention.py hf_attention does
    with transformers' AutoConfig (the class default where the key is absent)."""
    from grpo_launcher.models.attention import hf_attention

    cfg = {**GEMMA2_2B, **config}
    d = _model_dir(tmp_path, "m", **cfg)
    assert (hf_attention(d).get("attn_implementation") == "eager") is eager
    assert shapes.eager_attention(_gpu_spec(d, cfg["model_type"])) is eager
    megatron = _gpu_spec(d, cfg["model_type"])
    assert not shapes.eager_attention(replace(megatron, train=replace(megatron.train, backend=TrainBackend.megatron)))


def test_eager_attention_scores_are_counted_in_the_update_and_the_logprob_pass(tmp_path):
    """A softcapped Gemma-2 runs eager attention (models/attention.py): every layer saves its [heads, T, T] scores 3
    times (tanh's output, the fp32 softmax, its bf16 cast: 8 B per score) and the logprob pass holds one layer's (10 B
    per score in bf16) and the fp32 masks. Gemma-2 2B's shape, 2 rows of 2048 tokens: 26 × 8 × 8 heads × 2048 B per token = 6.5 GiB
    more activations than the same model on sdpa (attn_logit_softcapping=null); b4e6e4d counted none of it."""
    on = _gpu_spec(_model_dir(tmp_path, "on", **GEMMA2_2B), "gemma2", micro_batch_size=2, logprob_batch_size=4,
                   max_total_sequence_length=2048)
    off = replace(on, model=replace(on.model, path=_model_dir(tmp_path, "off", **GEMMA2_2B,
                                                               attn_logit_softcapping=None)))
    e_on, e_off = mem.estimate(on), mem.estimate(off)
    tokens, lp_tokens, per_score = 2 * 2048, 4 * 2048, 8 * 2048  # heads × T per token
    saved = 8 * per_score  # bytes per token and layer
    assert e_on.policy["activations"].bytes - e_off.policy["activations"].bytes == 26 * saved * tokens
    assert e_on.policy["activation work"].bytes - e_off.policy["activation work"].bytes == saved * tokens
    assert "eager attention's [T, T] scores" in e_on.policy["activations"].how
    fwd = 10 * per_score + 2 * 4 * 2048  # one layer's transient scores + the fp32 masks of the 2 layer types
    assert e_on.phases["logprobs"] - e_off.phases["logprobs"] == pytest.approx(fwd * lp_tokens / shapes.GIB)
    assert e_on.peak_gib - e_off.peak_gib > 6.5


def test_eager_score_bytes_are_what_transformers_saves():
    """eager_score_bytes against what autograd keeps for a tiny Gemma-2 (2 layers, 8 heads) on eager vs sdpa, fp32 and
    bf16 autocast, one padded row of 256 tokens: the difference is the layers' scores, 8 B each, less SDPA's own
    logsumexp [heads, T] fp32 per layer (the shared [1, 1, T, T] mask, which the CPU SDPA kernel saves, left out).
    The peaks: benchmarks/eager_attention_memory.py (benchmarks/results/memory.md)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    seq, heads, layers = 256, 8, 2
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=4, head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=50.0)
    ids, mask = torch.randint(0, 64, (1, seq)), torch.ones(1, seq, dtype=torch.long)
    mask[0, -3:] = 0  # a padded row: a 4-D mask, as the worker's batches have
    a = shapes.Arch(hidden=32, heads=heads, kv_heads=4, head_dim=8, ffn=64, vocab=64, attention=layers, mlp=layers,
                    moe=0, mamba=0)
    for bf16, act in ((False, 4), (True, 2)):
        saved = {}
        for attn in ("eager", "sdpa"):
            torch.manual_seed(0)
            model = Gemma2ForCausalLM(Gemma2Config(**cfg, attn_implementation=attn)).train()
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                got = _saved_storages(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False),
                                      skip=lambda t: t.untyped_storage().data_ptr() in params
                                      or (t.dim() == 4 and t.shape[1] == 1 and t.shape[-1] == seq))
            saved[attn] = sum(got.values())
        lse = layers * heads * seq * 4
        assert saved["eager"] - saved["sdpa"] == layers * shapes.eager_score_bytes(a, act, seq) * seq - lse, bf16


def test_the_logits_term_follows_the_logprob_head_the_plan_prints(tmp_path):
    """The torch worker's head is logit_heads.head_for's (the plan's "logprob head" line): whole logits where config.json
    holds a post-processing the chunked head does not reproduce (a llama with logits_scaling: 2·2·V·L + 10·V·T, not
    one chunk; b4e6e4d counted the chunk), one more fp32 [chunk, V] temporary where the chunked head applies the
    family's transform (Gemma-2's final softcap), and tanh's saved [L, V] output on whole logits of a softcapped one."""
    base = GEMMA2_2B | {"attn_logit_softcapping": None}
    train = dict(micro_batch_size=2, logprob_batch_size=4, max_total_sequence_length=2048)
    v, tokens, lp_tokens, c = 256000, 2 * 2048, 4 * 2048, 4096
    llama = base | {"model_type": "llama"}
    plain = mem.estimate(_gpu_spec(_model_dir(tmp_path, "llama", **llama), "llama", **train))
    odd = _gpu_spec(_model_dir(tmp_path, "odd", **llama, logits_scaling=2.0), "llama", **train)
    resp = odd.rollout.max_new_tokens * 2
    e = mem.estimate(odd)
    assert e.policy["logits"].bytes == 4 * v * tokens + 10 * v * resp and "whole logits: llama's" in e.policy[
        "logits"].how
    assert mem.logprob_head(odd).chunk == 0 and "logits_scaling=2.0" in mem.logprob_head(odd).why
    assert plain.policy["logits"].bytes == 12 * v * c + (2 * 2304 + 16) * tokens  # chunked, no transform
    capped = mem.estimate(_gpu_spec(_model_dir(tmp_path, "gemma2", **base), "gemma2", **train))
    assert capped.policy["logits"].bytes - plain.policy["logits"].bytes == 4 * v * c
    assert capped.policy["logprob logits"].bytes - plain.policy["logprob logits"].bytes == 4 * v * min(c, lp_tokens)
    whole = _gpu_spec(_model_dir(tmp_path, "whole", **base), "gemma2", **train, logprob_chunk_tokens=0)
    plain_whole = _gpu_spec(_model_dir(tmp_path, "lw", **llama), "llama", **train, logprob_chunk_tokens=0)
    assert mem.estimate(whole).policy["logits"].bytes - mem.estimate(plain_whole).policy["logits"].bytes == \
        2 * v * tokens
    # megatron: chunked by the key, never a transform (pre-flight refuses those families there)
    meg = replace(odd, train=replace(odd.train, backend=TrainBackend.megatron))
    assert mem.logprob_head(meg).chunk == 4096 and mem.logprob_head(meg).transform is None


@pytest.mark.parametrize("transform", [{"softcap": 30.0}, {"divide": 4.0}])
def test_a_logit_transform_adds_one_fp32_chunk_to_the_heads_peak(transform):
    """What the +4·V per chunk token rests on: algos/linear_logprobs' peak (the profiler's allocation events, CPU, fp32)
    over the backward and over a no-grad forward, with the transform minus without, is one fp32 [chunk, V]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo_launcher.algos.linear_logprobs import linear_logprobs
    from grpo_launcher.logit_heads import LogitTransform

    n, h, v, c = 256, 16, 4096, 128

    def peak(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        cur = top = 0
        for _, b in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                           if e.name() == "[memory]"):
            cur += b
            top = max(top, cur)
        return top

    got = {}
    for tr in (None, LogitTransform(**transform)):
        torch.manual_seed(0)
        hid, w = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
        t = torch.randint(0, v, (n,))
        loss = linear_logprobs(hid, w, t, transform=tr, chunk=c)[0].sum()
        with torch.no_grad():
            fwd = peak(lambda: linear_logprobs(hid, w, t, transform=tr, chunk=c))
        got[tr is None] = (peak(loss.backward), fwd)
    for with_t, without in zip(got[False], got[True]):
        assert with_t - without == pytest.approx(4 * v * c, rel=0.01)


@pytest.mark.parametrize("bf16, act", [pytest.param(0, 4, marks=pytest.mark.extended), (1, 2)])  # ~20 s each
def test_megatron_local_core_attention_saves_its_scores(bf16, act):
    """train.core_attention=local (megatron's DotProductAttention, torch softmax): per token and layer the fp32 softmax
    and its cast back ((act + 4) B per score; fp32: 4) and the key and value repeated to every head, beyond the
    worker's SDPA core attention; measured with saved-tensor hooks on the CPU build (a subprocess: its own gloo group),
    one row of 256 tokens, 8 heads / 2 KV heads of 16."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/eager_attention_memory.py"), "--megatron-local",
                          str(bf16), "256", "8", "2", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    a = shapes.Arch(hidden=128, heads=8, kv_heads=2, head_dim=16, ffn=256, vocab=64, attention=1, mlp=1, moe=0, mamba=0)
    saved, fwd = mem.local_score_bytes(a, act, 256, 1)
    assert got["local"] - got["sdpa"] == saved * 256 and fwd == 8 * 8 * 256


def test_megatron_local_core_attention_is_counted(tmp_path):
    """The megatron worker's train.core_attention=local: its scores in every layer (6 B per score in bf16 + the
    repeated K, V) and megatron's kept baddbmm scratch buffer (resident: [rows · heads, T, T] bf16 for the larger of
    the update's and the logprob pass's micro-batches); b4e6e4d counted SDPA's tensors whatever the key said."""
    s = RunSpec(model=LLAMA_1B, train=TrainSpec(backend=TrainBackend.megatron, precision=Precision.bfloat16,
                                                micro_batch_size=2, logprob_batch_size=4,
                                                max_total_sequence_length=2048))
    sdpa = replace(s, cluster=replace(s.cluster, gpus_per_node=1))
    local = replace(sdpa, train=replace(sdpa.train, core_attention="local"))
    e_sdpa, e_local = mem.estimate(sdpa), mem.estimate(local)
    tokens, per_tok = 2 * 2048, 6 * 16 * 2048 + 2 * 2 * (2048 - 512)
    assert e_local.policy["activations"].bytes - e_sdpa.policy["activations"].bytes == 24 * per_tok * tokens
    buf = 2 * 4 * 16 * 2048 * 2048  # bf16 × 4 rows × 16 heads × T²
    assert e_local.policy["attention score buffer"].bytes == buf and "attention score buffer" not in e_sdpa.policy
    assert e_local.phases["generate"] - e_sdpa.phases["generate"] == pytest.approx(buf / shapes.GIB)
    assert e_local.phases["logprobs"] - e_sdpa.phases["logprobs"] == pytest.approx(
        (buf + 8 * 16 * 2048 * 4 * 2048) / shapes.GIB)


def test_the_hf_engine_counts_its_eager_prefill(tmp_path):
    """rollout=hf loads a softcapped model with eager attention too (rollout/hf.py, models/attention.py): its prefill
    runs every prompt at once, one layer's [prompts, heads, W, W] scores (bf16 engine: 10 B per score, the CPU's
    figure) + the masks; 16 prompts of 1024 tokens on Gemma-2 2B's shape: 1.25 GiB b4e6e4d did not count."""
    spec = _gpu_spec(_model_dir(tmp_path, "g", **GEMMA2_2B), "gemma2", max_total_sequence_length=1024 + 256,
                     global_batch_size=128)
    spec = replace(spec, rollout=replace(spec.rollout, backend=RolloutBackend.hf, max_new_tokens=256),
                   env=replace(spec.env, max_prompt_tokens=1024))
    item = mem.estimate(spec).rollout["prefill scores"]
    assert item.bytes == 16 * 1024 * (10 * 8 * 1024 + 8 * 1024)
    off = replace(spec, model=replace(spec.model, path=_model_dir(tmp_path, "n", **GEMMA2_2B,
                                                                  attn_logit_softcapping=None)))
    assert "prefill scores" not in mem.estimate(off).rollout


def test_dynamic_batching_stays_within_the_shape_the_estimate_counts():
    """train.dynamic_batching (policy/microbatch.py plan, both workers): a micro-batch of n rows cut to its longest row
    L and longest response R holds n·L ≤ micro_batch_size × max_total_sequence_length tokens, n·R ≤ micro_batch_size ×
    max_new_tokens response positions and n·L² ≤ micro_batch_size × max_total_sequence_length² attention scores (eager
    / local attention), on any lengths: the token budget is the very shape the estimate counts with it off, so the
    estimate is the same either way (checked here on 200 seeded batches; no gap found, nothing changed)."""
    import random

    from grpo_launcher.policy import microbatch

    rows, seq, resp = 4, 1280, 1024
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 64)
        responses = [rng.randint(1, resp) for _ in range(n)]
        lengths = [min(seq, r + rng.randint(1, 256)) for r in responses]
        for g in microbatch.plan(lengths, responses, rows, seq, resp):
            L, R = max(lengths[i] for i in g), max(responses[i] for i in g)
            assert len(g) * L <= rows * seq and len(g) * R <= rows * resp and len(g) * L * L <= rows * seq * seq
    base = spec_of(["cluster=slurm", "dry_run=true", "train.precision=bfloat16", "train.micro_batch_size=4",
                    f"train.max_total_sequence_length={seq}", f"rollout.max_new_tokens={resp}"])
    for backend in (TrainBackend.torch, TrainBackend.megatron):
        off = replace(base, train=replace(base.train, backend=backend))
        on = replace(off, train=replace(off.train, dynamic_batching=True))
        assert mem.estimate(on).policy == mem.estimate(off).policy


def test_a_plan_refused_for_local_attention_names_sdpa_as_the_fix():
    """megatron with train.core_attention=local at 2 rows of 4096 tokens on H100s (Llama 3 8B, TP 8, engines asleep):
    its scores do not fit (80.4 GiB), SDPA's count does (64.9); the refusal names the key and the fix."""
    over = ["model=llama3_1_8b", "cluster=slurm", "dry_run=true", "cluster.gpus_per_node=8", "rollout=vllm",
            "train.precision=bfloat16", "train.backend=megatron", "train.distributed_optimizer=true",
            "train.tensor_parallel_size=8", "train.micro_batch_size=2", "train.logprob_batch_size=2",
            "train.global_batch_size=128", "train.max_total_sequence_length=4096", "rollout.max_new_tokens=2048",
            "env.max_prompt_tokens=2048", "rollout.sleep_mode=true"]
    assert mem.estimate(load_spec(over)).fits
    with pytest.raises(ConfigError) as info:
        load_spec([*over, "train.core_attention=local"])
    (v,) = [v for v in info.value.violations if v.rule == "gpu_memory_fits"]
    assert "train.core_attention" in v.keys and v.fix.startswith("cheapest: train.core_attention=sdpa → peak")


def test_no_sdpa_lists_the_causal_lms_transformers_runs_eagerly():
    """memory_shapes.NO_SDPA = the causal-LM families whose transformers class has no SDPA (from_pretrained falls back to
    eager attention), the attention-free ones left out: checked against this transformers."""
    import warnings

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    attention_free = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = {mt for mt, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                 if not getattr(getattr(transformers, name), "_supports_sdpa", False)}
    assert found - attention_free == shapes.NO_SDPA


EAGER_FAMILIES = {  # tiny configs (1 layer, 4 heads) of families transformers runs eagerly
    "gptj": dict(n_embd=64, n_layer=1, n_head=4, n_positions=512, rotary_dim=8),
    "gpt_neo": dict(num_layers=1, attention_types=[[["global"], 1]], num_heads=4, max_position_embeddings=512),
    "bloom": dict(n_layer=1, n_head=4),
    "codegen": dict(n_embd=64, n_layer=1, n_head=4, n_positions=512, rotary_dim=8),
    "mpt": dict(d_model=64, n_layers=1, n_heads=4, max_seq_len=512),
    "xglm": dict(d_model=64, num_layers=1, attention_heads=4, ffn_dim=128),
    "gpt_oss": dict(num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=2,
                    num_experts_per_tok=1, layer_types=["full_attention"]),
    "granite_swa": dict(num_key_value_heads=2, intermediate_size=128),
    "granitemoe_swa": dict(num_key_value_heads=2, intermediate_size=64, num_local_experts=2, num_experts_per_tok=1),
}


@pytest.mark.parametrize("family", EAGER_FAMILIES)
def test_eager_bytes_per_score_are_what_each_family_saves(family):
    """eager_bytes_per_score against what autograd keeps of [heads, T, T]-sized tensors in one layer of the family's
    own (eager) attention, one padded row of 128 tokens, fp32 and bf16 autocast."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    seq, heads = 128, 4
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=heads,
                  max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    spec = RunSpec(model=replace(RunSpec().model, family=family))
    ids, mask = torch.randint(0, 64, (1, seq)), torch.ones(1, seq, dtype=torch.long)
    mask[0, -3:] = 0
    for bf16, act in ((False, 4), (True, 2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**common,
                                                                                   **EAGER_FAMILIES[family]})).train()
        assert model.config._attn_implementation == "eager"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            got = _saved_storages(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False),
                                  skip=lambda t: not t.is_floating_point()
                                  or t.untyped_storage().nbytes() < heads * seq * seq * t.element_size())
        assert sum(got.values()) / (heads * seq * seq) == pytest.approx(shapes.eager_bytes_per_score(spec, act),
                                                                         abs=0.05), bf16
    assert shapes.eager_attention(spec) and shapes.hf_eager(spec)


def test_a_family_without_sdpa_counts_its_eager_scores():
    """GPT-J has no SDPA in transformers: the torch worker's policy runs eager attention, 6 B per [heads, T, T] score and
    layer in bf16 (the fp32 softmax and its cast back); the same shape as a llama (SDPA) counts none (b4e6e4d: none for
    either)."""
    base = RunSpec(model=LLAMA_1B, train=TrainSpec(precision=Precision.bfloat16, micro_batch_size=2,
                                                   max_total_sequence_length=1024))
    sdpa = replace(base, cluster=replace(base.cluster, gpus_per_node=1))
    gptj = replace(sdpa, model=replace(sdpa.model, family="gptj"))
    diff = mem.estimate(gptj).policy["activations"].bytes - mem.estimate(sdpa).policy["activations"].bytes
    assert diff == 24 * 6 * 16 * 1024 * 2 * 1024
    assert "gptj has no SDPA in transformers" in mem.estimate(gptj).policy["activations"].how
