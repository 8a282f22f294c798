"""Rollout backends, keyed by rollout.backend. Each is a plain class the driver wraps in a Ray actor.

rollout=hf colocated (cluster.rollout_devices=0) has no actor: it is a hybrid engine inside the policy workers
(policy/hybrid.py, rollout/hf.py); with devices of its own it is HFRolloutWorker.

Constructed as cls(spec, model_dir, threads, max_model_len=plan.max_model_len) (train/workers.py).
Interface (what the loop calls; interfaces.RolloutWorker):
    generate(prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]   # n per prompt, grouped
    update_weights(state_dict, version=None) -> float                              # refit; returns ms
    shutdown() -> None
and for async GRPO (rollout/versions.py): stage_weights(state_dict, version), generate_versioned(...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ..registry import load
from ..spec.schema import RolloutBackend

if TYPE_CHECKING:
    from ..interfaces import RolloutWorker

ROLLOUT_BACKENDS: dict[RolloutBackend, str] = {
    RolloutBackend.vllm: "grpo_launcher.rollout.vllm:VLLMRolloutWorker",
    RolloutBackend.hf: "grpo_launcher.rollout.hf:HFRolloutWorker",  # non-colocated only (colocated: the hybrid engine)
}


def rollout_class(name: RolloutBackend) -> type[RolloutWorker]:
    return cast("type[RolloutWorker]", load(ROLLOUT_BACKENDS, name))
