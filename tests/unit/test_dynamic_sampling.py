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


def test_reward_metrics_count_every_sample_generated_not_the_groups_kept():
    """DAPO keeps the groups whose rewards vary: train/reward_mean is the mean of all the step generated (0.75
    here), not of the kept groups (0.5), so loss=dapo and loss=grpo curves compare."""
    from types import SimpleNamespace

    from grpo_launcher.train.sources import Timer, reward_summary, sample_groups

    spec = load_spec(["loss=dapo", "loss.dynamic_sampling_max_rounds=3", "dry_run=true"])
    rounds = iter([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])  # round 0 keeps group 1, round 1 group 0
    src = SimpleNamespace(
        spec=spec, plan=SimpleNamespace(prompts_per_step=2, group_size=2),
        env=SimpleNamespace(train_prompts=lambda step, r, P: [f"p{r}{k}" for k in range(P)]),
        generate=lambda prompts, G, seed: gens(len(prompts) * G),
        score=lambda prompts, g, G: (torch.tensor(next(rounds)), [None] * len(g)))
    r = sample_groups(src, 1, Timer())
    assert r.rounds == 2 and r.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]  # the kept groups
    assert reward_summary(r.generated[0])["train/reward_mean"] == 0.75
    _, m = make_batch(spec, 2, TOK, r.gens, r.rewards)
    assert m["train/reward_mean"] == 0.5  # the batch's own (the driver logs the generated one over it)
