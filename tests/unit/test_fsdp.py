"""FSDP2 for train.backend=torch (policy/fsdp.py): the sharded step equals the plain module's, the full weights
come back for refit and checkpoints, and a checkpoint resumes at another DP size. The 2-rank update ≡ 1-rank update
on the same batch is tests/integration/test_grpo_loop.py::test_two_worker_dp_update_equals_one_worker (2 ranks now shard)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.distributed as dist

from helpers import tiny_model


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group in this process (fully_shard needs one), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _step(model, opt, ids):
    """One AdamW step on a next-token loss; (loss, grad norm)."""
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    opt.step()
    return float(loss.detach()), float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def test_sharded_step_equals_the_plain_module(one_rank_group):
    from grpo_launcher.policy import fsdp

    path = tiny_model()
    plain, sharded = _model(path), _model(path)
    layers = fsdp.decoder_layers(sharded)
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer"] * plain.config.num_hidden_layers
    fsdp.shard(sharded, bf16=False)
    assert fsdp.is_sharded(sharded) and all(fsdp.is_sharded(m) for m in layers)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, sharded)]
    ids = torch.randint(3, plain.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        a, b = _step(plain, opts[0], ids), _step(sharded, opts[1], ids)
        assert a == pytest.approx(b, rel=1e-5)
    full = fsdp.full_weights(sharded, device=torch.device("cpu"))
    ref = plain.state_dict()
    assert full.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], rtol=1e-5, atol=1e-6)
    half = fsdp.full_weights(sharded, dtype=torch.bfloat16)  # the hybrid engine's refit in its dtype
    assert all(v.dtype == torch.bfloat16 for v in half.values())


def test_checkpoint_is_one_hf_directory_and_resumes_at_another_dp_size(one_rank_group, tmp_path):
    """Sharded → full files (config names the HF class, not FSDP's); they load into an unsharded model (and
    back), optimizer state included."""
    from transformers import AutoModelForCausalLM

    from grpo_launcher.policy import fsdp

    path = tiny_model()
    sharded = fsdp.shard(_model(path), bf16=False)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(2))
    _step(sharded, opt, ids)
    fsdp.save_hf(sharded, fsdp.full_model_state(sharded), tmp_path / "policy")
    optim = fsdp.optimizer_state(sharded, opt)
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    full = fsdp.full_weights(sharded, device=torch.device("cpu"))
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0)

    plain = _model(path)  # DP 2 → 1: the same files into the unsharded path
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    fsdp.load_state(plain, plain_opt, loaded.state_dict(), optim)
    moments = [plain_opt.state[p]["exp_avg"] for p in plain.parameters()]
    assert len(moments) == len(list(plain.parameters())) and any(float(m.abs().sum()) > 0 for m in moments)
    back = fsdp.shard(_model(path), bf16=False)  # and 1 → N: the unsharded layout into a sharded model
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-3)
    fsdp.load_state(back, back_opt, plain.state_dict(), fsdp.optimizer_state(plain, plain_opt))
    assert _step(back, back_opt, ids) == pytest.approx(_step(plain, plain_opt, ids), rel=1e-5)
    old = fsdp.shard(_model(path), bf16=False)  # a checkpoint of before FSDP2: torch's index-keyed layout
    old_opt = torch.optim.AdamW(old.parameters(), lr=1e-3)
    fsdp.load_state(old, old_opt, plain.state_dict(), plain_opt.state_dict())
    assert _step(old, old_opt, ids) == pytest.approx(_step(plain, plain_opt, ids), rel=1e-5)


def _grads_and_saved_bytes(model, ids):
    """(grads by name, bytes autograd saved for the backward) of one next-token loss."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
             else p.grad for n, p in model.named_parameters()}
    return grads, sum(saved)


def test_activation_checkpointing_same_grads_fewer_saved_bytes(one_rank_group):
    """train.activation_checkpointing: the layers keep their inputs only; the gradients are the same, plain or
    sharded, and the names (state dict, optimizer, refit) are the model's own."""
    from grpo_launcher.policy import fsdp

    path = tiny_model()
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(3))
    ref, full_bytes = _grads_and_saved_bytes(_model(path), ids)
    ckpt = _model(path)
    assert fsdp.checkpoint_layers(ckpt) == ckpt.config.num_hidden_layers
    assert ckpt.state_dict().keys() == _model(path).state_dict().keys()
    grads, ckpt_bytes = _grads_and_saved_bytes(ckpt, ids)
    assert ckpt_bytes < full_bytes / 2  # (the logits and the embedding's output dominate what is left)
    sharded = _model(path)
    fsdp.checkpoint_layers(sharded)
    assert len(fsdp.decoder_layers(sharded)) == 2  # the wrappers: fully_shard goes around the checkpointed block
    sharded_grads, _ = _grads_and_saved_bytes(fsdp.shard(sharded, bf16=False), ids)
    for k in ref:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(sharded_grads[k], ref[k], rtol=1e-5, atol=1e-7)


def _meta_rank(rank: int, path: str, store: str, out: str) -> None:
    """One of 2 gloo ranks: the policy and its reference built as TorchPolicyWorker builds them when sharded (meta
    device, fully_shard, rank 0's weights broadcast); rank 0 saves the gathered weights and a fixed batch's logits."""
    import copy

    from grpo_launcher.policy import fsdp

    # a forked child must not enter the OpenMP pool its parent started (GOMP deadlocks after fork: seen here, 2 ranks
    # idle in torch.equal for 18 min); one thread runs ATen's parallel loops inline
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = fsdp.load_model(path, torch.device("cpu"), sharded=True, max_len=64)
        assert all(p.is_meta for p in model.parameters())  # nothing read, nothing allocated yet
        ref = copy.deepcopy(model)  # the KL reference, as the worker makes it (loss.kl_coef > 0)
        fsdp.shard(model, bf16=False)
        fsdp.shard(ref, bf16=False)
        fsdp.materialize([model, ref], path, torch.device("cpu"), max_len=64)
        full = fsdp.full_weights(model, device=torch.device("cpu"))
        ref_full = fsdp.full_weights(ref, device=torch.device("cpu"))
        assert all(torch.equal(ref_full[k], v) for k, v in full.items())
        with torch.no_grad():  # a forward is a collective: both ranks run it
            logits = model(input_ids=torch.arange(3, 19).view(2, 8)).logits
        if rank == 0:
            torch.save({"weights": full, "logits": logits}, out)
    finally:
        dist.destroy_process_group()


def test_meta_device_init_on_two_ranks_equals_the_loaded_model(tmp_path):
    """FSDP2 ranks build the model on the meta device and receive rank 0's weights by broadcast (no rank but 0
    reads the files): weights, and the buffers a state dict leaves out (rotary frequencies: the logits), equal
    today's from_pretrained load."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM  # noqa: F401  imported once, here: the forked ranks inherit it

    from grpo_launcher.policy import fsdp  # noqa: F401

    path, out = str(tiny_model()), str(tmp_path / "rank0.pt")
    # fork: the ranks inherit the imports (spawn re-imports torch + transformers: ~15 s of a 2-core CI runner).
    # Garbage collected here, then frozen: a child's collector must not free what it inherited (an earlier test's
    # destroyed gloo group: its destructor waits in pthread_cond_destroy for the parent's threads, forever; seen in
    # the rehearsal at 8d9e635 after more tests ran before this one)
    gc.collect()
    gc.freeze()
    try:
        mp.start_processes(_meta_rank, args=(path, str(tmp_path / "store"), out), nprocs=2, start_method="fork")
    finally:
        gc.unfreeze()
    got = torch.load(out, weights_only=True)
    plain = _model(path)
    ref = plain.state_dict()
    assert got["weights"].keys() == ref.keys()
    for k in ref:
        assert torch.equal(got["weights"][k], ref[k]), k
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], plain(input_ids=torch.arange(3, 19).view(2, 8)).logits)


def test_router_balance_per_layer_and_over_layers():
    """train/moe/*: [layers, experts] token counts -> the busiest expert's share over the mean share and the
    normalised routing entropy, per MoE layer (named by its index) and over layers (max, mean)."""
    from grpo_launcher.policy.update_log import router_balance

    m = router_balance(torch.tensor([[4.0, 4, 4, 4], [16, 0, 0, 0]], dtype=torch.float64),
                       ["model.layers.1.mixer.gate", "model.layers.3.mixer.gate"])
    assert m["moe/layer_1/max_load"] == 1 and m["moe/layer_1/entropy"] == pytest.approx(1)
    assert m["moe/layer_3/max_load"] == 4 and m["moe/layer_3/entropy"] == 0
    assert m["moe/max_load"] == 4 and m["moe/entropy"] == pytest.approx(0.5)


# ------------------------------------------------------------------ pre-flight: nemotron_h on the torch backend

NANO_TORCH = ["+recipe=nanov3", "cluster=slurm", "dry_run=true", "train.backend=torch", "train.tensor_parallel_size=1",
              "train.pipeline_parallel_size=1", "train.context_parallel_size=1", "train.expert_parallel_size=1",
              "train.sequence_parallel=false"]


def _gaps(overrides):
    """{first key: message} of what this build cannot run, as a real launch of the composed spec is refused."""
    from dataclasses import replace

    from grpo_launcher.preflight.validate import validate
    from grpo_launcher.spec.compose import compose, to_spec

    spec = replace(to_spec(compose(overrides)), dry_run=False)
    return {v.keys[0]: v.message for v in validate(spec) if v.rule == "build_implements_run"}


def test_build_accepts_nemotron_h_on_torch_and_names_what_megatron_lacks(tmp_path, monkeypatch):
    from importlib.util import find_spec

    monkeypatch.setenv("GYM_HOME", str(tmp_path / "no-gym"))  # the same answer whether or not `make gym` has run
    torch_gaps = _gaps(NANO_TORCH)
    assert "model.family" not in torch_gaps  # transformers' NemotronHForCausalLM, pure torch
    gym = torch_gaps.pop("env.name")  # the recipe's env=nemo_gym, and NeMo Gym is not installed (here: GYM_HOME)
    assert "needs NeMo Gym" in gym
    assert torch_gaps == {}  # the recipe's every other setting, packing included (Mamba layers per sequence)
    mega = _gaps(["+recipe=nanov3", "cluster=slurm", "dry_run=true"])
    assert "model.family" not in mega  # megatron maps nemotron_h (policy/megatron_hybrid.py's local spec)
    assert "Transformer Engine" in mega["train.tensor_parallel_size"]  # the recipe's TP=2: not without TE
    if find_spec("mamba_ssm") is None:
        assert "mamba-ssm" in mega["train.backend"] and "does not import here" in mega["train.backend"]
    moe_loss = _gaps([*NANO_TORCH, "train.moe.load_balancing_type=aux_loss", "train.moe.aux_loss_coeff=0.01"])
    assert "without a router balancing loss" in moe_loss["train.moe.aux_loss_coeff"]


def test_nanov3_on_torch_is_refused_for_memory_only_with_the_fsdp_figures():
    """The recipe's 49152-token sequences on the torch backend (FSDP2 over 256 GPUs): the shards are small, the
    activations and logits (no CP) next to engines kept awake are what does not fit (asleep it fits: test_memory)."""
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.spec.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_spec([*NANO_TORCH, "rollout.sleep_mode=false"])
    (v,) = info.value.violations
    assert v.rule == "gpu_memory_fits" and "in the train phase" in v.message
    assert "weights 0.5" in v.message  # 31.6e9 params × 4 B / DP 256 = 0.49 GiB
    assert "train.tensor_parallel_size" not in v.keys  # the torch backend has none to raise
    assert "logits 6.2" in v.message  # chunked output layer: 12 B × V 131072 × 4096 tok + saved hidden; no CP
    short = [*NANO_TORCH, "rollout.max_new_tokens=4096", "rollout.max_model_len=8192",
             "train.max_total_sequence_length=8192"]
    from grpo_launcher.preflight import memory_estimate as mem

    e = mem.estimate(load_spec(short))  # 8192-token sequences: FSDP2 over 256 H100s fits, with the engines
    assert e.fits and e.peak_gib < 79.6 and e.policy["weights"].gib < 0.5
    assert set(_gaps(short)) <= {"train.sequence_packing", "env.name"}  # packing; Gym where not installed


def test_a_sharded_model_loads_weights_only_with_a_fresh_optimizer(one_rank_group):
    """A checkpoint older than the newest has no optimizer state (checkpoint/manager.py): the weights go into the
    shards, the optimizer stays as built (no moments) and its first step equals a fresh unsharded model's."""
    from grpo_launcher.policy import fsdp

    path = tiny_model()
    trained = _model(path)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    _step(trained, torch.optim.AdamW(trained.parameters(), lr=1e-3), ids)
    sharded = fsdp.shard(_model(path), bf16=False)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    fsdp.load_state(sharded, opt, trained.state_dict(), None)
    assert not opt.state
    full = fsdp.full_weights(sharded, device=torch.device("cpu"))
    assert full.keys() == trained.state_dict().keys()
    assert all(torch.equal(v, full[k]) for k, v in trained.state_dict().items())
    plain = _model(path)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    fsdp.load_state(plain, plain_opt, trained.state_dict(), None)
    assert not plain_opt.state
    assert _step(sharded, opt, ids) == pytest.approx(_step(plain, plain_opt, ids), rel=1e-5)
