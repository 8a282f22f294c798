"""What a separate engine adds for async GRPO (train/async_loop.py): a policy version, staged weights, timings.

Mixed into the engines that run as their own Ray actors (rollout/hf.py HFRolloutWorker, rollout/vllm.py):

* `update_weights(state, version)` applies weights when the actor reaches the call: Ray runs an actor's calls
  in submission order, so generate calls the driver submitted earlier run on the old weights first;
* `stage_weights(state, version)` (grpo.async_grpo.in_flight_weight_updates=true; the driver sends it in the
  actor's "weights" concurrency group, so it does not wait behind queued generate calls). Two semantics:
  - here (HF, and vLLM's offline engine: a generate call holds the engine until it returns): the weights are
    only stored; the engine applies them at the start of its next generate call, calls already queued
    included. A call in flight finishes on the weights it started with;
  - rollout=vllm with rollout.async_engine=true (VLLMRolloutWorker overrides it): applied at once. The requests
    in flight are interrupted (vLLM's pause_generation(mode="keep"), their KV cache dropped), the weights
    reloaded, and the requests resume on the new weights (their KV recomputed): a sample's first tokens come
    from the old version, the rest from the new one;
* `generate_versioned` returns the generations with the versions every one of them was generated with
  (first, last: equal unless an in-flight update interrupted it), the engine's idle time before the call and
  the call's generation time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..batch import Generation

WEIGHTS_GROUP = "weights"  # the concurrency group stage_weights runs in (train/workers.py declares it)


class VersionedEngine:
    version: int = 0  # the policy version (optimizer updates applied) of the weights the engine holds

    def _versions_init(self) -> None:
        self.version = 0
        self._staged: tuple[dict, int] | None = None
        self._stage_lock = threading.Lock()
        self._idle_since: float | None = None  # end of the last generate call (None before the first)
        self._sample_versions: list[tuple[int, int]] | None = None  # set by an engine that tracks them per request

    # each engine implements these two
    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        raise NotImplementedError

    def update_weights(self, state_dict: dict, version: int | None = None) -> float:
        raise NotImplementedError

    def stage_weights(self, state_dict: dict, version: int) -> int:
        """Keep the newest weights for the next generate call (an older staged set is replaced). Returns version."""
        with self._stage_lock:
            self._staged = (state_dict, version)
        return version

    def _apply_staged(self) -> None:
        """At the start of every generate call: staged weights, if any, become the engine's."""
        with self._stage_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.update_weights(*staged)

    def generate_versioned(self, prompt_ids: list[list[int]], n: int, seed: int) -> dict[str, Any]:
        """{"gens", "versions" ((first, last) per generation), "version" (the oldest first), "idle_s" (since
        the last call), "gen_s"}."""
        t0 = time.perf_counter()
        idle = 0.0 if self._idle_since is None else t0 - self._idle_since
        self._sample_versions = None
        gens = self.generate(prompt_ids, n, seed)  # applies staged weights first
        versions = self._sample_versions or [(self.version, self.version)] * len(gens)  # nothing changed them
        self._idle_since = time.perf_counter()
        return {"gens": gens, "versions": versions, "version": min((f for f, _ in versions), default=self.version),
                "idle_s": idle, "gen_s": self._idle_since - t0}
