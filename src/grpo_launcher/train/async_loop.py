"""Async GRPO (grpo.async_grpo.enabled=true): the engines generate the next steps' batches while the trainer
updates on this one, with a bound on how old a trajectory may be when it is trained on.

Layout (plan.py, train/workers.py): non-colocated. The policy ranks hold the first devices, the engines
(`cluster.rollout_devices` of them: CPU worker slots or GPUs) the devices after them; rollout=hf runs as
HFRolloutWorker (rollout/hf.py), rollout=vllm as it is. The weights travel as a state dict (policy rank 0's).

Versions. The policy version v is the number of optimizer updates applied (= the last finished step): step k
trains from version k - 1. Every sample records the versions of the weights its engine generated it with,
(first, last): equal unless an in-flight update interrupted it (below); its age at step k is (k - 1) - first.
Both go to the train-data log (policy_version, policy_version_last, age; tracking/train_data_log.py).
With N = grpo.async_grpo.max_trajectory_age_steps, step j's batch is submitted right after version j - 1 - N
was pushed to the engines (the start: steps 1..N+1 on the initial weights), so no sample can be older than N;
`RolloutBuffer.ages` checks every sample anyway and raises StaleTrajectory rather than train on an older one.
Up to N + 1 batches are in flight at once.

Weight pushes (grpo.async_grpo.in_flight_weight_updates), after every update:
  false: `update_weights` is queued on each engine behind the generate calls already submitted (Ray runs an
         actor's calls in order): those finish on the weights they were submitted with;
  true:  `stage_weights` reaches each engine at once (its own concurrency group), and then
         - rollout=hf, and rollout=vllm's offline engine (rollout.async_engine=false): the engine applies the
           weights at the start of its next generate call, so calls already queued run on fresher weights; a
           call in flight finishes on the weights it started with (first = last for every sample);
         - rollout=vllm with rollout.async_engine=true: applied at once. Requests in flight are interrupted
           (vLLM's pause_generation(mode="keep"); their KV cache is dropped), the weights reloaded, and they
           resume on the new weights (KV recomputed): first < last for those samples. The behaviour logprobs
           stay exact per token (each was recorded when its token was sampled), which is what the IS correction
           weighs against (rollout/versions.py, rollout/vllm.py).

Off-policy math: the old logprobs are always recomputed by the trainer (plan.logprobs_from_update is False in
async), and with loss.importance_sampling_correction the loss weighs each token by pi_trainer / pi_rollout
against the behaviour (generation) logprobs, truncated by loss.is_truncation (tis / icepop) as in sync.

Checkpoints and stops: the buffer is never written to a checkpoint. A checkpoint holds the policy after step
k; batches generated ahead are dropped when the run stops, and a resume generates steps k+1.. again from the
checkpoint's weights (version k), so the step axis (MLflow, metrics.jsonl, the data log) stays exact.

Metrics (the same keys as the sync loop): buffer/depth (batches generated or in flight when a step takes its
own, that one included), buffer/sample_age_mean|max, train/policy_version, time/trainer_idle_s (the trainer
waiting for its batch; = time/rollout_s in async), time/generation_idle_s (the engines' mean idle time before
the calls of the step's batch).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import ray
import torch

from ..batch import Generation, TrainBatch
from ..envs.rewards import Scored
from ..plan import Plan
from ..rollout.versions import WEIGHTS_GROUP
from ..spec.schema import RunSpec
from ..tracking import metric_names as M
from .engines import EnginePool
from .loop_state import LoopState, StopRequest
from .sources import Rollout, Timer, make_batch, score_on_env, train_seed


class StaleTrajectory(RuntimeError):
    """A sample older than grpo.async_grpo.max_trajectory_age_steps reached the trainer (never trained on)."""


@dataclass
class InFlight:
    step: int  # the step that trains on this batch
    prompts: list  # the step's prompts (env.train_prompts(step, 0, P))
    calls: list  # ObjectRefs of the engines' generate_versioned calls, in prompt order
    submitted_version: int  # the newest version pushed when the batch was submitted


class RolloutBuffer:
    """Batches generated ahead of the trainer, by step, and the age bound every sample is checked against."""

    def __init__(self, max_age: int) -> None:
        if max_age < 1:
            raise ValueError(f"max_trajectory_age_steps must be ≥ 1, got {max_age}")
        self.max_age = max_age
        self.pending: dict[int, InFlight] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, entry: InFlight) -> None:
        if entry.step in self.pending:
            raise RuntimeError(f"step {entry.step}'s batch was submitted twice")
        self.pending[entry.step] = entry

    def take(self, step: int) -> InFlight:
        if step not in self.pending:
            raise RuntimeError(f"no batch was submitted for step {step} (in flight: {sorted(self.pending)})")
        return self.pending.pop(step)

    def ages(self, versions: list[int], trainer_version: int) -> list[int]:
        """Each sample's age at a step that trains from `trainer_version`; StaleTrajectory past the bound."""
        ages = [trainer_version - v for v in versions]
        bad = [a for a in ages if not 0 <= a <= self.max_age]
        if bad:
            raise StaleTrajectory(f"{len(bad)} of {len(ages)} samples are {max(bad)} policy versions old (or newer "
                                  f"than the trainer: {min(bad)}), past grpo.async_grpo.max_trajectory_age_steps="
                                  f"{self.max_age}; not trained on")
        return ages

    def drop(self) -> int:
        """Forget every batch not yet trained on (a stop: they are generated again on resume). Returns how many."""
        n = len(self.pending)
        self.pending.clear()
        return n


class AsyncSource:
    """The loop's rollout source in async GRPO (train/sources.py RolloutSource; the module doc says how)."""

    def __init__(self, spec: RunSpec, plan: Plan, env: Any, engines: EnginePool, stop: StopRequest) -> None:
        self.spec, self.plan, self.env, self.engines, self.stop = spec, plan, env, engines, stop
        self.w, self.tok = engines.w, engines.tok
        a = spec.grpo.async_grpo
        self.buffer = RolloutBuffer(a.max_trajectory_age_steps)
        self.in_flight = a.in_flight_weight_updates
        self.version = 0  # optimizer updates applied to the policy = the last finished step
        self.submitted = 0  # the last step whose batch was submitted
        self.pushes: list[tuple[Any, Any]] = []  # (update_weights call, its engine) queued, not yet seen to finish
        if not spec.loss.importance_sampling_correction:
            print(f"grpo-launcher: warning: async GRPO without loss.importance_sampling_correction: samples up to "
                  f"{a.max_trajectory_age_steps} version(s) old are trained as if on-policy (the old logprobs are the "
                  "trainer's own); on the toy task an age-2 run without it collapsed before recovering. Set "
                  "loss.importance_sampling_correction=true loss.is_truncation=tis loss.is_threshold=2",
                  file=sys.stderr, flush=True)

    @contextmanager
    def session(self, state: LoopState) -> Iterator[None]:
        self.version = self.submitted = state.step  # a resume starts from the checkpoint's version
        try:
            yield
            self.w.get("push", [r for r, _ in self.pushes], [e for _, e in self.pushes])  # the last push landed
        finally:
            dropped = self.buffer.drop()
            if dropped:
                print(f"grpo-launcher: dropped {dropped} batch(es) generated ahead (never checkpointed; a resume "
                      "generates them again from the checkpoint's weights)", flush=True)

    def fill(self) -> None:
        """Submit every batch the age bound allows now: steps up to version + N + 1 (and max_steps)."""
        g = self.spec.grpo
        last = min(self.version + self.buffer.max_age + 1, g.max_steps)
        while self.submitted < last:
            j = self.submitted + 1
            prompts = self.env.train_prompts(j, 0, self.plan.prompts_per_step)
            calls = self.engines.submit(prompts, self.plan.group_size, train_seed(g.seed, j, 0),
                                        method="generate_versioned")
            self.buffer.add(InFlight(j, prompts, calls, self.version))
            self.submitted = j

    def rollout(self, step: int, t: Timer) -> Rollout:
        depth = len(self.buffer)  # this step's batch and the ones generated ahead of it
        entry = self.buffer.take(step)
        with t("rollout"):  # the trainer waits for its batch (0 when it was generated meanwhile)
            parts = self.w.get("generate", entry.calls, self.w.rollout[:len(entry.calls)])
        gens = [x for p in parts for x in p["gens"]]
        versions = [(v[0], v[1]) for p in parts for v in p["versions"]]  # (first, last) per sample
        ages = self.buffer.ages([f for f, _ in versions], self.version)  # StaleTrajectory: never trained on
        if any(not f <= last <= self.version for f, last in versions):
            raise StaleTrajectory(f"a sample's last policy version is outside [first, {self.version}]: "
                                  "the engines' version bookkeeping is wrong; not trained on")
        with t("score"):
            rewards, scored = self.score(entry.prompts, gens, self.plan.group_size)
        pipeline = {M.BUFFER_DEPTH: float(depth), M.BUFFER_SAMPLE_AGE_MEAN: sum(ages) / len(ages),
                    M.BUFFER_SAMPLE_AGE_MAX: float(max(ages)), M.TRAIN_POLICY_VERSION: float(self.version),
                    M.TIME_GENERATION_IDLE_S: sum(p["idle_s"] for p in parts) / len(parts),
                    M.TIME_TRAINER_IDLE_S: t.seconds["rollout"]}
        return Rollout(entry.prompts, gens, rewards, scored, versions=versions, pipeline=pipeline,
                       gen_s=max(p["gen_s"] for p in parts))  # the engines run side by side

    def generate(self, prompts: list, n: int, seed: int) -> list[Generation]:
        """Validation: through the versioned calls too (so the engines' idle time stays right), on the newest
        weights pushed (queued behind the batches generated ahead)."""
        refs = self.engines.submit(prompts, n, seed, "generate_versioned")
        return [x for part in self.w.get("generate", refs, self.w.rollout[:len(refs)]) for x in part["gens"]]

    def score(self, prompts: list, gens: list, n: int) -> tuple[torch.Tensor, list[Scored | None]]:
        return score_on_env(self.engines, prompts, gens, n)

    def make_batch(self, gens: list, rewards: torch.Tensor) -> tuple[TrainBatch, dict[str, float]]:
        return make_batch(self.spec, self.plan.group_size, self.tok, gens, rewards)

    def train_data(self, state: LoopState, step: int, r: Rollout, batch: TrainBatch) -> None:
        state.train_data(step, r.prompts, r.gens, r.rewards, batch, self.tok, r.versions, scored=r.scored)

    def refit(self, version: int) -> float:
        """Push policy version `version` to every engine (see the module doc for the two ways), then submit
        the batches the age bound now allows. Returns ms the trainer spent."""
        t0 = time.perf_counter()
        self.version = version
        refs = [p.state_dict.remote() for p in self.w.policy]  # rank 0 returns the HF-named dict, the others {}
        if self.in_flight:  # staged at once beside any generate call; applied at the engine's next call
            staged = [r.stage_weights.options(concurrency_group=WEIGHTS_GROUP).remote(refs[0], self.version)
                      for r in self.w.rollout]
            self.w.clock.wait_all("state_dict", refs, self.w.policy)  # a stuck policy rank is named as such
            self.w.get("refit", staged + refs[1:], [*self.w.rollout, *self.w.policy[1:]])  # landed before the next
            # batch is submitted: the age bound needs it
        else:  # queued behind the generate calls already submitted; the next batches queue behind it
            self.pushes += [(r.update_weights.remote(refs[0], self.version), r) for r in self.w.rollout]
            self.w.clock.wait_all("state_dict", refs, self.w.policy)  # the policy produced its weights (not fetched)
            done, _ = ray.wait([r for r, _ in self.pushes], num_returns=len(self.pushes), timeout=0)
            ray.get(done)  # a failed refit surfaces here, at the next push (ready: no wait)
            landed = set(done)
            self.pushes = [(r, e) for r, e in self.pushes if r not in landed]
        ms = (time.perf_counter() - t0) * 1e3
        self.fill()
        return ms
