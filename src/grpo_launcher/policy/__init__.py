"""Policy backends, keyed by train.backend. Each is a plain class the driver wraps in a Ray actor, one per DP rank.

Interface (what the loop calls):
    address() -> (host, port); init_distributed(host, port)
    logprobs(batch) -> (prev_logprobs, ref_logprobs | None)
    update(minibatches, global_denominators) -> metrics
    state_dict() -> dict (refit source, HF names); save(dir) / load(dir)
"""

from __future__ import annotations

from ..registry import load

POLICY_BACKENDS = {
    "torch": "grpo_launcher.policy.torch_policy:TorchPolicyWorker",
    "megatron": "grpo_launcher.policy.megatron_policy:MegatronPolicyWorker",
}


def policy_class(name: str) -> type:
    return load(POLICY_BACKENDS, name)
