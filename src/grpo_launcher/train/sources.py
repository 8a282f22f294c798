"""Where a step's samples come from: a rollout source, passed into the one loop (train/driver.py Trainer).

    SyncSource   the default: the step's prompts generated and scored now, on the weights of step - 1
    AsyncSource  grpo.async_grpo.enabled (train/async_loop.py): batches generated ahead, within an age bound
    GymSource    env=nemo_gym, named by its env class (gym/env.py; train/gym_loop.py): rollouts through Gym's agents

Every source has RolloutSource's methods; the loop calls nothing else of it. The engines behind a source are an
EnginePool (train/engines.py): health, restarts and the refit strategy are the pool's, not the source's.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Protocol

import torch

from .. import algos
from ..batch import Generation, TrainBatch, collate
from ..envs.rewards import Scored
from ..plan import Plan
from ..policy.update_log import Diverged
from ..spec.schema import RunSpec
from ..tracking import metric_names as M
from .engines import EnginePool
from .loop_state import LoopState, StopRequest


@dataclass
class Rollout:
    """One step's samples, scored, and what the source knows of how they were made."""

    prompts: list  # [P] the step's prompts
    gens: list[Generation]  # [P*G] group-contiguous
    rewards: torch.Tensor  # [P*G]
    scored: list[Scored | None]  # [P*G] per-function rewards (None: scored elsewhere, e.g. Gym)
    rounds: int = 1  # generation rounds (dynamic sampling refills)
    versions: list[tuple[int, int]] = field(default_factory=list)  # [P*G] (first, last) policy version per sample
    pipeline: dict[str, float] = field(default_factory=dict)  # buffer depth, sample ages, policy version, idle times
    gen_s: float = 0.0  # seconds the engines spent generating this batch
    # dynamic sampling (DAPO): every sample generated this step, kept or not ([rounds*P*G]); None: the batch's own.
    # The reward metrics describe what the policy generated, not the groups kept for training
    generated: tuple[torch.Tensor, list[Scored | None]] | None = None


class RolloutSource(Protocol):
    def session(self, state: LoopState) -> ContextManager[Any]:
        """Around the whole loop (Gym's servers; async's buffer, dropped at the end)."""
        ...

    def rollout(self, step: int, t: Timer) -> Rollout: ...

    def generate(self, prompts: list, n: int, seed: int) -> list[Generation]:
        """n samples per prompt on the newest weights (validation, `launch.py generate`)."""
        ...

    def score(self, prompts: list, gens: list, n: int) -> tuple[torch.Tensor, list[Scored | None]]: ...

    def make_batch(self, gens: list, rewards: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]: ...

    def refit(self, version: int) -> float:
        """Policy version `version` (the optimizer updates applied) → the engines; ms the trainer spent."""
        ...

    def train_data(self, state: LoopState, step: int, r: Rollout, batch: TrainBatch) -> None: ...


class SyncSource:
    def __init__(self, spec: RunSpec, plan: Plan, env: Any, engines: EnginePool, stop: StopRequest) -> None:
        self.spec, self.plan, self.env, self.engines, self.stop = spec, plan, env, engines, stop
        self.tok = engines.tok

    def session(self, state: LoopState) -> ContextManager[Any]:
        return nullcontext()

    def rollout(self, step: int, t: Timer) -> Rollout:
        return sync_rollout(self, step, t)

    def generate(self, prompts: list, n: int, seed: int) -> list[Generation]:
        return self.engines.generate(prompts, n, seed)

    def score(self, prompts: list, gens: list, n: int) -> tuple[torch.Tensor, list[Scored | None]]:
        return score_on_env(self.engines, prompts, gens, n)

    def make_batch(self, gens: list, rewards: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        return make_batch(self.spec, self.plan.group_size, self.tok, gens, rewards)

    def refit(self, version: int) -> float:  # noqa: ARG002 (sync: the engines hold one version at a time)
        return self.engines.refit()

    def train_data(self, state: LoopState, step: int, r: Rollout, batch: TrainBatch) -> None:
        state.train_data(step, r.prompts, r.gens, r.rewards, batch, self.tok, r.versions, scored=r.scored)


def sync_rollout(src: Any, step: int, t: Timer) -> Rollout:
    """Generated now on the weights of step - 1: nothing ahead (buffer depth 0, age 0); the trainer waits through
    the rollout. (AsyncSource reports its buffer's figures under the same keys.)"""
    r = sample_groups(src, step, t)
    r.versions = on_previous_weights(step, len(r.gens))
    r.gen_s = t.seconds["rollout"]
    r.pipeline = {M.BUFFER_DEPTH: 0.0, M.BUFFER_SAMPLE_AGE_MEAN: 0.0, M.BUFFER_SAMPLE_AGE_MAX: 0.0,
                  M.TRAIN_POLICY_VERSION: float(step - 1), M.TIME_TRAINER_IDLE_S: t.seconds["rollout"]}
    return r


def on_previous_weights(step: int, n: int) -> list[tuple[int, int]]:
    """The policy versions a sync step's samples were generated with, (first, last): the weights of step - 1."""
    return [(step - 1, step - 1)] * n


def sample_groups(src: Any, step: int, t: Timer) -> Rollout:
    """Generate and score; with dynamic sampling (DAPO), keep only groups whose rewards vary, refilling up to
    loss.dynamic_sampling_max_rounds rounds; short of them after the cap, pad with zero-advantage groups."""
    s, P, G = src.spec, src.plan.prompts_per_step, src.plan.group_size
    rounds = s.loss.dynamic_sampling_max_rounds if s.loss.dynamic_sampling else 1
    kept: list[tuple] = []  # (prompt, gens of the group, rewards of the group, scored of the group)
    spare: list[tuple] = []
    every: list[tuple[torch.Tensor, list]] = []  # each round's (rewards, scored)
    for r in range(rounds):
        prompts = src.env.train_prompts(step, r, P)
        with t("rollout"):
            gens = src.generate(prompts, G, seed=train_seed(s.grpo.seed, step, r))
        with t("score"):
            rewards, scored = src.score(prompts, gens, G)
        every.append((rewards, list(scored)))
        varies = algos.nonzero_variance_groups(rewards, G) if s.loss.dynamic_sampling else torch.ones(P, dtype=torch.bool)
        for k, p in enumerate(prompts):
            group = (p, gens[k * G:(k + 1) * G], rewards[k * G:(k + 1) * G], scored[k * G:(k + 1) * G])
            (kept if varies[k] else spare).append(group)
        if len(kept) >= P:
            break
    groups = (kept + spare)[:P]
    generated = (torch.cat([e[0] for e in every]), [x for e in every for x in e[1]]) if s.loss.dynamic_sampling \
        else None
    return Rollout([g[0] for g in groups], [x for g in groups for x in g[1]], torch.cat([g[2] for g in groups]),
                   [x for g in groups for x in g[3]], rounds=r + 1, generated=generated)


def train_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of a step's generation round (the same in sync and async)."""
    return (seed * 1_000_003 + step * 101 + round_) % 2**31


def score_on_env(engines: EnginePool, prompts: list, gens: list, n: int) -> tuple[torch.Tensor, list[Scored | None]]:
    """The env worker's rewards for the decoded completions (n per prompt), and each one's Scored."""
    w = engines.w
    texts = [engines.tok.decode(g.response_ids, skip_special_tokens=True) for g in gens]
    expanded = [p for p in prompts for _ in range(n)]
    scored = w.get("score", [w.env.score.remote(expanded, texts)], [w.env])[0]
    return torch.tensor([s.total for s in scored], dtype=torch.float32), list(scored)


def make_batch(spec: RunSpec, group_size: int, tok: Any, gens: list[Generation], rewards: torch.Tensor,
               valid: torch.Tensor | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages over all samples (`valid`: over those alone, in each group), the overlong mask, the padded batch;
    the reward and length metrics."""
    adv = algos.compute_advantages(spec.loss.advantage, rewards, group_size, valid=valid)  # [B]
    truncated = torch.tensor([g.truncated for g in gens])
    sample_mask = algos.overlong_sample_mask(truncated) if spec.loss.overlong_filtering else torch.ones(len(gens))
    if spec.loss.dynamic_sampling:  # DAPO: only groups whose rewards vary train (the round cap's padding groups
        # neither add loss nor dilute token_mean's denominator)
        sample_mask = sample_mask * algos.group_rows(algos.nonzero_variance_groups(rewards, group_size), group_size)
    batch = collate(gens, adv, sample_mask, tok.pad_token_id)
    lens = batch.response_mask.sum(-1)
    lp = batch.generation_logprobs[batch.response_mask.bool()]  # [tokens]; -inf is a token the sampler masked
    if bool((lp.isnan() | (lp == float("inf"))).any()):
        raise Diverged(f"the rollout's logprobs are NaN in {int(lp.isnan().sum())} of {lp.numel()} tokens: the "
                       "policy's weights no longer give a distribution (broken by the last update: train.lr too high, "
                       "or rewards / advantages out of range; see train/grad_norm and train/loss of the last steps)")
    m = {**reward_summary(rewards), M.TRAIN_ADV_MEAN: float(adv.mean()),
         M.TRAIN_ADV_STD: float(adv.std()), M.TRAIN_ADV_ABS_MAX: float(adv.abs().max()),
         M.TRAIN_GEN_LEN_MEAN: float(lens.mean()), M.TRAIN_TRUNCATION_RATE: float(truncated.float().mean())}
    return batch, m


def reward_summary(rewards: torch.Tensor) -> dict[str, float]:
    """train/reward_mean, _std and accuracy (the share of samples whose reward is ≥ 1) of rewards [N]."""
    return {M.TRAIN_REWARD_MEAN: float(rewards.mean()), M.TRAIN_REWARD_STD: float(rewards.std()),
            M.TRAIN_ACCURACY: float((rewards >= 1).float().mean())}


class Timer:
    """Accumulates wall time per named phase: `with t("rollout"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"rollout": 0.0}
        self._t0 = time.perf_counter()

    def __call__(self, name: str) -> ContextManager[None]:
        timer = self

        class _Phase:
            def __enter__(self) -> None:
                self.t = time.perf_counter()

            def __exit__(self, *exc: object) -> None:
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t

        return _Phase()

    def as_metrics(self) -> dict[str, float]:
        out = {f"{M.TIME_PREFIX}{k}_s": v for k, v in self.seconds.items()}
        out[M.TIME_STEP_S] = time.perf_counter() - self._t0
        return out
