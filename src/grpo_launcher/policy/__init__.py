"""Policy backends, keyed by train.backend. Each is a plain class the driver wraps in a Ray actor, one per DP rank.

The contract (what the loop calls) is interfaces.PolicyWorker: address / init_distributed, logprobs(batch),
update(minibatches, global_denominators), state_dict / hf_weights (refit sources, HF names), save / load,
and, with rollout=hf, generate / refit_engine (policy/hybrid.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ..registry import load
from ..spec.schema import TrainBackend

if TYPE_CHECKING:
    from ..interfaces import PolicyWorker

POLICY_BACKENDS: dict[TrainBackend, str] = {
    TrainBackend.torch: "grpo_launcher.policy.torch_policy:TorchPolicyWorker",
    TrainBackend.megatron: "grpo_launcher.policy.megatron_policy:MegatronPolicyWorker",
}


def policy_class(name: TrainBackend) -> type[PolicyWorker]:
    return cast("type[PolicyWorker]", load(POLICY_BACKENDS, name))
