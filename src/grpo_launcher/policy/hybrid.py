"""rollout=hf as a hybrid engine: the policy worker generates on its own device with its own weights.

Mixed into both policy backends. The driver then has one actor per device slot (no separate rollout
worker, no weight transfer between processes): `generate` runs the worker's HFEngine, `refit_engine`
copies the policy's weights into it in place (nothing at all when the engine shares the policy's model).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

import ray
import torch

from ..plan import engine_sleeps, rollout_devices
from ..rollout import vllm_compat
from ..rollout.hf import HFEngine, load_tokenizer
from ..spec.schema import RolloutBackend, RunSpec
from .profile import profiled
from ..batch import Generation

if TYPE_CHECKING:
    from ..rollout.checkpoint_names import CheckpointNames


class HybridRollout:
    spec: RunSpec  # set by the policy backend's __init__
    model_dir: str
    device: torch.device
    engine: HFEngine | None = None
    file_names: CheckpointNames | None = None  # vLLM reads weights by their checkpoint names (rollout/checkpoint_names.py)

    def init_engine(self, share_model=None) -> None:
        """Create the engine when rollout=hf on the policy's devices; `share_model`: the policy's own HF model."""
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
        self.engine.load_weights(self.weight_items())  # collective for a sharded model: every rank calls it
        return (time.perf_counter() - t0) * 1e3

    @profiled("refit")
    def send_weights_ipc(self, engines: list, version: int | None = None) -> dict[str, float]:
        """Separate vLLM engines on this node's GPUs (rollout=vllm on CUDA): every rank calls it; the weights, cast
        to the engine's dtype, cross as CUDA IPC handles of ≤ 1 GiB device buffers (vLLM's weight-transfer API,
        rollout/vllm_compat.py), never through the host. Rank 0 drives the engines. Returns the parts in ms (the
        time/refit_* metrics): this rank's waits on the engines (start, load, finish), its own cast + pack + export
        (pack), and the slowest engine's own start-to-finish (engine)."""
        ms: dict[str, float] = {"start": 0.0, "load": 0.0, "finish": 0.0, "engine": 0.0}
        if engine_sleeps(self.spec):  # sleeping engines wake into memory the update's cached blocks still hold,
            torch.cuda.ipc_collect()  # and into the last transfer buffer, once the engines have let it go
            torch.cuda.empty_cache()
        lead = getattr(self, "rank", 0) == 0

        def timed(part: str, call: Any) -> Any:
            t = time.perf_counter()
            out = call()
            ms[part] += (time.perf_counter() - t) * 1e3
            return out

        if lead:  # a sleeping engine wakes its weights here and its KV cache once they are loaded
            timed("start", lambda: ray.get([e.start_weight_update.remote() for e in engines]))
        if self.file_names is None:
            from ..rollout.checkpoint_names import CheckpointNames  # here: it imports transformers' auto classes,
            # and the driver imports this module (the actor's class) before it starts the policy workers
            self.file_names = CheckpointNames(self.model_dir, ipc=True)
        t0 = time.perf_counter()
        vllm_compat.send_weights_ipc(
            self.file_names(self.weight_items()),
            lambda info: timed("load", lambda: ray.get([e.update_weights_ipc.remote(info) for e in engines])),
            dtype=getattr(torch, vllm_compat.engine_dtype(self.spec, cuda=True)))
        ms["pack"] = (time.perf_counter() - t0) * 1e3 - ms["load"]
        if lead:
            ms["engine"] = max(timed("finish", lambda: ray.get([e.finish_weight_update.remote(version)
                                                                for e in engines])))
        return ms

    def load_tokenizer(self) -> Any:
        """The run's tokenizer as `AutoTokenizer` loads it. The driver takes its copy from here (through Ray):
        this process imported transformers' auto classes for its model already; in the driver that import alone
        would cost memory and seconds of CPU (benchmarks/results/consolidation.md), and unpickling the tokenizer
        imports only its own class."""
        if self.engine is not None:
            return self.engine.tokenizer
        return load_tokenizer(self.model_dir)  # no pad token: its EOS pads (rollout/hf.py)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on the worker's device (each backend implements it)."""
        raise NotImplementedError

    def weight_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The refit's (name, full tensor) pairs, in the same order on every rank; a backend whose weights are
        sharded yields each as it is gathered (policy/torch_policy.py), so no full copy of the model is made."""
        return iter(self.hf_weights().items())
