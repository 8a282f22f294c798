"""rollout=hf as a hybrid engine: the policy worker generates on its own device with its own weights.

Mixed into both policy backends. The driver then has one actor per device slot (no separate rollout
worker, no weight transfer between processes): `generate` runs the worker's HFEngine, `refit_engine`
copies the policy's weights into it in place (nothing at all when the engine shares the policy's model).
"""

from __future__ import annotations

import time

import torch

from ..rollout.hf import HFEngine
from ..spec.schema import RolloutBackend
from .profile import profiled
from ..batch import Generation


class HybridRollout:
    engine: HFEngine | None = None

    def init_engine(self, share_model=None) -> None:
        """Create the engine when rollout=hf on the policy's devices; `share_model`: the policy's own HF model."""
        from ..plan import rollout_devices

        if self.spec.rollout.backend != RolloutBackend.hf or rollout_devices(self.spec):
            return  # vLLM, or engines on devices of their own (cluster.rollout_devices): no copy here
        self.engine = HFEngine(self.spec, self.model_dir, self.device, model=share_model)

    @profiled("generate")
    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        return self.engine.generate(prompt_ids, n, seed)

    @profiled("refit")
    def refit_engine(self) -> float:
        """Policy weights → this worker's engine, on the device. Returns ms (0 when the model is shared)."""
        if self.engine.shared:
            return 0.0
        t0 = time.perf_counter()
        self.engine.load_weights(self.hf_weights())  # collective for a sharded megatron model: every rank calls it
        return (time.perf_counter() - t0) * 1e3

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on the worker's device (each backend implements it)."""
        raise NotImplementedError
