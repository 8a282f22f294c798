"""The RL math against independent per-sample / per-token loops written from the papers' formulas.

Every combination of loss.* the schema allows (ratio level × aggregation × KL estimator × dual clip × IS
truncation, clip ranges at their edges) is checked for value AND gradient on ragged masks: rows of different
lengths, an empty row, a sample filtered by sample_mask, a group of equal rewards, NaN garbage at padding.
The micro-batch / data-parallel accumulation (loss · local_denominator / global_denominator, summed) is checked
to give the full batch's loss and gradient. Papers: GRPO (DeepSeekMath, 2402.03300), DAPO (2503.14476),
Dr. GRPO (2503.20783), GSPO (2507.18071, its GSPO-token form), dual clip (Ye et al. 1912.09729), KL estimators
k1/k2/k3 (Schulman, "Approximating KL divergence"), TIS (Yao et al. 2025), IcePop (Ring-1T, 2510.18855).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import statistics
import subprocess
import sys

import pytest
import torch

from grpo_launcher.batch import collate
from grpo_launcher.envs import make_env
from grpo_launcher.policy.torch_policy import TorchPolicyWorker
from helpers import tiny_model
from grpo_launcher.algos import (
    LossInputs,
    combine_metrics,
    compute_advantages,
    is_correction_weights,
    kl_estimate,
    local_denominator,
    spec_policy_loss,
)
from grpo_launcher.spec.compose import CONF_DIR, load_spec
from grpo_launcher.spec.errors import ConfigError
from grpo_launcher.spec.schema import Advantage, Aggregation, ISTruncation, KLEstimator, LossSpec, RatioLevel

D = torch.float64
G = 4  # samples per group
B, T = 12, 7  # 3 groups; response width
NORM_LEN = 9  # rollout.max_new_tokens for Dr. GRPO's constant
TOL = 1e-10  # float64: the loops and the vectorised code differ by summation order only
CLIPS = [(0.2, 0.28), (0.0, 0.0), (0.3, 0.1), (0.2, 0.2)]  # DAPO's clip-higher, both 0, high < low, symmetric


# --------------------------------------------------------------------------- inputs


def inputs(seed: int, advantage: str = "group_norm") -> dict[str, torch.Tensor]:
    """A ragged batch: row lengths 0..T, row 1 empty, row 5 filtered (sample_mask 0), group 2's rewards equal;
    NaN garbage at every masked-out position of every per-token input."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[1] = 0
    mask = (torch.arange(T)[None, :] < lens[:, None]).to(D)  # [B, T]
    smask = torch.ones(B, dtype=D)
    smask[5] = 0.0
    rewards = torch.randint(0, 3, (B,), generator=g).to(D)
    rewards[0], rewards[1] = 0.0, 2.0  # group 0 varies
    rewards[2 * G :] = 1.0  # group 2: all equal
    adv = compute_advantages(advantage, rewards, G)  # [B]
    lp = -torch.rand(B, T, generator=g, dtype=D) * 3  # current policy
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=D)  # ratios around 1, some clipped
    gen = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)  # the rollout engine's (mismatch)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=D)
    nan = torch.full((B, T), float("nan"), dtype=D)
    pad = mask.bool()
    return {
        "lp": torch.where(pad, lp, nan),
        "old": torch.where(pad, old, nan),
        "gen": torch.where(pad, gen, nan),
        "ref": torch.where(pad, ref, nan),
        "adv": adv,
        "mask": mask,
        "smask": smask,
        "rewards": rewards,
    }


# --------------------------------------------------------------------------- loop references


def ref_is_weight(prev: float, gen: float, mode: str, threshold: float, low: float | None) -> float:
    """TIS: min(pi_old / pi_rollout, C); IcePop: the weight inside [low, C] (low = 1/C by default), else 0."""
    w = math.exp(prev - gen)
    if mode == "tis":
        return min(w, threshold)
    if mode == "icepop":
        lo = 1.0 / threshold if low is None else low
        return w if lo <= w <= threshold else 0.0
    return w


def ref_kl(lp: torch.Tensor, ref: float, estimator: str, clamp: float | None) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) at a sample of pi, r = pi_ref / pi: k1 = -log r,
    k2 = (log r)^2 / 2, k3 = r - 1 - log r; log r clamped to ±clamp first when set."""
    d = ref - lp
    if clamp is not None:
        d = torch.clamp(d, -clamp, clamp)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(d) - 1 - d


def ref_token_loss(r: torch.Tensor, a: float, clip_low: float, clip_high: float, dual: float | None) -> torch.Tensor:
    """PPO: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); dual clip: for A < 0 the objective is at least c A."""
    obj = torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
    if dual is not None and a < 0:
        obj = torch.maximum(obj, torch.tensor(dual * a, dtype=D))
    return -obj


def reference_loss(x: dict, lp: torch.Tensor, c: dict) -> torch.Tensor:
    """The loss as a loop over samples and their tokens (lp: the leaf the gradient is taken with)."""
    per_seq: list[tuple[torch.Tensor, int]] = []  # (sum of the row's token losses, its token count)
    for i in range(B):
        toks = [t for t in range(T) if x["mask"][i, t] > 0 and x["smask"][i] > 0]
        if not toks:
            continue
        a = float(x["adv"][i])
        if c["level"] == "sequence":  # GSPO-token: sg[s_i] · pi(y_t) / sg[pi(y_t)], s_i = exp(mean log-ratio)
            s = math.exp(sum(float(lp[i, t] - x["old"][i, t]) for t in toks) / len(toks))
        total = torch.zeros((), dtype=D)
        for t in toks:
            if c["level"] == "token":
                r = torch.exp(lp[i, t] - x["old"][i, t])
            else:
                r = s * torch.exp(lp[i, t] - lp[i, t].detach())
            loss = ref_token_loss(r, a, c["clip_low"], c["clip_high"], c["dual"])
            if c["is_mode"] is not None:
                loss = loss * ref_is_weight(
                    float(x["old"][i, t]), float(x["gen"][i, t]), c["is_mode"], c["threshold"], c["low"]
                )
            if c["kl"] is not None:
                loss = loss + c["kl_coef"] * ref_kl(lp[i, t], float(x["ref"][i, t]), c["kl"], c["kl_clamp"])
            total = total + loss
        per_seq.append((total, len(toks)))
    if not per_seq:
        return torch.zeros((), dtype=D)
    if c["agg"] == "token_mean":  # DAPO: every token of the batch weighs the same
        return sum(s for s, _ in per_seq) / sum(n for _, n in per_seq)
    if c["agg"] == "seq_mean_token_mean":  # GRPO: 1/G sum_i 1/|o_i| sum_t
        return sum(s / n for s, n in per_seq) / len(per_seq)
    return sum(s / NORM_LEN for s, _ in per_seq) / len(per_seq)  # Dr. GRPO: a constant instead of |o_i|


# --------------------------------------------------------------------------- the cases

LEVEL_AGG = [
    (lv, ag)
    for lv in ("token", "sequence")
    for ag in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    if not (lv == "sequence" and ag == "token_mean")
]  # refused at pre-flight (training.py)
IS_CASES = [(None, None, None), ("none", None, None), ("tis", 1.2, None), ("icepop", 1.3, None), ("icepop", 1.5, 0.8)]
CASES = [
    {
        "level": lv,
        "agg": ag,
        "kl": kl,
        "kl_coef": 0.05 if kl else 0.0,
        "kl_clamp": 0.4 if kl == "k3" else None,
        "dual": dual,
        "is_mode": m,
        "threshold": th,
        "low": low,
        "clip_low": CLIPS[k % 4][0],
        "clip_high": CLIPS[k % 4][1],
    }
    for k, ((lv, ag), kl, dual, (m, th, low)) in enumerate(
        itertools.product(LEVEL_AGG, (None, "k1", "k2", "k3"), (None, 1.5), IS_CASES)
    )
]


def case_id(c: dict) -> str:
    return (
        f"{c['level']}-{c['agg']}-kl={c['kl']}-dual={c['dual']}-is={c['is_mode']}{c['threshold'] or ''}"
        f"-clip={c['clip_low']},{c['clip_high']}"
    )


def spec_of(c: dict) -> LossSpec:
    return LossSpec(
        clip_low=c["clip_low"],
        clip_high=c["clip_high"],
        dual_clip_c=c["dual"],
        ratio_level=RatioLevel(c["level"]),
        aggregation=Aggregation(c["agg"]),
        kl_coef=c["kl_coef"],
        kl_estimator=KLEstimator(c["kl"] or "k3"),
        kl_clamp=c["kl_clamp"],
        importance_sampling_correction=c["is_mode"] is not None,
        is_truncation=ISTruncation(c["is_mode"] or "none"),
        is_threshold=c["threshold"],
        is_threshold_low=c["low"],
    )


def loss_inputs(x: dict, c: dict, rows: slice | list[int] = slice(None)) -> LossInputs:
    """What the workers pass (driver.old_logprobs computes the IS weights, the ref pass the ref logprobs)."""
    isw = None
    if c["is_mode"] is not None:
        isw = is_correction_weights(
            x["old"], x["gen"], x["mask"], mode=c["is_mode"], threshold=c["threshold"], low=c["low"]
        )[rows]
    return LossInputs(
        x["old"][rows],
        x["adv"][rows],
        x["mask"][rows],
        x["smask"][rows],
        isw,
        x["ref"][rows] if c["kl"] is not None else None,
    )


def case_of(lo: LossSpec) -> dict:
    """A LossSpec (a preset's, the recipe's) as a case of the loop reference."""
    m = lo.is_truncation.value if lo.importance_sampling_correction else None
    return {
        "level": lo.ratio_level.value,
        "agg": lo.aggregation.value,
        "kl": lo.kl_estimator.value if lo.kl_coef else None,
        "kl_coef": lo.kl_coef,
        "kl_clamp": lo.kl_clamp,
        "dual": lo.dual_clip_c,
        "is_mode": m,
        "threshold": lo.is_threshold,
        "low": lo.is_threshold_low,
        "clip_low": lo.clip_low,
        "clip_high": lo.clip_high,
        "adv": lo.advantage.value,
    }


def deltas(c: dict, seed: int, spec: LossSpec | None = None) -> tuple[float, float]:
    """max |Δ| of the loss value and of d loss / d logprobs, spec_policy_loss vs the loop reference."""
    x = inputs(seed, c.get("adv", "group_norm"))
    lp = x["lp"].clone().requires_grad_(True)
    loss, _, _ = spec_policy_loss(lp, loss_inputs(x, c), spec or spec_of(c), norm_len=NORM_LEN)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = torch.where(x["mask"].bool(), x["lp"], torch.zeros_like(x["lp"])).requires_grad_(True)
    want = reference_loss(x, lp_ref, c)
    (grad_ref,) = torch.autograd.grad(want, lp_ref, allow_unused=True)
    grad_ref = torch.zeros_like(lp_ref) if grad_ref is None else grad_ref
    assert torch.isfinite(grad).all(), "NaN garbage at padding leaked into the gradient"
    return abs(float(loss.detach()) - float(want.detach())), float((grad - grad_ref).abs().max())


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_loss_value_and_gradient_match_the_loop_reference(c):
    for seed in (0, 1):
        dv, dg = deltas(c, seed)
        assert dv < TOL and dg < TOL, (dv, dg)


PRESETS = [[f"loss={p.stem}"] for p in sorted((CONF_DIR / "loss").glob("*.yaml"))] + [
    [f"+recipe={p.stem}", "cluster=slurm", "dry_run=true"] for p in sorted((CONF_DIR / "recipe").glob("*.yaml"))
]


@pytest.mark.parametrize("overrides", PRESETS, ids=" ".join)
def test_every_loss_preset_and_recipe_matches_the_loop_reference(overrides):
    """conf/loss/*.yaml (grpo, dapo, dr_grpo, gspo) and the recipes' loss.* as composed, with their advantages."""
    lo = load_spec(overrides).loss
    for seed in (0, 1):
        dv, dg = deltas(case_of(lo), seed, spec=lo)
        assert dv < TOL and dg < TOL, (dv, dg)


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gspo_token_form_has_the_sequence_objectives_gradient(agg):
    """GSPO's sequence objective min(s_i A, clip(s_i) A), s_i = exp(mean_t log-ratio) with its full gradient,
    equals the token form the code uses in value and gradient (the paper's GSPO-token with A_i,t = A_i)."""
    x = inputs(3)
    c = {
        "level": "sequence",
        "agg": agg,
        "kl": None,
        "kl_coef": 0.0,
        "kl_clamp": None,
        "dual": None,
        "is_mode": None,
        "threshold": None,
        "low": None,
        "clip_low": 0.05,
        "clip_high": 0.08,
    }
    lp = x["lp"].clone().requires_grad_(True)
    loss, _, _ = spec_policy_loss(lp, loss_inputs(x, c), spec_of(c), norm_len=NORM_LEN)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = torch.where(x["mask"].bool(), x["lp"], torch.zeros_like(x["lp"])).requires_grad_(True)
    per_seq = []
    for i in range(B):
        toks = [t for t in range(T) if x["mask"][i, t] > 0 and x["smask"][i] > 0]
        if toks:
            s = torch.exp(sum(lp_ref[i, t] - x["old"][i, t] for t in toks) / len(toks))
            seq = ref_token_loss(s, float(x["adv"][i]), 0.05, 0.08, None)
            per_seq.append(seq * (1 if agg == "seq_mean_token_mean" else len(toks) / NORM_LEN))
    want = sum(per_seq) / len(per_seq)
    (grad_ref,) = torch.autograd.grad(want, lp_ref)
    assert abs(float(loss - want)) < TOL
    assert float((grad - grad_ref).abs().max()) < TOL


# --------------------------------------------------------------------------- micro-batches and ranks


def accumulated(x: dict, c: dict, splits: list[list[int]], cut: bool) -> tuple[float, torch.Tensor]:
    """The update's accumulation: each micro-batch backpropagates loss · local_denominator / global_denominator
    (policy/torch_policy.py _micro_step); `cut`: each micro-batch trimmed to its own longest row (microbatch.take)."""
    spec = spec_of(c)
    lp = x["lp"].clone().requires_grad_(True)
    den = local_denominator(spec.aggregation, loss_inputs(x, c).effective_mask)
    total = 0.0
    for rows in splits:
        inp = loss_inputs(x, c, rows)
        width = max(int(inp.mask.sum(-1).max()), 1) if cut else T
        inp = LossInputs(
            *(
                None if v is None else (v[:, :width] if v.dim() == 2 else v)
                for v in (inp.old_logprobs, inp.advantages, inp.mask, inp.sample_mask, inp.is_weights, inp.ref_logprobs)
            )
        )
        loss, _, _ = spec_policy_loss(lp[rows][:, :width], inp, spec, norm_len=NORM_LEN)
        share = local_denominator(spec.aggregation, inp.effective_mask) / den
        (loss * share).backward()
        total += float(loss) * share
    assert lp.grad is not None
    return total, lp.grad


SPLITS = [
    [list(range(B))],  # one micro-batch
    [[i] for i in range(B)],  # micro_batch_size=1 (the recipe's)
    [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]],  # uneven
    [[1, 5], [0, 2, 3, 4], [6, 7, 8, 9, 10, 11]],  # one with only the empty and the filtered row
    [[11, 3, 7], [0, 9, 1, 5], [2, 4, 6, 8, 10]],  # dynamic batching's reordering (rows longest first)
]


@pytest.mark.parametrize("c", [c for c in CASES if c["dual"] and c["is_mode"] in (None, "tis")], ids=case_id)
def test_micro_batches_and_ranks_give_the_full_batch_loss_and_gradient(c):
    x = inputs(4)
    full, g_full = accumulated(x, c, SPLITS[0], cut=False)
    for splits, cut in itertools.product(SPLITS[1:], (False, True)):
        total, g = accumulated(x, c, splits, cut)
        assert abs(total - full) < TOL, (splits, cut)
        assert float((g - g_full).abs().max()) < TOL, (splits, cut)


# --------------------------------------------------------------------------- advantages


def ref_advantages(name: str, rewards: list[float], eps: float = 1e-6) -> list[float]:
    """Per group: GRPO (r - mean) / (std + eps), sample std; RLOO r_i - mean of the others; RLOO / the others'
    std (NeMo-RL's calculate_baseline_and_std_per_prompt, the seed recipe's); Dr. GRPO r - mean. A group whose
    rewards are all equal learns nothing: exactly 0."""
    out: list[float] = []
    for k in range(0, len(rewards), G):
        grp = rewards[k : k + G]
        if max(grp) == min(grp):
            out += [0.0] * G
            continue
        mean = statistics.fmean(grp)
        if name == "group_norm":
            out += [(r - mean) / (statistics.stdev(grp) + eps) for r in grp]
        elif name == "leave_one_out":
            out += [r - (sum(grp) - r) / (G - 1) for r in grp]
        elif name == "leave_one_out_std":  # NeMo-RL: normalize_rewards + use_leave_one_out_baseline
            for i, r in enumerate(grp):
                others = grp[:i] + grp[i + 1 :]
                base = statistics.fmean(others)
                sd = statistics.pstdev(others) if max(others) > min(others) else 0.0  # the others' population std
                out.append((r - base) / (sd + eps) if sd > 0 else r - base)  # unscaled where the others agree
        else:
            out += [r - mean for r in grp]
    return out


@pytest.mark.parametrize("name", [a.value for a in Advantage])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_match_the_loop_reference(name, dtype):
    """Every loss.advantage against its loop; float32 rewards as the envs give them, float64."""
    g = torch.Generator().manual_seed(7)
    rewards = torch.cat(
        [
            torch.rand(2 * G, generator=g),
            torch.full((G,), 0.3),  # equal, not exact in binary
            torch.tensor([1.0, 1.0, 1.0, 1.0 + 2**-20]),  # nearly equal: std ~ 2.4e-7 < eps
            torch.randint(0, 2, (2 * G,), generator=g).float(),
            torch.tensor([1.0, 0.1, 0.1, 0.1]),  # the others of row 0 agree (not exactly in binary): unscaled
            torch.tensor([1.0, 0.0, 0.0, 0.0]),  # binary, one right
        ]
    ).to(dtype)
    got = compute_advantages(name, rewards, G)
    want = torch.tensor(ref_advantages(name, rewards.double().tolist()), dtype=D)
    assert got.dtype == dtype
    assert float((got.double() - want).abs().max()) < (1e-5 if dtype == torch.float32 else 1e-12)
    assert (got[2 * G : 3 * G] == 0).all()  # exactly 0, not rounding noise


# --------------------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("estimator", [e.value for e in KLEstimator])
def test_kl_estimators_in_expectation_under_the_policy(estimator):
    """Sum over a categorical p of p(x) k(x) (the exact expectation): k1 and k3 are unbiased for KL(p || q);
    k2 is KL's second-order approximation, 1/2 E_p[(log q/p)^2] >= 0."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g, dtype=D), 0)
    q = torch.softmax(torch.log(p) + 0.1 * torch.randn(50, generator=g, dtype=D), 0)
    kl = float((p * (p.log() - q.log())).sum())
    est = float((p * kl_estimate(p.log()[None], q.log()[None], estimator=estimator)[0]).sum())
    if estimator == "k2":
        assert est == pytest.approx(0.5 * float((p * (q.log() - p.log()) ** 2).sum()), rel=1e-12)
        assert est == pytest.approx(kl, rel=0.1)
    else:
        assert est == pytest.approx(kl, rel=1e-10)


# --------------------------------------------------------------------------- the sampling temperature


@pytest.mark.parametrize("chunk", ["0", "4096"])
def test_policy_logprobs_are_the_samplers_at_the_sampling_temperature(model_root, chunk):
    """rollout.temperature=0.7: the engine's logprobs (log softmax(logits / T) of the sampled token) and the policy's
    old logprobs (its forward, logits / T: whole logits, or the chunked LogprobHead) agree, so the ratio and the IS
    weights compare the same distribution; at temperature 1 they would be off by far more than the tolerance."""
    small = [
        "grpo.num_prompts_per_step=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.logprob_batch_size=8",
        "logging.mlflow=false",
        "rollout.temperature=0.7",
        f"train.logprob_chunk_tokens={chunk}",
    ]
    spec = load_spec([f"output_root={model_root}", *small])
    env = make_env(spec)
    w = TorchPolicyWorker(spec, str(tiny_model(*small)), 0, 1)
    tok = w.engine.tokenizer
    gens = w.generate([tok(p.text)["input_ids"] for p in env.train_prompts(1, 0, 2)], 4, seed=5)
    batch = collate(gens, torch.zeros(len(gens)), torch.ones(len(gens)), tok.pad_token_id)
    prev, _ = w.logprobs(batch)
    mask = batch.response_mask.bool()
    assert float((prev - batch.generation_logprobs)[mask].abs().max()) < 1e-4
    at_one = TorchPolicyWorker(load_spec([f"output_root={model_root}", *small[:-2]]), str(tiny_model(*small)), 0, 1)
    assert float((at_one.logprobs(batch)[0] - batch.generation_logprobs)[mask].abs().max()) > 1e-2


@pytest.mark.parametrize("agg", [a.value for a in Aggregation])
def test_micro_batch_metrics_combine_to_the_full_batch_metrics(agg):
    """train/kl, clip_fraction, ratio_mean, entropy do not depend on train.micro_batch_size or the DP split: each
    micro-batch's metrics are weighed by its share of the loss's denominator (UpdateLog, combine_metrics). Before
    the fix the seq_* aggregations averaged them per token and weighed them per sequence: kl 0.0475 (one
    micro-batch) vs 0.0523 (micro_batch_size=1) on this batch."""
    c = {
        "level": "token",
        "agg": agg,
        "kl": "k3",
        "kl_coef": 0.05,
        "kl_clamp": None,
        "dual": None,
        "is_mode": None,
        "threshold": None,
        "low": None,
        "clip_low": 0.3,
        "clip_high": 0.1,
    }
    x, spec = inputs(4), spec_of(c)
    ent = torch.rand(B, T, generator=torch.Generator().manual_seed(0), dtype=D)
    den = local_denominator(spec.aggregation, loss_inputs(x, c).effective_mask)
    combined = []
    for splits in SPLITS:
        parts = []
        for rows in splits:
            inp = loss_inputs(x, c, rows)
            loss, _, m = spec_policy_loss(x["lp"][rows], inp, spec, norm_len=NORM_LEN, entropy=ent[rows])
            parts.append(({"loss": float(loss), **m}, local_denominator(spec.aggregation, inp.effective_mask) / den))
        combined.append(combine_metrics(parts))
    for k, v in combined[0].items():
        assert all(abs(m[k] - v) < TOL for m in combined[1:]), (k, [m[k] for m in combined])


# --------------------------------------------------------------------------- keys at their edges


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.clip_low=0", "loss.clip_high=0"],  # ratio clipped to exactly 1 on the side A points to
        ["loss.clip_low=0.3", "loss.clip_high=0.1"],  # clip_high < clip_low: an asymmetric range, as DAPO's
        ["loss=gspo", "loss.clip_low=0", "loss.clip_high=0"],
        ["loss.kl_coef=0", "loss.kl_estimator=k1"],  # no KL term (and no reference model)
        ["loss.importance_sampling_correction=true", "loss.is_truncation=tis", "loss.is_threshold=0.5"],
        ["rollout.temperature=0.00001"],
    ],
    ids=" ".join,
)
def test_keys_at_their_edges_are_accepted_and_match_the_reference(overrides):
    lo = load_spec(overrides).loss
    dv, dg = deltas(case_of(lo), 0, spec=lo)
    assert dv < TOL and dg < TOL, (dv, dg)


@pytest.mark.parametrize(
    ("overrides", "rule", "keys"),
    [
        # vLLM samples greedily below 1e-5 (sampling_params._SAMPLING_EPS) and its processed logprobs are then
        # log softmax(logits) at temperature 1, while the policy divides by rollout.temperature
        (["rollout.temperature=0.000001"], "sampling_keeps_logprobs_exact", ("rollout.temperature",)),
        (["rollout=vllm", "rollout.temperature=1e-9"], "sampling_keeps_logprobs_exact", ("rollout.temperature",)),
        # a threshold without a truncation mode: the weights stay untruncated, silently
        (
            ["loss.importance_sampling_correction=true", "loss.is_threshold=2"],
            "importance_sampling_truncation",
            ("loss.is_threshold", "loss.is_truncation"),
        ),
        (["loss.is_threshold=2"], "importance_sampling_truncation", ("loss.is_threshold", "loss.is_truncation")),
        (["loss.clip_low=1"], "loss_ranges", ("loss.clip_low",)),
        (["loss.clip_high=-0.1"], "loss_ranges", ("loss.clip_high",)),
        (["loss.dual_clip_c=1"], "loss_ranges", ("loss.dual_clip_c",)),
        (["grpo.num_generations_per_prompt=1"], "group_size_at_least_two", ("grpo.num_generations_per_prompt",)),
    ],
)
def test_keys_past_their_edges_are_refused_naming_them(overrides, rule, keys):
    with pytest.raises(ConfigError) as info:
        load_spec(overrides)
    found = [v for v in info.value.violations if v.rule == rule]
    assert found, [v.rule for v in info.value.violations]
    assert set(keys) <= set(found[0].keys), found[0].keys


VLLM_DEFAULTS = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from grpo_launcher.rollout.vllm import ENGINE_SAMPLING
for kw in ({"generation_config": "auto"}, ENGINE_SAMPLING):
    mc = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, **kw).create_model_config()
    print(json.dumps(mc.get_diff_sampling_param()))
"""


def test_vllm_http_requests_sample_the_full_distribution(tmp_path):
    """Gym's requests (the engine's HTTP server) set temperature and top_p only: vLLM fills what a request leaves
    unset from the engine's defaults, which with generation_config="auto" (vLLM's default) are the checkpoint's
    generation_config.json (Qwen3's top_k=20 ...). The engine would sample, and return processed logprobs of, a
    truncated, penalised distribution while the policy's logprobs are the full softmax(logits / T): the engine's
    own sampling settings (rollout/vllm.py ENGINE_SAMPLING) leave none of it. A child process: vLLM's CPU build
    patches torch's threads in the process that imports it (tests/unit/test_vllm.py)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model(), model)
    sampling = {"top_k": 20, "top_p": 0.95, "temperature": 0.6, "repetition_penalty": 1.1, "min_p": 0.05}
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **sampling}))
    out = subprocess.run(
        [sys.executable, "-c", VLLM_DEFAULTS, str(model)], capture_output=True, text=True, timeout=300, check=True
    )
    auto, ours = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert auto == sampling  # what generation_config="auto" would put into every Gym request
    assert ours == {}


@pytest.mark.parametrize("estimator", [e.value for e in KLEstimator])
def test_kl_estimators_gradients_in_expectation_as_a_loss_term(estimator):
    """As a loss term at samples of pi (the on-policy case, exact expectation over a categorical): k1's gradient is 0
    in expectation (only its value estimates the KL), k2's is the gradient of KL(pi || pi_ref), k3's (GRPO's) that of
    KL(pi_ref || pi) (Schulman's note; Tang & Munos 2025). kl_estimate's docstring says so."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(30, generator=g, dtype=D).requires_grad_(True)
    log_q = torch.log_softmax(torch.randn(30, generator=g, dtype=D), 0)
    log_p = torch.log_softmax(theta, 0)
    p = log_p.exp().detach()  # the sampling distribution carries no gradient
    (grad,) = torch.autograd.grad(
        (p * kl_estimate(log_p[None], log_q[None], estimator=estimator)[0]).sum(), theta, retain_graph=True
    )
    reverse = (log_p.exp() * (log_p - log_q)).sum()  # KL(pi || pi_ref)
    forward = (log_q.exp() * (log_q - log_p)).sum()  # KL(pi_ref || pi)
    want = {
        "k1": torch.zeros_like(theta),
        "k2": torch.autograd.grad(reverse, theta, retain_graph=True)[0],
        "k3": torch.autograd.grad(forward, theta)[0],
    }[estimator]
    assert float((grad - want).abs().max()) < 1e-12


def test_the_recipe_takes_the_seeds_advantages():
    """NeMo-RL's grpo_nanov3.yaml: normalize_rewards: true, use_leave_one_out_baseline: true (A = (r - mean of the
    others) / (their std + 1e-6), reference/nemo-rl.md 4.1); the recipe's loss.advantage is that estimator."""
    spec = load_spec(["+recipe=nanov3", "cluster=slurm", "dry_run=true"])
    assert spec.loss.advantage == Advantage.leave_one_out_std
    r = torch.tensor([1.0, 0.0, 0.0, 1.0] * 4)  # G = 16 of the recipe: 8 right
    adv = compute_advantages(spec.loss.advantage, r, 16)
    others = statistics.pstdev([1.0] * 7 + [0.0] * 8)
    assert float(adv[0]) == pytest.approx((1 - 7 / 15) / (others + 1e-6), rel=1e-6)  # ~1.07, not RLOO's 0.53


@pytest.mark.parametrize("loss", ["gspo", "dr_grpo", "dapo"])
def test_the_workers_update_does_not_depend_on_micro_batch_size(model_root, loss):
    """The torch worker's update (policy/torch_policy.py: loss · local/global denominator per micro-batch, backward,
    one step) with a KL term, IS weights and a filtered sample: micro_batch_size 16 (one micro-batch), 4 and 1 give
    the same loss, gradients and metrics (fp32: up to summation order)."""
    small = [
        "grpo.num_prompts_per_step=2",
        "train.global_batch_size=16",
        "train.logprob_batch_size=16",
        "train.micro_batch_size=16",
        "logging.mlflow=false",
        f"loss={loss}",
        "loss.kl_coef=0.1",
        "loss.kl_estimator=k2",
        "loss.importance_sampling_correction=true",
        "loss.is_truncation=tis",
        "loss.is_threshold=1.5",
    ]
    model_dir = str(tiny_model(*small))
    workers = [
        TorchPolicyWorker(
            load_spec([f"output_root={model_root}", *small, f"train.micro_batch_size={m}"]), model_dir, 0, 1
        )
        for m in (16, 4, 1)
    ]
    env, tok = make_env(workers[0].spec), workers[0].engine.tokenizer
    gens = workers[0].generate([tok(p.text)["input_ids"] for p in env.train_prompts(1, 0, 2)], 8, seed=11)
    smask = torch.ones(len(gens))
    smask[3] = 0.0
    batch = collate(gens, torch.linspace(-1, 1, len(gens)), smask, tok.pad_token_id)
    prev, ref = workers[0].logprobs(batch)
    noise = 0.2 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(2))
    old = prev + noise  # ratios ≠ 1: clipping is exercised
    isw = is_correction_weights(old, batch.generation_logprobs, batch.response_mask, mode="tis", threshold=1.5)
    b = batch.with_(prev_logprobs=old, ref_logprobs=ref, is_weights=isw)
    den = [local_denominator(workers[0].spec.loss.aggregation, loss_inputs_of(b).effective_mask)]
    outs = []
    for w in workers:
        w.opt.step = lambda: None  # the gradients stay as the backward left them
        outs.append(w.update([b], den))
    for w, out in zip(workers[1:], outs[1:]):
        for k in ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean", "entropy", "grad_norm"):
            assert out[k] == pytest.approx(outs[0][k], rel=1e-4, abs=1e-6), k
        for (name, x), y in zip(workers[0].model.named_parameters(), w.model.parameters()):
            assert torch.allclose(x.grad, y.grad, atol=1e-6, rtol=1e-4), name


def loss_inputs_of(b) -> LossInputs:
    return LossInputs.of(b, b.prev_logprobs)
