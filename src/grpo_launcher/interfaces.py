"""The worker contracts: what the driver calls on each Ray actor, as typing.Protocols.

The driver (train/) holds Ray handles, so it calls these methods as ``actor.method.remote(...)``; the
classes behind the handles are found by the registries (policy/, rollout/, envs/) and satisfy these
protocols structurally (nothing subclasses them). tests/unit/test_registries.py checks every registered class
against its protocol. The user-facing env interface (prompts and a scorer) is `envs.base.Env`.

    policy worker  (policy/torch_policy.py, policy/megatron_policy.py; one per device): PolicyWorker
    rollout worker (rollout.ROLLOUT_BACKENDS; colocated rollout=hf is the policy worker, policy/hybrid.py): RolloutWorker
    env worker     (train/workers.py EnvWorker; wraps an envs.base.Env): EnvWorker
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing the contracts loads neither torch nor the batch module
    from torch import Tensor

    from .batch import Generation, TrainBatch

StateDict = dict[str, "Tensor"]  # Hugging Face parameter names → tensors


@runtime_checkable
class Generator(Protocol):
    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        """n samples per prompt, group-contiguous: result[k*n:(k+1)*n] are prompt k's."""
        ...


@runtime_checkable
class RolloutWorker(Generator, Protocol):
    """A separate inference engine (rollout.backend=vllm), refit from the policy after every update."""

    def update_weights(self, state_dict: StateDict) -> float:
        """Load HF-named weights in place (and drop stale KV cache); returns the time it took in ms."""
        ...

    def http_url(self) -> Optional[str]:
        """Base URL of the engine's OpenAI-compatible API, or None when it is not exposed."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and its child processes before the actor is killed."""
        ...


@runtime_checkable
class PolicyWorker(Generator, Protocol):
    """One rank of the trained policy (train.backend=torch|megatron); with rollout=hf also its engine."""

    def address(self) -> tuple[str, int]:
        """(host, free port) of rank 0's process-group rendezvous."""
        ...

    def init_distributed(self, host: str, port: int) -> None: ...

    def logprobs(self, b: TrainBatch) -> tuple[Tensor, Optional[Tensor]]:
        """(prev_logprobs [B, T], ref_logprobs [B, T] or None) for this rank's rows."""
        ...

    def update(self, minibatches: list[TrainBatch], denominators: list[float]) -> dict[str, Any]:
        """One optimizer step per minibatch (this rank's shard), losses over the GLOBAL denominators
        (algos.local_denominator summed over ranks; 0 = no step); see policy/update_log.py for the result."""
        ...

    def state_dict(self) -> StateDict:
        """CPU, HF-named full weights: the refit source of a separate rollout worker (rank 0; others {})."""
        ...

    def hf_weights(self) -> StateDict:
        """HF-named full weights on the worker's device (the hybrid engine's refit)."""
        ...

    def refit_engine(self) -> float:
        """rollout=hf: policy weights → this worker's own engine; ms."""
        ...

    def load_tokenizer(self) -> Any:
        """The run's tokenizer (transformers' AutoTokenizer of the model dir): the driver's copy."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...

    def ping(self) -> float: ...


@runtime_checkable
class EnvWorker(Protocol):
    """Scores completions with the run's env (an envs.base.Env) in its own actor."""

    def score(self, prompts: list[Any], completions: list[str]) -> list[float]: ...
