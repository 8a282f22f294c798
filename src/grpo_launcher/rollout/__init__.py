"""Rollout backends, keyed by rollout.backend. Each is a plain class the driver wraps in a Ray actor.

rollout=hf has no class here: it is a hybrid engine inside the policy workers (policy/hybrid.py, rollout/hf.py).

Interface (what the loop calls):
    generate(prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]   # n per prompt, grouped
    update_weights(state_dict) -> float                                            # refit; returns ms
    shutdown() -> None
"""

from __future__ import annotations

from ..registry import load

ROLLOUT_BACKENDS = {
    "vllm": "grpo_launcher.rollout.vllm:VLLMRolloutWorker",
}


def rollout_class(name: str) -> type:
    return load(ROLLOUT_BACKENDS, name)
