"""FSDP2 for train.backend=torch (policy/fsdp.py): the sharded step equals the plain module's, the full weights
come back for refit and checkpoints, and a checkpoint resumes at another DP size. The 2-rank update ≡ 1-rank update
on the same batch is tests/test_grpo_loop.py::test_two_worker_dp_update_equals_one_worker (2 ranks now shard)."""

from __future__ import annotations

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
