"""DAPO's dynamic sampling: only groups whose rewards vary carry loss, the round cap's padding groups included."""

from __future__ import annotations

import torch

from grpo_launcher import algos
from grpo_launcher.batch import Generation
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.train.sources import make_batch

TOK = type("Tok", (), {"pad_token_id": 0})()


def gens(n: int, length: int = 3) -> list[Generation]:
    return [Generation([1, 2], list(range(3, 3 + length)), [-0.5] * length, False) for _ in range(n)]


def test_flat_groups_carry_no_loss_and_do_not_dilute_token_mean():
    """Groups [1, 0] and [1, 1] (G=2): the flat group (a padding group after the cap) has sample_mask 0, so
    token_mean's denominator counts only the varying group's tokens (DAPO trains on the groups it kept)."""
    spec = load_spec(["loss=dapo", "dry_run=true"])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch, _ = make_batch(spec, 2, TOK, gens(4), rewards)
    assert batch.sample_mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert float(algos.loss_mask(batch.response_mask, batch.sample_mask).sum()) == 6  # 2 samples × 3 tokens


def test_without_dynamic_sampling_every_group_counts():
    spec = load_spec(["loss=grpo", "dry_run=true"])
    batch, _ = make_batch(spec, 2, TOK, gens(4), torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert batch.sample_mask.tolist() == [1.0, 1.0, 1.0, 1.0]
