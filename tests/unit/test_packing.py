"""train.sequence_packing on the torch backend (policy/packing.py): sequences end to end in fixed-length rows,
attention kept within each sequence; the logprobs, loss and update equal the unpacked batch's, on the CPU."""

from __future__ import annotations

import pytest
import torch

from grpo_launcher.batch import Generation, collate
from grpo_launcher.policy.packing import mamba_groups, next_fit_rows, pack, packed_slices, sequence_index, unpack
from grpo_launcher.policy.torch_policy import TorchPolicyWorker
from grpo_launcher.spec.compose import load_spec
from unit.test_hybrid import SMALL, rollout_batch, setup


def test_next_fit_keeps_order_and_fills_rows():
    assert next_fit_rows([3, 4, 2, 5, 1], 6) == [0, 1, 1, 2, 2]
    assert packed_slices([3, 4, 2, 5, 1], 6, 2) == [slice(0, 3), slice(3, 5)]  # rows 0-1, then row 2
    assert packed_slices([6, 6, 6], 6, 1) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_pack_lays_out_positions_targets_and_the_way_back():
    gens = [Generation([5, 6], [7, 8, 9], [0.0] * 3, False), Generation([10, 11, 12], [13], [0.0], False),
            Generation([14], [15, 16], [0.0] * 2, False)]
    b = collate(gens, torch.zeros(3), torch.ones(3), pad_id=0)  # lengths 5, 4, 3
    p = pack(b, capacity=8)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [10, 11, 12, 13, 14, 15, 16, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 0, 1, 2, 7]]
    assert p.targets.tolist() == [[-1, 7, 8, 9, -1, -1, -1, -1], [-1, -1, 13, -1, 15, 16, -1, -1]]
    # the token each response position predicts, read back through the index: the response itself
    nxt = torch.cat([p.input_ids[:, 1:], p.input_ids[:, :1]], 1)[..., None]  # [R, C, 1]
    got = unpack(nxt, p)[..., 0]
    assert torch.equal(torch.where(b.response_mask.bool(), got, 0), b.response_ids)
    # the Mamba layers' seq_idx where the kernels take it (the trailing padding: its row's last sequence)
    assert sequence_index(p.position_ids).tolist() == [[0] * 8, [0, 0, 0, 0, 1, 1, 1, 1]]
    assert sequence_index(p.position_ids).dtype == torch.int32
    # on the CPU (transformers' torch scan takes no seq_idx): per-sequence groups, longest first, each ≤ one row
    m = pack(b, capacity=8, mamba=True).segments
    assert m.seq_idx is None
    assert [index[mask].tolist() for index, mask in m.groups] == [[0, 1, 2, 3, 4], [8, 9, 10, 11, 12, 13, 14]]


@pytest.mark.parametrize("chunk", [4096, 0])
def test_packed_update_equals_the_unpacked_one(model_root, chunk):
    """Same batch (lengths vary), packed into rows of 64 tokens vs right-padded: logprobs, loss, grad norm and
    the new weights agree; the packed micro-batches hold more sequences each."""
    spec, env, model_dir = setup(model_root)
    over = [f"output_root={model_root}", *SMALL, f"train.logprob_chunk_tokens={chunk}", "train.micro_batch_size=4"]
    packed = TorchPolicyWorker(load_spec([*over, "train.sequence_packing=true"]), model_dir, 0, 1)
    padded = TorchPolicyWorker(load_spec(over), model_dir, 0, 1)
    batch = rollout_batch(padded, env)
    lengths = batch.attention_mask.sum(1)
    assert lengths.min() < lengths.max()  # something to pack
    assert len(packed._micro_batches(batch, 4)) < len(padded._micro_batches(batch, 4))
    oa, ob = assert_same_step(packed, padded, batch)
    assert (oa["prev_logprobs"] - ob["prev_logprobs"])[batch.response_mask.bool()].abs().max() < 1e-5
    # the entropy metric is a token mean per micro-batch weighted by the micro-batch's share of the loss's
    # denominator (sequences here): other micro-batches, a slightly other mean
    assert abs(oa["entropy"] - ob["entropy"]) < 1e-3


def assert_same_step(a, b, batch, rtol: float = 0.0) -> tuple[dict, dict]:
    """Two workers on one batch: the same logprobs, then one update's loss, grad norm and gradients (no optimizer
    step: Adam's first step is ~lr·sign(g), the gradients are compared as the backward left them)."""
    mask = batch.response_mask.bool()
    (pa, _), (pb, _) = a.logprobs(batch), b.logprobs(batch)
    assert (pa - pb)[mask].abs().max() < 1e-5
    den = [float(batch.response_mask.sum())]
    a.opt.step = b.opt.step = lambda: None
    oa, ob = a.update([batch], den), b.update([batch], den)
    for k in ("loss", "grad_norm"):
        assert abs(oa[k] - ob[k]) < 1e-5, k
    for (k, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        if x.grad is not None or y.grad is not None:
            assert torch.allclose(x.grad, y.grad, atol=1e-6, rtol=rtol), k
    return oa, ob


def test_mamba_groups_bound_the_padding_and_the_batch():
    """Each group's padded batch fits one row, and pads no more tokens than it holds: a long-tailed batch (one long
    sequence, many short ones) must not become [S, longest]."""
    g = torch.Generator().manual_seed(1)
    lengths = [4000] + torch.randint(5, 400, (63,), generator=g).tolist()
    groups = mamba_groups(lengths, 4096)
    assert sorted(i for grp in groups for i in grp) == list(range(64))
    for grp in groups:
        longest = max(lengths[i] for i in grp)
        assert len(grp) * longest <= 4096 or len(grp) == 1
        assert len(grp) * longest <= 2 * sum(lengths[i] for i in grp)
    assert sum(len(grp) * max(lengths[i] for i in grp) for grp in groups) < 2 * sum(lengths)


def _hybrid_batch(model_dir: str):
    """16 sequences of a 4-token prompt and 1-24 response tokens (across the Mamba scan's 16-token chunks)."""
    from transformers import AutoTokenizer

    g = torch.Generator().manual_seed(0)
    gens = []
    for _ in range(16):
        r = torch.randint(3, 250, (int(torch.randint(1, 25, (1,), generator=g)),), generator=g).tolist()
        gens.append(Generation(torch.randint(3, 250, (4,), generator=g).tolist(), r, [-1.0] * len(r), False))
    return collate(gens, torch.linspace(-1, 1, 16), torch.ones(16), AutoTokenizer.from_pretrained(model_dir).pad_token_id)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_nemotron_h_equals_the_unpacked_one(model_root, checkpointing):
    """A nemotron_h model (Mamba-2, MoE, attention): packed rows, with the Mamba mixers run per sequence, give the
    unpacked batch's logprobs, loss and gradients, also when the layers are recomputed (activation checkpointing).
    Without the per-sequence Mamba hooks they do not: a row's recurrent state would carry into the next sequence."""
    from nemotron_tiny import tiny_nemotron_h

    model_dir = str(tiny_nemotron_h())
    over = [f"output_root={model_root}", f"model.path={model_dir}", *SMALL, "train.micro_batch_size=4",
            f"train.activation_checkpointing={str(checkpointing).lower()}"]
    packed = TorchPolicyWorker(load_spec([*over, "train.sequence_packing=true"]), model_dir, 0, 1)
    padded = TorchPolicyWorker(load_spec(over), model_dir, 0, 1)
    assert packed.mamba_mixers == 1 and padded.mamba_mixers == 0
    batch = _hybrid_batch(model_dir)
    assert len(packed._micro_batches(batch, 4)) < len(padded._micro_batches(batch, 4))
    mask = batch.response_mask.bool()
    (pa, _), (pb, _) = packed.logprobs(batch), padded.logprobs(batch)
    assert (pa - pb)[mask].abs().max() < 1e-5
    packed.mamba_mixers = 0  # the keyword withheld: the hooks pass through, and the state leaks across sequences
    assert (packed.logprobs(batch)[0] - pb)[mask].abs().max() > 1e-3
    packed.mamba_mixers = 1
    den = [float(batch.response_mask.sum())]
    packed.opt.step = padded.opt.step = lambda: None  # the gradients stay as the backward left them
    oa, ob = packed.update([batch], den), padded.update([batch], den)
    for k in ("loss", "grad_norm"):
        assert abs(oa[k] - ob[k]) < 1e-5, k
    for (k, x), y in zip(packed.model.named_parameters(), padded.model.parameters()):
        if x.grad is not None or y.grad is not None:
            assert torch.allclose(x.grad, y.grad, atol=1e-6), k


@pytest.mark.parametrize("overrides, keys, why", [
    (["train.backend=megatron"], ("train.sequence_packing", "train.backend"), "torch backend only"),
])
def test_preflight_refuses_packing_where_it_cannot_pack(overrides, keys, why):
    from grpo_launcher.spec.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_spec(["train.sequence_packing=true", *overrides])
    (v,) = [v for v in info.value.violations if "train.sequence_packing" in v.keys]
    assert v.keys == keys and why in v.message
