"""Tests for grpo_launcher.algos: hand-computed values, edge cases, and loop references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from grpo_launcher.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_surrogate,
    compute_advantages,
    entropy_from_logits,
    group_rows,
    importance_ratio,
    is_correction_weights,
    kl_estimate,
    learns_anything,
    masked_mean,
    nonzero_variance_groups,
    overlong_sample_mask,
    policy_loss,
    token_logprobs,
)

D = torch.float64
SEEDS = [0, 1, 2, 3, 4]


def t(x, dtype=D, **kw) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, **kw)


# --------------------------------------------------------------------------- helpers


def test_masked_mean_values():
    x = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[1, 0], [1, 1]], dtype=torch.bool)
    assert_close(masked_mean(x, mask), t(8.0 / 3.0))  # (1+3+4)/3
    assert_close(masked_mean(x, mask, dim=-1), t([1.0, 3.5]))  # [1/1, (3+4)/2]
    # empty row -> 0, not NaN; garbage (inf) under the mask is ignored
    x2 = t([[float("inf"), 2.0]])
    assert_close(masked_mean(x2, t([[0, 1]]), dim=-1), t([2.0]))
    assert_close(masked_mean(x2, t([[0, 0]])), t(0.0))


def test_token_logprobs_and_entropy():
    # softmax([0, log 3]) = [1/4, 3/4]
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], dtype=torch.bfloat16)
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp.dtype == torch.float32 and lp.shape == (1, 2)
    assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25)]]), atol=1e-2, rtol=0)
    # uniform over V=4 -> log 4; -inf logit (prob 0) contributes 0, not NaN: uniform over 2 -> log 2
    logits2 = t([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, float("-inf"), float("-inf")]]])
    assert_close(entropy_from_logits(logits2), t([[math.log(4.0), math.log(2.0)]]))


# --------------------------------------------------------------------------- advantages


def test_advantages_hand_computed():
    r = t([1.0, 0.0, 0.0, 0.0])  # one group of G=4
    # mean = 0.25, deviations [.75, -.25, -.25, -.25]; sample var = (.5625 + 3*.0625)/3 = .25 -> std .5
    assert_close(compute_advantages("group_norm", r, 4), t([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    # LOO: 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3
    assert_close(compute_advantages("leave_one_out", r, 4), t([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # LOO / std: [1, -1/3]/0.5 = [2, -2/3]
    assert_close(
        compute_advantages("leave_one_out", r, 4, normalize_std=True),
        t([2.0, -2 / 3, -2 / 3, -2 / 3]),
        atol=1e-5,
        rtol=0,
    )
    # Dr. GRPO: r - mean
    assert_close(compute_advantages("no_std", r, 4), t([0.75, -0.25, -0.25, -0.25]))
    # [1,0,0,1], G=2: groups [1,0],[0,1]; mean .5, std sqrt((.25+.25)/1) = sqrt(.5) -> +-.5/sqrt(.5) = +-sqrt(.5)
    s = math.sqrt(0.5)
    assert_close(compute_advantages("group_norm", t([1.0, 0.0, 0.0, 1.0]), 2), t([s, -s, -s, s]), atol=1e-5, rtol=0)
    # equal rewards -> 0/(0+eps) = 0 (no NaN); int rewards accepted
    assert_close(compute_advantages("group_norm", torch.tensor([1, 1]), 2), torch.zeros(2))


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_advantages_over_the_valid_samples_of_each_group(name):
    """`valid`: each group's estimate over its valid members alone (as if the group were only those), 0 elsewhere
    and in a group with fewer than two valid members; all valid: the plain estimate."""
    r = t([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0])  # three groups of G=4
    valid = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    adv = compute_advantages(name, r, 4, valid=valid)
    assert adv[:4].tolist() == [0.0] * 4  # [1, 1, 1, -]: equally good
    assert_close(adv[[4, 5, 7]], compute_advantages(name, t([1.0, 0.0, 0.0]), 3))
    assert adv[6] == 0 and adv[8:].tolist() == [0.0] * 4  # one valid member: nothing to compare with
    assert_close(compute_advantages(name, r, 4, valid=torch.ones(12, dtype=torch.bool)), compute_advantages(name, r, 4))


def test_advantages_errors():
    for name in ADVANTAGE_ESTIMATORS:
        with pytest.raises(ValueError):
            compute_advantages(name, t([1.0, 0.0, 1.0]), 2)  # 3 % 2 != 0
        with pytest.raises(ValueError):
            compute_advantages(name, t([1.0, 0.0]), 1)  # G < 2
    with pytest.raises(ValueError, match="group_norm"):
        compute_advantages("nope", t([1.0, 0.0]), 2)


def _ref_advantages(name: str, rewards: list[float], g: int, eps: float = 1e-6) -> list[float]:
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k : k + g]
        mean, std = sum(grp) / g, statistics.stdev(grp)
        for i, r in enumerate(grp):
            if name == "group_norm":
                out.append((r - mean) / (std + eps))
            elif name == "leave_one_out":
                out.append(r - (sum(grp) - r) / (g - 1))
            elif name == "leave_one_out_std":  # / the others' population std, unscaled where they agree
                others = grp[:i] + grp[i + 1 :]
                base, sd = statistics.fmean(others), statistics.pstdev(others) if max(others) > min(others) else 0.0
                out.append((r - base) / (sd + eps) if sd > 0 else r - base)
            else:
                out.append(r - mean)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_advantages_match_loop_reference(seed):
    torch.manual_seed(seed)
    g = int(torch.randint(2, 9, ()))
    n = int(torch.randint(1, 6, ()))
    rewards = torch.randn(n * g, dtype=D)
    rewards[:g] = (rewards[:g] > 0).to(D)  # include a binary group (possibly zero-variance)
    for name in ADVANTAGE_ESTIMATORS:
        expected = t(_ref_advantages(name, rewards.tolist(), g))
        assert_close(compute_advantages(name, rewards, g), expected)


# --------------------------------------------------------------------------- ratios & surrogate


def test_importance_ratio_token():
    lp, old = t([[0.0, -1.0]]), t([[-0.5, -1.0]])
    assert_close(importance_ratio(lp, old, torch.ones(1, 2), level="token"), t([[math.exp(0.5), 1.0]]))
    with pytest.raises(ValueError):
        importance_ratio(lp, old, torch.ones(1, 2), level="bogus")


def test_importance_ratio_sequence_gspo():
    # log-ratios [0.5, 0.1, masked 9.0] -> mean over masked-in = 0.3 -> s = e^0.3 everywhere
    old = t([[0.0, 0.0, 0.0]])
    lp = t([[0.5, 0.1, 9.0]], requires_grad=True)
    mask = t([[1.0, 1.0, 0.0]])
    ratio = importance_ratio(lp, old, mask, level="sequence")
    assert_close(ratio.detach(), torch.full((1, 3), math.exp(0.3), dtype=D))
    # gradient is per token: d ratio[0,0] / d lp = [s, 0, 0] (not s/|y| spread over the sequence)
    (grad,) = torch.autograd.grad(ratio[0, 0], lp, retain_graph=True)
    assert_close(grad, t([[math.exp(0.3), 0.0, 0.0]]))
    # and d sum_t(ratio * mask) / d lp_t = s at each masked-in token
    (grad,) = torch.autograd.grad((ratio * mask).sum(), lp)
    assert_close(grad, t([[math.exp(0.3), math.exp(0.3), 0.0]]))


def test_clipped_surrogate_hand_computed():
    e = math.exp(0.5)  # 1.6487 > 1 + 0.28
    ratio = t([[e, e, 1 / e, 1 / e]], requires_grad=True)  # 1/e = 0.6065 < 1 - 0.2
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    loss, clipped = clipped_surrogate(ratio, adv, clip_low=0.2, clip_high=0.28)
    # A=+1, r=e^.5: min(1.6487, 1.28) = 1.28 -> -1.28 (clipped)
    # A=-1, r=e^.5: min(-1.6487, -1.28) = -1.6487 -> 1.6487 (unclipped)
    # A=-1, r=e^-.5: min(-0.6065, -0.8) = -0.8 -> 0.8 (clipped)
    # A=+1, r=e^-.5: min(0.6065, 0.8) = 0.6065 -> -0.6065 (unclipped)
    assert_close(loss, t([[-1.28, e, 0.8, -1 / e]]))
    assert clipped.tolist() == [[True, False, True, False]]
    (grad,) = torch.autograd.grad(loss.sum(), ratio)
    assert_close(grad, t([[0.0, 1.0, 0.0, -1.0]]))  # clipped tokens get no gradient
    # advantages [B] broadcast over T
    loss_b, _ = clipped_surrogate(t([[e, 1.0]]), t([1.0]), clip_low=0.2, clip_high=0.28)
    assert_close(loss_b, t([[-1.28, -1.0]]))


def test_dual_clip_only_bites_for_negative_advantages():
    ratio = t([[5.0, 5.0, 1.0]])
    adv = t([[1.0, -1.0, -1.0]])
    kw = dict(clip_low=0.2, clip_high=0.28)
    plain, plain_clip = clipped_surrogate(ratio, adv, **kw)
    dual, dual_clip = clipped_surrogate(ratio, adv, dual_clip_c=3.0, **kw)
    # A=+1: -min(5, 1.28) = -1.28 either way; A=-1, r=5: max(5, 1.28)=5 -> capped at -c*A = 3
    # A=-1, r=1: loss 1 < 3, untouched
    assert_close(plain, t([[-1.28, 5.0, 1.0]]))
    assert_close(dual, t([[-1.28, 3.0, 1.0]]))
    assert plain_clip.tolist() == [[True, False, False]]
    assert dual_clip.tolist() == [[True, True, False]]
    with pytest.raises(ValueError):
        clipped_surrogate(ratio, adv, dual_clip_c=1.0, **kw)
    with pytest.raises(ValueError):
        clipped_surrogate(ratio, adv, clip_low=-0.1, clip_high=0.2)


# --------------------------------------------------------------------------- aggregation


def test_aggregations_hand_computed():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is empty
    assert_close(aggregate_loss("token_mean", x, mask), t(7 / 3))  # (1+2+4)/3
    assert_close(aggregate_loss("seq_mean_token_mean", x, mask), t(2.75))  # (1.5 + 4)/2, row 2 excluded
    # (3/4 + 4/4)/2 = 0.875
    assert_close(aggregate_loss("seq_mean_token_sum_norm", x, mask, norm_len=4), t(0.875))
    with pytest.raises(ValueError):
        aggregate_loss("seq_mean_token_sum_norm", x, mask)
    with pytest.raises(ValueError, match="token_mean"):
        aggregate_loss("nope", x, mask)


@pytest.mark.parametrize("name", sorted(LOSS_AGGREGATIONS))
def test_aggregation_all_masked_is_zero_and_differentiable(name):
    x = t([[float("inf"), float("nan")], [1.0, 2.0]], requires_grad=True)
    out = aggregate_loss(name, x, torch.zeros(2, 2), norm_len=2)
    assert out.item() == 0.0
    (grad,) = torch.autograd.grad(out, x)
    assert_close(grad, torch.zeros(2, 2, dtype=D))


def _ref_surrogate_aggs(ratio, adv, mask, clip_low, clip_high, norm_len):
    b, tt = len(ratio), len(ratio[0])
    per = [[0.0] * tt for _ in range(b)]
    for i in range(b):
        for j in range(tt):
            r, a = ratio[i][j], adv[i]
            per[i][j] = -min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
    tok_sum = sum(per[i][j] * mask[i][j] for i in range(b) for j in range(tt))
    tok_cnt = sum(mask[i][j] for i in range(b) for j in range(tt))
    seq_means, seq_sums = [], []
    for i in range(b):
        n = sum(mask[i])
        if n > 0:
            s = sum(per[i][j] * mask[i][j] for j in range(tt))
            seq_means.append(s / n)
            seq_sums.append(s / norm_len)
    return per, {
        "token_mean": tok_sum / tok_cnt if tok_cnt else 0.0,
        "seq_mean_token_mean": sum(seq_means) / len(seq_means) if seq_means else 0.0,
        "seq_mean_token_sum_norm": sum(seq_sums) / len(seq_sums) if seq_sums else 0.0,
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_surrogate_and_aggregation_match_loop_reference(seed):
    torch.manual_seed(seed)
    b, tt = int(torch.randint(1, 7, ())), int(torch.randint(1, 9, ()))
    ratio = (0.4 * torch.randn(b, tt, dtype=D)).exp()
    adv = torch.randn(b, dtype=D)
    mask = (torch.rand(b, tt) > 0.3).to(D)
    mask[0] = 0.0  # always one empty sequence
    per_ref, aggs_ref = _ref_surrogate_aggs(ratio.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, tt)
    per, _ = clipped_surrogate(ratio, adv, clip_low=0.2, clip_high=0.28)
    assert_close(per, t(per_ref))
    for name, expected in aggs_ref.items():
        assert_close(aggregate_loss(name, per, mask, norm_len=tt), t(expected))


# --------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    lp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    d = math.log(0.5)  # ref - lp = log(.25/.5) = -0.6931
    assert_close(kl_estimate(lp, ref, estimator="k1"), t([[-d]]))  # 0.6931
    assert_close(kl_estimate(lp, ref, estimator="k2"), t([[0.5 * d * d]]))  # 0.2402
    assert_close(kl_estimate(lp, ref, estimator="k3"), t([[0.5 - d - 1]]))  # e^d - d - 1 = 0.1931
    # clamp: d = 3 clamped to 1 -> k3 = e - 1 - 1 = 0.71828
    assert_close(kl_estimate(t([[0.0]]), t([[3.0]]), estimator="k3", clamp=1.0), t([[math.e - 2]]))
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(lp, ref, estimator="k9")
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, clamp=0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_match_loop_reference(seed):
    torch.manual_seed(seed)
    b, tt = int(torch.randint(1, 6, ())), int(torch.randint(1, 8, ()))
    lp, ref = -torch.rand(b, tt, dtype=D) * 3, -torch.rand(b, tt, dtype=D) * 3
    fns = {
        "k1": lambda d: -d,
        "k2": lambda d: 0.5 * d * d,
        "k3": lambda d: math.exp(d) - d - 1,
    }
    for clamp in (None, 0.5):
        for name in KL_ESTIMATORS:
            expected = []
            for i in range(b):
                row = []
                for j in range(tt):
                    d = ref[i, j].item() - lp[i, j].item()
                    if clamp is not None:
                        d = max(-clamp, min(clamp, d))
                    row.append(fns[name](d))
                expected.append(row)
            assert_close(kl_estimate(lp, ref, estimator=name, clamp=clamp), t(expected))


# --------------------------------------------------------------------------- IS correction, overlong, dynamic sampling


def test_is_correction_weights():
    prev = t([[0.0, 0.0, 0.0, 0.0]])
    gen = t([[0.0, -1.0, 1.0, math.log(2.0)]], requires_grad=True)
    mask = t([[1, 1, 1, 0]])
    e = math.e
    # w = exp(prev - gen) = [1, e, 1/e, (masked -> 1)]
    w = is_correction_weights(prev, gen, mask, mode="none")
    assert not w.requires_grad
    assert_close(w, t([[1.0, e, 1 / e, 1.0]]))
    assert_close(is_correction_weights(prev, gen, mask, mode="tis", threshold=2.0), t([[1.0, 2.0, 1 / e, 1.0]]))
    # icepop keeps w in [0.5, 2]: e > 2 -> 0, 1/e = 0.368 < 0.5 -> 0
    assert_close(is_correction_weights(prev, gen, mask, mode="icepop", threshold=2.0), t([[1.0, 0.0, 0.0, 1.0]]))
    for kw in (
        dict(mode="tis"),
        dict(mode="tis", threshold=0.0),
        dict(mode="icepop"),
        dict(mode="icepop", threshold=1.0),
        dict(mode="bogus", threshold=2.0),
    ):
        with pytest.raises(ValueError):
            is_correction_weights(prev, gen, mask, **kw)


def test_overlong_and_dynamic_sampling():
    assert overlong_sample_mask(torch.tensor([False, True, False])).tolist() == [1.0, 0.0, 1.0]
    # groups (G=2): [1,1] zero var, [0,1] kept, [0,0] zero var
    keep = nonzero_variance_groups(t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert keep.tolist() == [False, True, False]
    assert group_rows(keep, 2).tolist() == [False, False, True, True, False, False]
    with pytest.raises(ValueError):
        nonzero_variance_groups(t([1.0, 0.0, 1.0]), 2)


# --------------------------------------------------------------------------- policy_loss


def test_policy_loss_hand_computed():
    lp = t([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    old = lp.detach().clone()  # ratio 1 everywhere
    adv = t([1.0, -1.0])
    mask = torch.ones(2, 2)
    kw = dict(clip_low=0.2, clip_high=0.28)
    # sample 1 overlong-filtered: only row 0 counts, per-token loss -1*A = -1 -> token_mean = -1
    loss, per_tok, m = policy_loss(lp, old, adv, mask, sample_mask=t([1.0, 0.0]), **kw)
    assert_close(loss, t(-1.0))
    assert not per_tok.requires_grad
    assert m == {"pg_loss": -1.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0}
    # d loss / d lp = -A * ratio / n_tokens = -1/2 on row 0, 0 on filtered row 1
    (grad,) = torch.autograd.grad(loss, lp)
    assert_close(grad, t([[-0.5, -0.5], [0.0, 0.0]]))

    # with KL (k3, ref - lp = log(.5)): kl = .5 - log .5 - 1 = 0.19315; per-token = pg + 0.1 * kl
    ref = lp.detach() + math.log(0.5)
    kl = 0.5 - math.log(0.5) - 1
    loss, per_tok, m = policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, **kw)
    assert_close(per_tok, t([[-1.0, -1.0], [1.0, 1.0]]) + 0.1 * kl)
    assert_close(loss, t(0.1 * kl))  # pg terms cancel: (-1-1+1+1)/4
    assert m["kl"] == pytest.approx(kl) and m["pg_loss"] == pytest.approx(0.0)

    # IS weights multiply the surrogate only: row 0 weighted 0.5 -> (-0.5-0.5+1+1)/4 = 0.25
    isw = t([[0.5, 0.5], [1.0, 1.0]])
    loss, _, _ = policy_loss(lp, old, adv, mask, is_weights=isw, **kw)
    assert_close(loss, t(0.25))


def test_policy_loss_clip_metrics_and_padding_garbage():
    # row 0: ratio e^.5 with A=+1 -> clipped; row 1 padded with -inf logprobs under mask 0
    lp = t([[0.5, 0.0], [0.0, float("-inf")]], requires_grad=True)
    old = t([[0.0, 0.0], [0.0, float("-inf")]])
    mask = t([[1, 1], [1, 0]])
    for agg in sorted(LOSS_AGGREGATIONS):
        loss, per_tok, m = policy_loss(
            lp, old, t([1.0, 1.0]), mask, clip_low=0.2, clip_high=0.28,
            aggregation=agg, norm_len=2, ref_logprobs=old, kl_coef=0.1,
        )
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(per_tok).all()
        assert grad[1, 1].item() == 0.0
        # token metrics are averaged as the aggregation weighs tokens: 3 tokens, or 2 sequences of 2 and 1
        per_token = agg == "token_mean"
        assert m["clip_fraction"] == pytest.approx(1 / 3 if per_token else (1 / 2 + 0) / 2)
        assert m["ratio_max"] == pytest.approx(math.exp(0.5))
        want = (math.exp(0.5) + 2) / 3 if per_token else ((math.exp(0.5) + 1) / 2 + 1) / 2
        assert m["ratio_mean"] == pytest.approx(want)


def test_policy_loss_composes_components():
    torch.manual_seed(0)
    b, tt = 6, 5
    lp = (-torch.rand(b, tt, dtype=D) * 2).requires_grad_()
    old, ref = lp.detach() + 0.2 * torch.randn(b, tt, dtype=D), lp.detach() + 0.2 * torch.randn(b, tt, dtype=D)
    adv = torch.randn(b, dtype=D)
    mask = (torch.rand(b, tt) > 0.2).to(D)
    smask = t([1, 1, 0, 1, 1, 1])
    isw = torch.rand(b, tt, dtype=D) + 0.5
    for level in ("token", "sequence"):
        loss, _, m = policy_loss(
            lp, old, adv, mask, sample_mask=smask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
            ratio_level=level, aggregation="seq_mean_token_mean", is_weights=isw,
            ref_logprobs=ref, kl_coef=0.05, kl_estimator="k2",
        )
        eff = mask * smask[:, None]
        ratio = importance_ratio(lp, old, eff, level=level)
        pg, _ = clipped_surrogate(ratio, adv, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
        per = isw * pg + 0.05 * kl_estimate(lp, ref, estimator="k2")
        assert_close(loss, aggregate_loss("seq_mean_token_mean", per, eff))
        kl = kl_estimate(lp, ref, estimator="k2")
        assert m["kl"] == pytest.approx(aggregate_loss("seq_mean_token_mean", kl, eff).item())  # as the loss weighs


# --------------------------------------------------------------------------- issue 11: numerics that must hold


def _ref_group_norm(rewards: list[float], g: int, eps: float = 1e-6) -> list[float]:
    """Independent float64 reference (statistics module), exact 0 for all-equal groups."""
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k:k + g]
        if len(set(grp)) == 1:
            out += [0.0] * g
            continue
        mu, sd = statistics.fmean(grp), statistics.stdev(grp)
        out += [(r - mu) / (sd + eps) for r in grp]
    return out


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, 123.456])
def test_zero_variance_groups_give_exactly_zero_in_float32(name, value):
    rewards = torch.full((16,), value, dtype=torch.float32)
    adv = compute_advantages(name, rewards, 8)
    assert adv.dtype == torch.float32 and bool((adv == 0).all()), adv


@pytest.mark.parametrize("seed", SEEDS)
def test_group_norm_float32_matches_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(48, generator=g) * 3).round(decimals=1).to(torch.float32)  # ties and equal groups
    rewards[:8] = 0.7
    ref = torch.tensor(_ref_group_norm([float(r) for r in rewards], 8), dtype=D)
    assert_close(compute_advantages("group_norm", rewards, 8).to(D), ref, atol=1e-5, rtol=1e-5)


def test_huge_log_ratio_on_a_clipped_token_has_a_finite_gradient():
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]], dtype=torch.float32)  # log-ratio 100 > 88: exp overflows float32
    loss, _, m = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all()) and math.isfinite(m["ratio_max"])


def test_is_weights_finite_for_minus_inf_rollout_logprobs():
    prev = torch.tensor([[-1.0, -2.0, float("-inf")]])
    gen = torch.tensor([[float("-inf"), -2.0, float("-inf")]])
    w = is_correction_weights(prev, gen, torch.ones(1, 3), mode="none")
    assert bool(torch.isfinite(w).all())
    assert w[0, 1] == 1.0 and w[0, 2] == 0.0  # undefined (-inf - -inf) weighs nothing


def test_icepop_two_bounds():
    prev = torch.log(torch.tensor([[0.3, 0.6, 1.0, 4.0, 6.0]]))
    gen = torch.zeros(1, 5)  # w = 0.3, 0.6, 1, 4, 6
    w = is_correction_weights(prev, gen, torch.ones(1, 5), mode="icepop", threshold=5.0, low=0.5)
    assert_close(w, torch.tensor([[0.0, 0.6, 1.0, 4.0, 0.0]]))
    sym = is_correction_weights(prev, gen, torch.ones(1, 5), mode="icepop", threshold=5.0)  # low = 1/5
    assert_close(sym, torch.tensor([[0.3, 0.6, 1.0, 4.0, 0.0]]))
    with pytest.raises(ValueError):
        is_correction_weights(prev, gen, torch.ones(1, 5), mode="tis", threshold=2.0, low=0.5)


def test_no_loss_bearing_sample_means_no_step():
    from grpo_launcher.algos import has_loss

    mask = torch.ones(4, 3)
    assert has_loss(mask, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert not has_loss(mask, torch.zeros(4)) and not has_loss(torch.zeros(4, 3))


def test_ratio_max_is_a_max_and_entropy_follows_the_sample_mask():
    from grpo_launcher.algos import combine_metrics

    parts = [({"ratio_max": 1.5, "kl": 0.2}, 0.5), ({"ratio_max": 3.0, "kl": 0.4}, 0.5)]
    assert combine_metrics(parts) == {"ratio_max": 3.0, "kl": pytest.approx(0.3)}
    ent = torch.tensor([[1.0, 1.0], [9.0, 9.0]])
    _, _, m = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 2),
                          sample_mask=torch.tensor([1.0, 0.0]), clip_low=0.2, clip_high=0.2, entropy=ent)
    assert m["entropy"] == pytest.approx(1.0)  # the filtered sample's entropy is not in the metric


def test_spec_policy_loss_is_policy_loss_with_the_spec_settings():
    """The workers' typed call (LossInputs + LossSpec) is policy_loss with loss.*'s values; the denominators."""
    from grpo_launcher.algos import LossInputs, local_denominator, spec_policy_loss
    from grpo_launcher.spec.schema import Aggregation, KLEstimator, LossSpec, RatioLevel

    torch.manual_seed(1)
    lp, old, ref = (-torch.rand(4, 3, dtype=D) for _ in range(3))
    adv, mask, smask = torch.randn(4, dtype=D), t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]), t([1, 0, 1, 1])
    spec = LossSpec(clip_low=0.1, clip_high=0.3, dual_clip_c=2.0, ratio_level=RatioLevel.sequence,
                    aggregation=Aggregation.seq_mean_token_sum_norm, kl_coef=0.2, kl_estimator=KLEstimator.k2,
                    kl_clamp=5.0)
    x = LossInputs(old, adv, mask, sample_mask=smask, ref_logprobs=ref)
    got = spec_policy_loss(lp, x, spec, norm_len=3)
    want = policy_loss(lp, old, adv, mask, sample_mask=smask, clip_low=0.1, clip_high=0.3, dual_clip_c=2.0,
                       ratio_level="sequence", aggregation="seq_mean_token_sum_norm", ref_logprobs=ref,
                       kl_coef=0.2, kl_estimator="k2", kl_clamp=5.0, norm_len=3)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert got[2] == want[2]
    # effective mask: rows 0 and 2 carry loss (row 1 filtered, row 3 empty): 2 + 3 tokens, 2 sequences
    assert_close(x.effective_mask, t([[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]))
    assert local_denominator(Aggregation.token_mean, x.effective_mask) == 5.0
    assert local_denominator(Aggregation.seq_mean_token_mean, x.effective_mask) == 2.0


def test_learns_anything_only_where_a_loss_bearing_row_has_a_signal():
    """Rows of groups whose rewards were all equal have advantage 0: a minibatch of only those (or of masked rows
    otherwise) has a loss of 0 whatever the policy, and takes no optimizer step."""
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 2.0, 2.0])  # groups of 2: equal, varied, equal
    signal = group_rows(nonzero_variance_groups(rewards, 2), 2)  # [6]
    assert signal.tolist() == [False, False, True, True, False, False]
    mask = torch.ones(6, 3)
    assert learns_anything(signal, mask)
    assert not learns_anything(signal[4:], mask[4:])  # only the equal group
    assert not learns_anything(signal, mask, sample_mask=torch.tensor([1.0, 1, 0, 0, 1, 1]))  # varied masked
    assert not learns_anything(signal, mask * torch.tensor([1.0, 1, 0, 0, 1, 1])[:, None])  # no tokens there
