"""Token-budget micro-batches (policy/microbatch.py): the plan stays within the budget the memory pre-flight counts,
processes fewer padded tokens than fixed row counts, and the torch worker's logprobs, loss and gradients equal the
fixed-row path's on a batch of very uneven lengths, with outputs in the batch's order."""

from __future__ import annotations

import pytest
import torch

from grpo_launcher.batch import Generation, collate
from grpo_launcher.policy import microbatch
from grpo_launcher.policy.torch_policy import TorchPolicyWorker
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError
from unit.test_hybrid import SMALL, setup


def uneven_batch(n: int, vocab: int, seed: int = 0, prompt: tuple[int, int] = (2, 9), longest: int = 48):
    """n rows: prompts of 2-8 tokens, responses of 1 to `longest` tokens (a long tail), in random order."""
    g = torch.Generator().manual_seed(seed)
    gens = []
    for i in range(n):
        p = torch.randint(3, vocab, (int(torch.randint(*prompt, (1,), generator=g)),), generator=g).tolist()
        k = longest if i == n // 2 else int(torch.randint(1, longest // 4, (1,), generator=g))
        r = torch.randint(3, vocab, (k,), generator=g).tolist()
        gens.append(Generation(p, r, [-1.0] * k, truncated=False))
    return collate(gens, torch.linspace(-1, 1, n), torch.ones(n), pad_id=0)


def test_plan_stays_within_the_budget_and_covers_every_row_once():
    g = torch.Generator().manual_seed(1)
    resp = torch.randint(1, 500, (64,), generator=g).tolist()
    lengths = [r + int(torch.randint(1, 100, (1,), generator=g)) for r in resp]
    groups = microbatch.plan(lengths, resp, rows=4, max_len=600, max_resp=500)
    assert sorted(i for grp in groups for i in grp) == list(range(64))
    for grp in groups:
        assert len(grp) * max(lengths[i] for i in grp) <= 4 * 600  # the padded tokens the pre-flight counts
        assert len(grp) * max(resp[i] for i in grp) <= 4 * 500  # and the padded response positions
    fixed = microbatch.fixed(64, 4)
    assert microbatch.padded_tokens(groups, lengths) < 0.7 * microbatch.padded_tokens(fixed, lengths, cut=False)
    # full-length rows: exactly the fixed row count; a row past the budget runs alone
    assert [len(grp) for grp in microbatch.plan([600] * 8, [500] * 8, 4, 600, 500)] == [4, 4]
    assert microbatch.plan([900, 10, 10], [800, 5, 5], 1, 600, 500) == [[0], [1, 2]]


def test_mamba_rows_count_in_whole_chunks():
    """granule (a Mamba-2 chunk): 80-token rows count as 128 against a budget of 1024 (8 a micro-batch, not 12);
    the budget itself rounds up the same way, so one full-length row still fits."""
    plain = microbatch.plan([80] * 24, [5] * 24, rows=1, max_len=1024, max_resp=1024)
    chunked = microbatch.plan([80] * 24, [5] * 24, rows=1, max_len=1024, max_resp=1024, granule=128)
    assert [len(g) for g in plain] == [12, 12] and [len(g) for g in chunked] == [8, 8, 8]
    assert [len(g) for g in microbatch.plan([1000, 1000], [5, 5], 2, 1000, 1024, granule=128)] == [2]
    assert microbatch.plan([129, 10], [5, 5], 1, 128, 1024, granule=128) == [[0], [1]]


def test_the_granule_is_the_mamba_chunk_of_every_hybrid_family():
    """Bamba (as Falcon-H1, GraniteMoeHybrid) names its chunk `mamba_chunk_size` and its mixer BambaMixer: counted in
    whole chunks too, not as a dense model (1); a dense model: 1."""
    from transformers import BambaConfig, BambaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32)
    bamba = BambaForCausalLM(BambaConfig(**tiny, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                         mamba_d_state=8, mamba_chunk_size=16))
    assert microbatch.mamba_chunk(bamba) == 16
    assert microbatch.mamba_chunk(Qwen2ForCausalLM(Qwen2Config(**tiny))) == 1


def test_nemotron_h_token_budget_equals_the_fixed_rows(model_root):
    """A nemotron_h model (Mamba-2, MoE, attention) with train.dynamic_batching: token-budget micro-batches in
    whole scan chunks, fewer than the fixed rows, with the same logprobs, loss and gradients."""
    from nemotron_tiny import tiny_nemotron_h
    from unit.test_packing import _hybrid_batch, assert_same_step

    model_dir = str(tiny_nemotron_h())
    over = [f"output_root={model_root}", f"model.path={model_dir}", *SMALL, "train.micro_batch_size=2",
            "train.logprob_batch_size=2", "train.max_total_sequence_length=64", "rollout.max_new_tokens=48"]
    budget = TorchPolicyWorker(load_spec([*over, "train.dynamic_batching=true"]), model_dir, 0, 1)
    rows = TorchPolicyWorker(load_spec(over), model_dir, 0, 1)
    assert budget.token_budget and budget.granule == budget.model.config.chunk_size > 1
    batch = _hybrid_batch(model_dir)
    gb = budget._micro_batches(batch, 2)
    assert len(gb) < len(rows._micro_batches(batch, 2))
    lengths, _ = microbatch.lengths_of(batch)
    whole = lambda n: -(-n // budget.granule) * budget.granule  # noqa: E731
    assert all(len(g) * max(whole(lengths[i]) for i in g) <= 2 * whole(64) for g in gb)
    assert_same_step(budget, rows, batch, rtol=1e-4)


def test_even_out_splits_the_largest_and_restore_undoes_the_order():
    groups = microbatch.even_out([[3, 1, 0, 2], [4]], 4)
    assert len(groups) == 4 and sorted(i for grp in groups for i in grp) == list(range(5))
    parts = [torch.tensor(grp, dtype=torch.float)[:, None].expand(-1, max(grp) + 1) for grp in groups]  # width ≤ 5
    out = microbatch.restore(parts, groups, 5, 6)
    assert out[:, 0].tolist() == [0, 1, 2, 3, 4] and out[0, 1:].abs().sum() == 0


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_token_budget_update_equals_the_fixed_rows(model_root, kl):
    """Same batch (a long tail of lengths): token-budget micro-batches vs fixed rows of 4 at the batch's length:
    logprobs (policy and reference) in the batch's order, loss, grad norm and gradients agree in fp32; fewer
    padded tokens and fewer micro-batches."""
    spec, env, model_dir = setup(model_root)
    over = [f"output_root={model_root}", *SMALL, "train.micro_batch_size=4", "train.logprob_batch_size=4",
            "train.max_total_sequence_length=64", "rollout.max_new_tokens=48", f"loss.kl_coef={kl}"]
    budget = TorchPolicyWorker(load_spec([*over, "train.dynamic_batching=true"]), model_dir, 0, 1)
    rows = TorchPolicyWorker(load_spec(over), model_dir, 0, 1)  # the default: 4 rows at a time at the batch's length
    assert budget.token_budget and budget.cut and not (rows.token_budget or rows.cut)
    batch = uneven_batch(32, 250)
    lengths, _ = microbatch.lengths_of(batch)
    gb, gr = budget._micro_batches(batch, 4), rows._micro_batches(batch, 4)
    assert len(gb) < len(gr)
    assert microbatch.padded_tokens(gb, lengths) < 0.5 * microbatch.padded_tokens(gr, lengths, cut=False)
    mask = batch.response_mask.bool()
    (pa, ra), (pb, rb) = budget.logprobs(batch), rows.logprobs(batch)
    assert pa.shape == pb.shape and (pa - pb)[mask].abs().max() < 1e-5
    if kl:
        assert (ra - rb)[mask].abs().max() < 1e-5
    noise = 0.3 * torch.randn(pb.shape, generator=torch.Generator().manual_seed(1))
    b = batch.with_(prev_logprobs=pb + noise)  # ratios ≠ 1: clipping is exercised
    den = [float(b.response_mask.sum())]
    budget.opt.step = rows.opt.step = lambda: None  # the gradients stay as the backward left them
    oa, ob = budget.update([b], den), rows.update([b], den)
    for k in ("loss", "pg_loss", "grad_norm"):
        assert oa[k] == pytest.approx(ob[k], rel=1e-5, abs=1e-6), k
    # clip_fraction is averaged as the loss weighs tokens (algos.metric_mean): any micro-batch layout, the same
    assert oa["clip_fraction"] == pytest.approx(ob["clip_fraction"], rel=1e-4) and oa["clip_fraction"] > 0
    for (k, x), y in zip(budget.model.named_parameters(), rows.model.parameters()):
        assert torch.allclose(x.grad, y.grad, atol=1e-6, rtol=1e-4), k
    # on-policy: the update's own forward gives the old logprobs, back in the batch's order
    oa = budget.update([batch], den)
    assert (oa["prev_logprobs"] - pb)[mask].abs().max() < 1e-5


def test_without_dynamic_batching_the_micro_batches_are_the_fixed_rows(model_root):
    """train.dynamic_batching off (the default): consecutive rows, micro_batch_size at a time, uncut: the very
    micro-batches (and so the very floats) of the code before it."""
    spec, env, model_dir = setup(model_root)
    w = TorchPolicyWorker(load_spec([f"output_root={model_root}", *SMALL, "train.micro_batch_size=4"]), model_dir, 0, 1)
    batch = uneven_batch(10, 250)
    assert w._micro_batches(batch, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    mb = microbatch.take(batch, [4, 5, 6, 7], w.cut)
    assert torch.equal(mb.input_ids, batch.input_ids[4:8]) and torch.equal(mb.response_mask, batch.response_mask[4:8])


def test_a_micro_batch_below_one_row_is_refused_naming_the_key(model_root):
    """The budget is micro_batch_size full-length rows: below one row is micro_batch_size < 1, refused by name."""
    with pytest.raises(ConfigError) as e:
        load_spec([f"output_root={model_root}", *SMALL, "train.micro_batch_size=0"])
    assert "train.micro_batch_size" in e.value.render() and "positive_sizes" in e.value.render()


def test_widened_micro_batches_give_the_same_logprobs(model_root):
    """On GPUs each micro-batch's width is padded to a multiple of 16 (one Triton specialization for every length):
    the padded width changes no logprob (the pad follows every row's last token)."""
    spec, env, model_dir = setup(model_root)
    over = [f"output_root={model_root}", *SMALL, "train.micro_batch_size=4", "train.logprob_batch_size=4",
            "train.max_total_sequence_length=64", "rollout.max_new_tokens=48", "train.dynamic_batching=true"]
    worker = TorchPolicyWorker(load_spec(over), model_dir, 0, 1)
    batch = uneven_batch(16, 250, seed=3)
    longest = int(batch.attention_mask[[1, 2]].sum(1).max())  # 11: not a multiple of 16
    mb = microbatch.take(batch, [1, 2], cut=True, multiple=16)
    assert longest % 16 and mb.input_ids.shape[1] == 16 and int(mb.attention_mask.sum()) == int(
        batch.attention_mask[[1, 2]].sum())
    assert worker.width_multiple == 1  # CPU: as before
    plain = worker.logprobs(batch)[0]
    worker.width_multiple = 16
    wide = worker.logprobs(batch)[0]
    mask = batch.response_mask.bool()
    assert (plain - wide)[mask].abs().max() < 1e-5
