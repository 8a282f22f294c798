"""Token-budget micro-batches on two FSDP2 ranks (gloo, CPU): a rank of long rows and a rank of short ones plan a
different number of micro-batches; both run as many (policy/microbatch.py even_out: FSDP2's forwards and backwards
are collectives, a rank running one fewer would leave the other waiting forever), and the logprobs and the update
equal the one-rank ones. Every wait is bounded: a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import pytest
import torch

from grpo_launcher.batch import Generation, collate, shard_rows
from grpo_launcher.policy import microbatch
from grpo_launcher.spec.compose import load_spec
from helpers import policy_ranks, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test: test_grpo_loop.py's 2-rank update == 1 rank's;
# tests/unit/test_microbatch.py: even_out
WAIT = 300  # s: each ray.get; the whole test takes about 20 s on a loaded 2-core machine


def _long_then_short(pad_id: int):
    """Rows 0-3: 4 + 40 tokens (rank 0's shard), rows 4-7: 3 + 3 tokens (rank 1's)."""
    g = torch.Generator().manual_seed(0)
    gens = []
    for prompt, new in [(4, 40)] * 4 + [(3, 3)] * 4:
        ids = torch.randint(3, 250, (prompt + new,), generator=g).tolist()
        gens.append(Generation(ids[:prompt], ids[prompt:], [-1.0] * new, truncated=False))
    return collate(gens, torch.randn(8, generator=g), torch.ones(8), pad_id)


def test_uneven_ranks_run_as_many_micro_batches_and_equal_one_rank(tmp_path):
    import ray
    from transformers import AutoTokenizer

    spec = load_spec(["train.dynamic_batching=true", "train.micro_batch_size=1", "train.logprob_batch_size=1",
                      "train.global_batch_size=8", "train.max_total_sequence_length=64", "rollout.max_new_tokens=48",
                      f"output_root={tmp_path}"])
    model_dir = str(tiny_model())
    batch = _long_then_short(AutoTokenizer.from_pretrained(model_dir).pad_token_id)
    shards = [batch.select(shard_rows(8, 2, r)) for r in range(2)]
    counts = [len(microbatch.plan(*microbatch.lengths_of(s), 1, 64, 48)) for s in shards]
    assert counts == [4, 1]  # planned alone: 4 micro-batches on rank 0, 1 on rank 1
    mask = batch.response_mask.bool()
    with policy_ranks(spec, model_dir) as (single, pair):
        prev, _ = ray.get(single.logprobs.remote(batch), timeout=WAIT)
        parts = ray.get([w.logprobs.remote(s) for w, s in zip(pair, shards)], timeout=WAIT)
        assert (torch.cat([p for p, _ in parts]) - prev)[mask].abs().max() < 1e-5
        noise = 0.2 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
        b = batch.with_(prev_logprobs=prev + noise)  # ratios ≠ 1
        den = float(b.response_mask.sum(-1).gt(0).sum())  # seq_mean_token_mean: loss-bearing sequences
        before = ray.get(single.state_dict.remote(), timeout=WAIT)
        m1 = ray.get(single.update.remote([b], [den]), timeout=WAIT)
        m2 = ray.get([w.update.remote([b.select(shard_rows(8, 2, r))], [den]) for r, w in enumerate(pair)],
                     timeout=WAIT)
        # a full-weights gather is a collective too: both ranks
        one, two, _ = ray.get([single.state_dict.remote(), *[w.state_dict.remote() for w in pair]], timeout=WAIT)
    assert m1["loss"] == pytest.approx(m2[0]["loss"] + m2[1]["loss"], abs=1e-5)
    assert m1["grad_norm"] > 0 and abs(m1["grad_norm"] - m2[0]["grad_norm"]) < 1e-4 * max(1.0, m1["grad_norm"])
    # one AdamW step moves each weight by about lr·g/(|g| + eps): where |g| is near 0 the summation order alone
    # moves it by a visible part of lr, so the step is compared as a whole, and element-wise to 3 % of lr (3e-4)
    d1 = torch.cat([(one[k] - before[k]).flatten() for k in one])
    d2 = torch.cat([(two[k] - before[k]).flatten() for k in one])
    assert d1.norm() > 0 and (d2 - d1).norm() < 1e-4 * d1.norm() and (d2 - d1).abs().max() < 1e-5
