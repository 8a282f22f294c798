"""What differs between the vLLM releases rollout=vllm runs on, in one place (the rest of rollout/vllm.py is
the same on each). Tested: the CPU build 0.32 (tests/integration/test_vllm.py) and the CUDA build 0.25 (tests/gpu/test_gpu.py;
the machine: benchmarks/results/environments.md).

| | 0.25 (CUDA) | 0.32 (CPU) |
|---|---|---|
| OpenAI app | `entrypoints.openai.api_server` | `entrypoints.launchers.*` (the old module deprecated) |
| raw TokensPrompt to AsyncLLM.generate | taken as is | wants rendered inputs (`renderer.render_cmpl`) |
| weight transfer (`weight_transfer_config`) | nccl, ipc, sparse_nccl | also sharded_rdt, nccl_m2n |
| `LLM.start/finish_weight_update` | methods | worker RPCs only (`collective_rpc`) |
| FlashInfer absent | GPU runner imports it for its sampler: VLLM_USE_FLASHINFER_SAMPLER=0 | (CPU: not used) |

The refit on CUDA goes through vLLM's own RL weight-transfer API, backend "ipc": the policy worker packs its
weights (cast to the engine's dtype) into 1 GiB device buffers (a larger tensor: one of its size; `BufferRuns`)
and sends CUDA IPC handles of them; the engine's worker opens them on the same GPU and loads them with `model.load_weights`
(straight into its weights for DIRECT_REFIT families, inside vLLM's layerwise reload for the others). No byte of
the weights crosses the host. Worker RPC names used (both releases): start_weight_update, update_weights,
finish_weight_update.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

if TYPE_CHECKING:
    from ..spec.schema import RunSpec

IPC_BUFFER_BYTES = 1 << 30  # vLLM's default packed-buffer size: the weights cross in chunks of at most this


def has_ipc_weight_transfer() -> bool:
    """vLLM's weight-transfer API with the CUDA IPC backend as `send_weights_ipc` drives it (0.25: the static
    `trainer_send_weights`; 0.32 replaced it with an engine object, and a CUDA build of it refits by state dict)."""
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine  # vLLM ≥ 0.2x
    except ImportError:
        return False
    return hasattr(IPCWeightTransferEngine, "trainer_send_weights")


def ipc_engine_kwargs() -> dict[str, Any]:
    """Engine args that enable the IPC weight-transfer backend (CUDA engines only)."""
    from vllm.config.weight_transfer import WeightTransferConfig  # here: vLLM ≥ 0.2x (has_ipc_weight_transfer)

    return {"weight_transfer_config": WeightTransferConfig(backend="ipc")}


def environment_defaults() -> None:
    """Before vLLM reads its environment. 0.25's GPU model runner imports FlashInfer for its top-k/top-p sampler
    unless VLLM_USE_FLASHINFER_SAMPLER=0, and FlashInfer is optional (a 470 MB pin an offline node may lack): its
    absence would stop the engine at start-up. Without it, vLLM's PyTorch sampler (top-k/top-p stay off here)."""
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


# model_type -> tokens vLLM adds to config.json's sliding_window. 0.32's commandr.py (Cohere2) and cohere2_moe.py
# attend to sliding_window + 1 tokens ("the training convention"); transformers, the policy, to sliding_window
# (masking_utils: kv > q - window). Past the window the engine sampled from another model: the tiny cohere2_v's
# prompt logprobs 0.22 nats off from token 9 (window 8), equal (9.5e-7) with the override below.
VLLM_WINDOW_EXTRA = {"cohere2": 1, "cohere2_moe": 1}


def hf_overrides(model_dir: str) -> dict[str, Any]:
    """Engine kwargs that make vLLM's model attend as the policy's transformers model does (see VLLM_WINDOW_EXTRA)."""
    from transformers import AutoConfig  # here: vLLM's engine processes have it; the driver never calls this

    cfg = AutoConfig.from_pretrained(model_dir)
    extra, window = VLLM_WINDOW_EXTRA.get(cfg.model_type, 0), getattr(cfg, "sliding_window", None)
    return {"hf_overrides": {"sliding_window": window - extra}} if extra and window else {}


def engine_dtype(spec: RunSpec, cuda: bool) -> str:
    """The engine's dtype: on CUDA the run's compute precision (bf16 for train.precision=bfloat16, as the hybrid HF
    engine keeps it; vLLM's flash-attention kernels take no fp32), else model.dtype."""
    if cuda and spec.train.precision.value == "bfloat16":
        return "bfloat16"
    return spec.model.dtype.value


# ------------------------------------------------------------------ engine side (the rollout actor)
# model_type: families whose CUDA engine takes a refit straight into its weights (`load_packed_ipc`): dense and
# unquantized, each weight loader an in-place copy (q/k/v and gate/up into their fused slices), and nothing to redo
# after loading on CUDA (UnquantizedLinearMethod repacks on CPU only). vLLM's layerwise reload around the same
# load (start/finish_weight_update) turns every parameter into a meta tensor, runs each loader twice (on meta,
# then for real), copies each layer back into the captured storage and clones every received tensor first: five
# passes over the weights instead of one. Other families keep it (MoE, Mamba and quantized layers post-process).
DIRECT_REFIT = frozenset({"llama", "qwen2", "qwen3"})


def start_update(llm: Any) -> None:
    llm.collective_rpc("grpo_start_refit")


def apply_update(llm: Any, update_info: dict) -> None:
    llm.collective_rpc("grpo_load_ipc", kwargs={"update_info": update_info})


def finish_update(llm: Any) -> None:
    llm.collective_rpc("grpo_finish_refit")


async def astart_update(engine: Any) -> None:
    await engine.collective_rpc("grpo_start_refit")


async def aapply_update(engine: Any, update_info: dict) -> None:
    """The async engine's EngineCore is another process, reached over vLLM's msgpack channel, which takes no
    classes or dtypes. vLLM's own answer (`ipc_handles_pickled`) needs VLLM_ALLOW_INSECURE_SERIALIZATION, which
    lets pickles through that channel: instead the handles cross as plain values (`encode_ipc_handles`) and the
    worker extension rebuilds them against an allowlist (`decode_ipc_handles`)."""
    await engine.collective_rpc("grpo_load_ipc", kwargs={"update_info": encode_ipc_handles(update_info),
                                                         "encoded": True})


async def afinish_update(engine: Any) -> None:
    await engine.collective_rpc("grpo_finish_refit")


def packed_views(packed: "torch.Tensor", update_info: dict) -> list[tuple[str, "torch.Tensor"]]:
    """One packed buffer's (name, tensor) pairs as views of it: vLLM's own unpacking, without the clone its
    consumer adds (the direct load copies each view into the engine's weight before the buffer is let go)."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor  # here: as above

    sizes = update_info["tensor_sizes"]
    return unpack_tensor(packed[: sum(sizes)], update_info["names"], update_info["shapes"],
                         [getattr(torch, d) for d in update_info["dtype_names"]], sizes)


def load_packed_ipc(model: Any, update_info: dict, device_index: int) -> int:
    """One packed buffer of CUDA IPC handles straight into the engine's weights (a DIRECT_REFIT family): views of
    the sender's buffer, no copy of it, one `load_weights`; synchronized before returning, so the sender may free
    or refill the buffer. Returns the tensors loaded."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    args = list(update_info["ipc_handles"][uuid])
    args[6] = device_index  # reduce_tensor's device index: the sender's; the same GPU is this one's here
    views = packed_views(rebuild_cuda_tensor(*args), update_info)
    model.load_weights(views)
    torch.cuda.current_stream(device_index).synchronize()
    return len(views)


# CUDA IPC handles as plain values: torch's rebuild_cuda_tensor args hold the tensor and storage classes and the
# dtype besides ints, tuples and bytes. Each of those crosses as a tagged name; nothing else is accepted back.
_CLASS, _DTYPE = "__torch_class__", "__torch_dtype__"


def _ipc_classes() -> dict[str, type]:
    return {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "UntypedStorage": torch.UntypedStorage,
            "TypedStorage": torch.storage.TypedStorage}


def encode_ipc_handles(update_info: dict) -> dict:
    """update_info with its `ipc_handles` (a {gpu uuid: args} dict, or a list of them) made of plain values."""
    names = {cls: name for name, cls in _ipc_classes().items()}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.dtype):
            return {_DTYPE: str(x).removeprefix("torch.")}
        if isinstance(x, type):
            if x not in names:
                raise TypeError(f"CUDA IPC handle holds class {x!r}, not one of {sorted(names.values())}")
            return {_CLASS: names[x]}
        if isinstance(x, dict):
            return {k: enc(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):  # torch.Size too
            return [enc(v) for v in x]
        return x

    return {**update_info, "ipc_handles": enc(update_info["ipc_handles"])}


def decode_ipc_handles(update_info: dict) -> dict:
    """The inverse of `encode_ipc_handles`, in the engine's worker: args lists become tuples, tagged names the
    allowlisted classes and torch dtypes, bytes-likes bytes. Anything else tagged is refused."""
    classes = _ipc_classes()

    def arg(x: Any) -> Any:  # one rebuild_cuda_tensor argument
        if isinstance(x, dict) and _CLASS in x:
            return classes[x[_CLASS]]  # KeyError: not an allowed class
        if isinstance(x, dict) and _DTYPE in x:
            dtype = getattr(torch, str(x[_DTYPE]), None)
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"not a torch dtype: {x[_DTYPE]!r}")
            return dtype
        if isinstance(x, list):  # size, stride
            return tuple(arg(v) for v in x)
        if isinstance(x, (bytearray, memoryview)):
            return bytes(x)
        if isinstance(x, dict):
            raise TypeError(f"unexpected mapping in a CUDA IPC handle: {sorted(x)}")
        return x

    def dec(x: Any) -> Any:  # {gpu uuid: args}, or a list of them
        if isinstance(x, list):
            return [dec(v) for v in x]
        return {k: arg(a) for k, a in x.items()}

    return {**update_info, "ipc_handles": dec(update_info["ipc_handles"])}


# ------------------------------------------------------------------ trainer side (a policy worker)
class BufferRuns:
    """(name, tensor) pairs cut into runs that each fill one IPC buffer: consecutive tensors while their bytes fit
    `cap`; a tensor larger than `cap` alone, in a buffer of its own size (`next_buffer_bytes`). Lazy: a run draws
    its tensors as the producer packs them, so a sharded policy still gathers one tensor at a time.

    Why runs: vLLM 0.25's packed sender exports its buffer for IPC once and sends that export with every chunk;
    the engine rebuilds and releases it once per chunk, which takes torch's cross-process refcount below zero (an
    unsigned count, CudaIPCTypes.h: it wraps, and a count > 0 keeps the block in limbo), so the buffer is never
    freed on the policy's side (1 GiB more held after every refit: memory/policy_allocated_gib
    +1.00 GiB a step, nemotron_h_1b on an H100, benchmarks/results/nemotron_gpu.md). One run per send is one chunk
    per export: the count returns to zero and `ipc_collect` frees the buffer (0.32 fixed it on the engine side)."""

    def __init__(self, weights: Iterable[tuple[str, "torch.Tensor"]], cap: int):
        self.it, self.cap = iter(weights), cap
        self.head = next(self.it, None)  # the next run's first tensor: drawn, not yet packed

    def next_buffer_bytes(self) -> int | None:
        """The buffer the next run needs (None: no tensor left)."""
        return None if self.head is None else max(self.cap, _nbytes(self.head[1]))

    def run(self) -> Iterable[tuple[str, "torch.Tensor"]]:
        used = 0
        while self.head is not None:
            size = _nbytes(self.head[1])
            if used and used + size > self.cap:
                return  # the head stays: it opens the next run
            item, self.head = self.head, None
            yield item
            used += size
            self.head = next(self.it, None)


def _nbytes(t: "torch.Tensor") -> int:
    return t.numel() * t.element_size()


def send_weights_ipc(weights: Iterable[tuple[str, "torch.Tensor"]], send: Callable[[dict], None],
                     dtype: "torch.dtype | None" = None) -> None:
    """Every policy rank calls it (the handles are all-gathered when the ranks form a process group); rank 0
    calls `send(update_info_dict)` once per packed buffer. `dtype`: the engine's (the fp32 master weights are
    cast on the device as they are packed). One buffer per run (`BufferRuns`), freed after it is sent."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine  # here: as above

    it = ((k, v.detach().to(dtype) if dtype is not None else v.detach()) for k, v in weights)
    runs = BufferRuns(it, IPC_BUFFER_BYTES)
    while (size := runs.next_buffer_bytes()) is not None:
        IPCWeightTransferEngine.trainer_send_weights(
            runs.run(), {"send_mode": lambda info: send(asdict(info)), "packed": True,
                         "packed_buffer_size_bytes": size})
        torch.cuda.ipc_collect()  # the buffer just sent, released by the engine: back to this process's pool
    torch.cuda.synchronize()
