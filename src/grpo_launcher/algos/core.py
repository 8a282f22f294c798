"""GRPO-family RL math as pure torch functions.

Conventions
-----------
* B = num_prompts * G sequences, group-contiguous: rows [k*G, (k+1)*G) are the
  G samples of prompt k.
* Token tensors are [B, T] over *response* tokens only.
* ``mask`` [B, T] (bool or float) is 1 for response tokens that get loss.
* ``sample_mask`` [B] is 1 for samples that contribute loss (0 = overlong-filtered).
* Masked-out positions may hold garbage (even inf / NaN); every reduction here
  selects with ``torch.where`` before multiplying, so they never leak into results.
* Advantages are computed in float64 and returned in the rewards' dtype; a group whose rewards
  are all equal gets exactly 0 (not the rounding noise of a float32 std near 0).
* Log-ratios are clamped to ±LOG_RATIO_CLAMP before ``exp`` (as verl does), so a ratio and its
  gradient stay finite (exp(89) overflows float32; inf · 0 in the backward of a clipped token is NaN).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, TypeVar

import torch
from torch import Tensor

from ..spec.schema import Advantage, Aggregation, KLEstimator

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| cap before exp: exp(20) ≈ 4.9e8, finite in float32 and bf16

# --------------------------------------------------------------------------- helpers


def _mask_pair(mask: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """Return (bool mask, float weights in ``like``'s dtype) for a 0/1 or weight mask."""
    # mask: [...] bool or float; like: [...] floating
    return mask.to(torch.bool), mask.to(like.dtype)


def _masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> tuple[Tensor, Tensor]:
    """Weighted sum of x over dim and the weight total; garbage at masked positions ignored."""
    # x: [B, T]; mask: [B, T]
    mb, m = _mask_pair(mask, x)
    xm = torch.where(mb, x, torch.zeros_like(x)) * m
    if dim is None:
        return xm.sum(), m.sum()
    return xm.sum(dim), m.sum(dim)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with den == 0 replaced by 1 (so empty reductions give 0, not NaN)."""
    return num / torch.where(den > 0, den, torch.ones_like(den))


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask != 0 (weighted by mask); 0 where nothing is masked in."""
    # x: [B, T]; mask: [B, T] -> scalar (dim=None) or reduced over dim
    total, count = _masked_sum(x, mask, dim)
    return _safe_div(total, count)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) per position, computed in float32 (or float64 if given) via log_softmax+gather."""
    # logits: [B, T, V]; tokens: [B, T] int -> [B, T]
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution at each position (float32; -inf logits allowed)."""
    # logits: [B, T, V] -> [B, T]
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    # clamp turns -inf into a finite number so 0 * logp == 0 instead of NaN.
    return -(logp.exp() * logp.clamp(min=torch.finfo(dtype).min)).sum(-1)


# --------------------------------------------------------------------------- advantages


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate and reshape rewards [B] -> [num_groups, G] (floating)."""
    # rewards: [B]
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"batch size {rewards.numel()} is not a multiple of group_size {group_size}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    return r.view(-1, group_size)


def _finish(adv: Tensor, r: Tensor) -> Tensor:
    """float64 advantages [num_groups, G] → [B] in the rewards' dtype; exactly 0 for all-equal groups."""
    constant = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))  # [num_groups, 1]
    return torch.where(constant, torch.zeros_like(adv), adv).to(r.dtype).reshape(-1)


def group_norm_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group sample std (correction=1) + eps), in float64."""
    # rewards: [B] -> [B]
    r = _grouped(rewards, group_size)
    r64 = r.to(torch.float64)  # [num_groups, G]
    mean = r64.mean(dim=1, keepdim=True)
    std = r64.std(dim=1, keepdim=True)  # unbiased, correction=1
    return _finish((r64 - mean) / (std + eps), r)


def leave_one_out_advantages(
    rewards: Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = False
) -> Tensor:
    """RLOO: r_i - mean of the other G-1 rewards; optionally / (group std + eps). In float64."""
    # rewards: [B] -> [B]
    r = _grouped(rewards, group_size)
    r64 = r.to(torch.float64)
    others_mean = (r64.sum(dim=1, keepdim=True) - r64) / (group_size - 1)
    adv = r64 - others_mean
    if normalize_std:
        adv = adv / (r64.std(dim=1, keepdim=True) + eps)
    return _finish(adv, r)


def leave_one_out_std_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    """NeMo-RL's default (normalize_rewards + use_leave_one_out_baseline, the seed recipe's): (r_i - mean of the
    other G-1) / (population std of the other G-1 + eps); unscaled (r_i - their mean) where the others all agree
    (exact comparison, so rounding never divides by ~eps). In float64."""
    # rewards: [B] -> [B]
    r = _grouped(rewards, group_size)
    r64 = r.to(torch.float64)  # [N, G]
    others = ~torch.eye(group_size, dtype=torch.bool, device=r.device)  # [G(i), G(j)]: j != i
    pairs = r64[:, None, :].expand(-1, group_size, -1)  # [N, G(i), G(j)] = r_j
    mean = (r64.sum(dim=1, keepdim=True) - r64) / (group_size - 1)  # [N, G]
    dev = torch.where(others, pairs - mean[..., None], torch.zeros_like(pairs))
    std = (dev.square().sum(-1) / (group_size - 1)).sqrt()  # [N, G]
    inf = torch.full_like(pairs, float("inf"))
    agree = torch.where(others, pairs, inf).amin(-1) == torch.where(others, pairs, -inf).amax(-1)  # [N, G]
    adv = r64 - mean
    return _finish(torch.where(agree, adv, adv / (std + eps)), r)


def no_std_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO: r - group mean (no std scaling; ``eps`` accepted for a uniform signature). In float64."""
    # rewards: [B] -> [B]
    del eps
    r = _grouped(rewards, group_size)
    r64 = r.to(torch.float64)
    return _finish(r64 - r64.mean(dim=1, keepdim=True), r)


# The registries are keyed by the schema's Enums (loss.advantage, loss.aggregation, loss.kl_estimator); they are
# str Enums, so a plain name ("group_norm") finds its member too. tests/unit/test_registries.py: one entry per member.
ADVANTAGE_ESTIMATORS: dict[Advantage, Callable[..., Tensor]] = {
    Advantage.group_norm: group_norm_advantages,
    Advantage.leave_one_out: leave_one_out_advantages,
    Advantage.leave_one_out_std: leave_one_out_std_advantages,
    Advantage.no_std: no_std_advantages,
}

F = TypeVar("F")


def _valid(registry: Mapping[Any, Any]) -> list[str]:
    return sorted(getattr(k, "value", k) for k in registry)


def _lookup(registry: Mapping[Any, F], kind: str, name: str) -> F:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {_valid(registry)}")
    return registry[name]


def compute_advantages(name: str, rewards: Tensor, group_size: int, valid: Optional[Tensor] = None,
                       **kw: object) -> Tensor:
    """Look up ``name`` in ADVANTAGE_ESTIMATORS and apply it. ``valid``: the samples that count (a rollout the
    environment failed has none to give): each group's estimate over its valid members alone, 0 for the others and
    for a group with fewer than two valid members. Without it, every sample counts."""
    # rewards: [B], valid: [B] bool -> [B]
    estimator = _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)
    adv = estimator(rewards, group_size, **kw)
    if valid is None or bool(valid.all()):
        return adv
    for g in range(rewards.numel() // group_size):
        rows = torch.arange(g * group_size, (g + 1) * group_size)  # [G]
        ok = rows[valid[rows].bool()]  # [k]
        adv[rows] = 0.0
        if len(ok) >= 2:
            adv[ok] = estimator(rewards[ok], len(ok), **kw)
    return adv


# --------------------------------------------------------------------------- ratios & surrogate


def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """Clamp to ±LOG_RATIO_CLAMP (NaN → -LOG_RATIO_CLAMP: an undefined ratio weighs nothing)."""
    # log_ratio: [...] -> [...]
    safe = torch.nan_to_num(log_ratio, nan=-LOG_RATIO_CLAMP)
    return safe.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, level: str = "token") -> Tensor:
    """pi/pi_old per token ("token") or GSPO's length-normalised sequence ratio ("sequence").

    "sequence" uses GSPO's token form ``sg[s_i] * exp(lp - sg[lp])``: every position's value is
    s_i = exp(masked mean of (lp - old)), while the gradient w.r.t. lp_t is s_i at token t only.
    Log-ratios at masked-out positions are zeroed (token ratio 1 there, no gradient).
    """
    # logprobs, old_logprobs: [B, T]; mask: [B, T] -> [B, T]
    mb = mask.to(torch.bool)
    zero = torch.zeros_like(logprobs)
    lp = torch.where(mb, logprobs, zero)
    log_ratio = clamp_log_ratio(lp - torch.where(mb, old_logprobs.detach(), zero))  # [B, T], finite
    if level == "token":
        return log_ratio.exp()
    if level == "sequence":
        seq_log_ratio = clamp_log_ratio(masked_mean(log_ratio.detach(), mask, dim=-1))  # [B]
        return seq_log_ratio.exp()[:, None] * (lp - lp.detach()).exp()
    raise ValueError(f"unknown ratio level {level!r}; valid: ['sequence', 'token']")


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped loss -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A), with optional dual clip.

    Dual clip (c > 1): for A < 0 the loss is capped at -c*A (= c*|A|).
    Returns (per_token_loss [B, T], clipped_mask [B, T] bool); clipped_mask marks tokens where a
    clipped (zero-gradient) branch is active, including the dual clip.
    """
    # ratio: [B, T]; advantages: [B] (or [B, T]) -> ([B, T], [B, T])
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = adv.detach()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clipped_mask = clipped < unclipped
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        bound = (-dual_clip_c * adv).expand_as(loss)
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped_mask = clipped_mask | dual
    return loss, clipped_mask


# --------------------------------------------------------------------------- loss aggregation


def token_mean(per_token: Tensor, mask: Tensor, *, norm_len: int | None = None) -> Tensor:
    """DAPO token-level: sum over all masked tokens / number of masked tokens."""
    # per_token: [B, T]; mask: [B, T] -> scalar
    del norm_len
    return masked_mean(per_token, mask)


def _seq_mean(per_seq: Tensor, tok_count: Tensor) -> Tensor:
    """Mean over sequences that have at least one masked-in token."""
    # per_seq, tok_count: [B] -> scalar
    has_tok = tok_count > 0
    return masked_mean(per_seq, has_tok)


def seq_mean_token_mean(per_token: Tensor, mask: Tensor, *, norm_len: int | None = None) -> Tensor:
    """Original GRPO: mean over tokens per sequence, then mean over (non-empty) sequences."""
    # per_token: [B, T]; mask: [B, T] -> scalar
    del norm_len
    total, count = _masked_sum(per_token, mask, dim=-1)
    return _seq_mean(_safe_div(total, count), count)


def seq_mean_token_sum_norm(per_token: Tensor, mask: Tensor, *, norm_len: int | None = None) -> Tensor:
    """Dr. GRPO: per-sequence token sum / constant norm_len, then mean over (non-empty) sequences."""
    # per_token: [B, T]; mask: [B, T] -> scalar
    if norm_len is None or norm_len <= 0:
        raise ValueError(f"seq_mean_token_sum_norm needs norm_len > 0, got {norm_len}")
    total, count = _masked_sum(per_token, mask, dim=-1)
    return _seq_mean(total / norm_len, count)


LOSS_AGGREGATIONS: dict[Aggregation, Callable[..., Tensor]] = {
    Aggregation.token_mean: token_mean,
    Aggregation.seq_mean_token_mean: seq_mean_token_mean,
    Aggregation.seq_mean_token_sum_norm: seq_mean_token_sum_norm,
}


def aggregate_loss(name: str, per_token: Tensor, mask: Tensor, **kw: object) -> Tensor:
    """Look up ``name`` in LOSS_AGGREGATIONS and apply it."""
    # per_token: [B, T]; mask: [B, T] -> scalar
    return _lookup(LOSS_AGGREGATIONS, "loss aggregation", name)(per_token, mask, **kw)


# --------------------------------------------------------------------------- KL to reference


def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = -d = log p - log q."""
    # log_ratio: [B, T] -> [B, T]
    return -log_ratio


def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = d^2 / 2."""
    # log_ratio: [B, T] -> [B, T]
    return 0.5 * log_ratio.square()


def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 (>= 0, unbiased for KL(p||q) under samples from p)."""
    # log_ratio: [B, T] -> [B, T]
    return log_ratio.exp() - log_ratio - 1.0


# Each maps the log-ratio d = log q - log p (q = reference, p = current policy) to a KL estimate.
KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.k1: kl_k1, KLEstimator.k2: kl_k2, KLEstimator.k3: kl_k3}


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, *, estimator: str = "k3", clamp: float | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs.

    d = ref_logprobs - logprobs; if ``clamp`` is given, d is clamped to [-clamp, clamp] before
    the estimator is applied (bounds k3's exp blow-up). As a loss term at samples of pi, the expected
    gradients differ: k1's is 0 (only its value estimates the KL), k2's is that of KL(pi || pi_ref), k3's
    that of KL(pi_ref || pi) (tests/unit/test_algos_reference.py -k gradients_in_expectation).
    """
    # logprobs, ref_logprobs: [B, T] -> [B, T]
    fn = _lookup(KL_ESTIMATORS, "KL estimator", estimator)
    d = ref_logprobs.detach() - logprobs
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"kl clamp must be > 0, got {clamp}")
        d = d.clamp(-clamp, clamp)
    return fn(d)


# --------------------------------------------------------------------------- off-policy correction


def is_correction_weights(
    prev_logprobs: Tensor,
    generation_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str = "none",
    threshold: float | None = None,
    low: float | None = None,
) -> Tensor:
    """Detached per-token weights w = pi_train_old / pi_rollout for the rollout/trainer mismatch.

    none: w untruncated; tis: min(w, threshold); icepop (Ring-1T / IcePop): w if low <= w <= threshold
    else 0, with ``low`` defaulting to 1/threshold (the paper uses low=0.5, high=5). The log-weight is
    clamped to ±LOG_RATIO_CLAMP first, so a rollout logprob of -inf gives a finite weight (NaN → 0).
    Masked-out positions get weight 1. Multiply the per-token policy loss by the result.
    """
    # prev_logprobs, generation_logprobs: [B, T]; mask: [B, T] -> [B, T]
    if mode not in ("none", "tis", "icepop"):
        raise ValueError(f"unknown IS correction mode {mode!r}; valid: ['icepop', 'none', 'tis']")
    if mode == "tis" and (threshold is None or threshold <= 0):
        raise ValueError(f"tis needs threshold > 0, got {threshold}")
    if mode == "icepop" and (threshold is None or threshold <= 1):
        raise ValueError(f"icepop needs threshold > 1, got {threshold}")
    if low is not None and (mode != "icepop" or not 0 < low < 1):
        raise ValueError(f"low is icepop's lower bound in (0, 1), got {low} with mode {mode!r}")
    mb = mask.to(torch.bool)
    log_w = clamp_log_ratio((prev_logprobs - generation_logprobs).detach())
    undefined = torch.isnan(prev_logprobs - generation_logprobs)  # -inf - -inf: the token weighs nothing
    w = torch.where(mb, log_w, torch.zeros_like(log_w)).exp()
    w = torch.where(mb & undefined, torch.zeros_like(w), w)
    if mode == "tis":
        w = w.clamp(max=threshold)
    elif mode == "icepop":
        keep = (w >= (1.0 / threshold if low is None else low)) & (w <= threshold)
        w = torch.where(keep | ~mb, w, torch.zeros_like(w))
    return w


def overlong_sample_mask(truncated: Tensor) -> Tensor:
    """Loss weight per sample: 0 for truncated (overlong) samples, 1 otherwise.

    Overlong filtering only drops the *loss*: compute advantages on ALL rewards first (a truncated
    sample still counts in its group's baseline), then pass this as ``sample_mask``.
    """
    # truncated: [B] bool -> [B] float
    return 1.0 - truncated.to(torch.float32)


# --------------------------------------------------------------------------- dynamic sampling


def nonzero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling filter: True for groups whose rewards are not all equal."""
    # rewards: [B] -> [num_groups] bool
    r = _grouped(rewards, group_size)
    return r.amax(dim=1) > r.amin(dim=1)


def group_rows(group_mask: Tensor, group_size: int) -> Tensor:
    """Expand a per-group mask to a per-row mask (group-contiguous layout)."""
    # group_mask: [num_groups] bool -> [B] bool
    return group_mask.to(torch.bool).repeat_interleave(group_size)


# --------------------------------------------------------------------------- loss-bearing samples, metrics


def loss_mask(mask: Tensor, sample_mask: Tensor | None = None) -> Tensor:
    """The effective loss mask: response tokens of samples that carry loss (mask * sample_mask[:, None])."""
    # mask: [B, T]; sample_mask: [B] -> [B, T] float
    m = mask.to(torch.float32) if not mask.is_floating_point() else mask
    return m if sample_mask is None else m * sample_mask.to(m.dtype)[:, None]


def has_loss(mask: Tensor, sample_mask: Tensor | None = None) -> bool:
    """False when no token of the minibatch carries loss (dynamic sampling / overlong filtering dropped every
    sample): the optimizer must not step then (AdamW's momentum and weight decay would still move the weights).
    Decide on the WHOLE minibatch (all DP ranks together), count skips as train/skipped_optimizer_steps."""
    # mask: [B, T]; sample_mask: [B]
    return bool((loss_mask(mask, sample_mask) > 0).any())


def learns_anything(signal: Tensor, mask: Tensor, sample_mask: Tensor | None = None) -> bool:
    """False when no loss-bearing sample of the minibatch has a learning signal: each one's group had equal
    rewards, so its advantage is 0 under every group-relative estimator, and without another loss term (KL, MoE
    aux loss) the loss is 0 whatever the policy. Its gradient is 0: the optimizer must not step (see has_loss)."""
    # signal: [B] bool, rows of groups whose rewards vary (group_rows(nonzero_variance_groups(...)));
    # mask: [B, T]; sample_mask: [B]
    bearing = loss_mask(mask, sample_mask).sum(-1) > 0  # [B]
    return bool((bearing & signal.to(torch.bool)).any())


# How per-micro-batch metrics combine into a minibatch / step value: "max" or a weighted "mean".
METRIC_REDUCTIONS: dict[str, str] = {"ratio_max": "max"}


def combine_metrics(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Combine (metrics, weight) of micro-batches: weighted mean (weights are shares of the global
    denominator, summing to 1 over all ranks), except METRIC_REDUCTIONS' max keys, which stay maxima."""
    out: dict[str, float] = {}
    for metrics, weight in parts:
        for k, v in metrics.items():
            if METRIC_REDUCTIONS.get(k) == "max":
                out[k] = max(out.get(k, float("-inf")), v)
            else:
                out[k] = out.get(k, 0.0) + v * weight
    return out


# --------------------------------------------------------------------------- top-level loss


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    sample_mask: Tensor | None = None,
    dual_clip_c: float | None = None,
    ratio_level: str = "token",
    aggregation: str = "token_mean",
    is_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: float | None = None,
    norm_len: int | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """GRPO-family loss: per_token = is_weights * clipped_surrogate + kl_coef * kl, aggregated.

    The effective mask is mask * sample_mask[:, None]: every metric is over it too. Returns (loss scalar,
    per_token_loss [B, T] detached, metrics: pg_loss, kl, clip_fraction, ratio_mean, ratio_max (a max:
    combine micro-batches with ``combine_metrics``), and entropy when per-token ``entropy`` is given). The
    per-token metrics are averaged as the aggregation weighs tokens (``metric_mean``).
    """
    # logprobs, old_logprobs: [B, T]; advantages: [B]; mask: [B, T]; sample_mask: [B]
    # is_weights, ref_logprobs, entropy: [B, T]
    m = loss_mask(mask, sample_mask).to(logprobs.dtype)
    mb = m.to(torch.bool)
    zero = torch.zeros_like(logprobs)
    lp = torch.where(mb, logprobs, zero)  # keep garbage at padding out of every op and gradient

    ratio = importance_ratio(lp, old_logprobs, m, level=ratio_level)
    pg, clipped = clipped_surrogate(
        ratio, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c
    )
    if is_weights is not None:
        pg = pg * torch.where(mb, is_weights.detach(), torch.ones_like(pg))
    per_token = pg
    kl = zero
    if ref_logprobs is not None:
        ref = torch.where(mb, ref_logprobs, zero)
        kl = kl_estimate(lp, ref, estimator=kl_estimator, clamp=kl_clamp)
        per_token = per_token + kl_coef * kl

    loss = aggregate_loss(aggregation, per_token, m, norm_len=norm_len)
    with torch.no_grad():
        ratio_max = ratio[mb].max().item() if bool(mb.any()) else 0.0
        metrics = {
            "pg_loss": aggregate_loss(aggregation, pg, m, norm_len=norm_len).item(),
            "kl": metric_mean(aggregation, kl, m),
            "clip_fraction": metric_mean(aggregation, clipped.to(m.dtype), m),
            "ratio_mean": metric_mean(aggregation, ratio, m),
            "ratio_max": ratio_max,
        }
        if entropy is not None:
            metrics["entropy"] = metric_mean(aggregation, entropy.detach(), m)
    return loss, per_token.detach(), metrics


def metric_mean(aggregation: str, x: Tensor, mask: Tensor) -> float:
    """A per-token metric averaged the way the loss weighs tokens: over all tokens (token_mean), else per sequence
    and then over the non-empty sequences. Micro-batches and DP ranks weigh their metrics by their share of the
    loss's denominator (tokens, or sequences: loss.local_denominator, combine_metrics), so only this averaging
    combines to the whole minibatch's value whatever the split (a token mean weighed by sequences does not)."""
    # x: [B, T]; mask: [B, T] -> float
    return (masked_mean(x, mask) if aggregation == "token_mean" else seq_mean_token_mean(x, mask)).item()
