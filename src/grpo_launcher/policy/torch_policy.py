"""train.backend=torch: a transformers causal LM, data-parallel over torch.distributed (gloo / NCCL).

One instance per DP rank. With more than one rank the model is sharded with FSDP2 (policy/fsdp.py: weights,
gradients and AdamW state split over the ranks, bf16 compute for train.precision=bfloat16 on GPUs); one rank
keeps the plain module (nothing to shard). Losses are normalised by GLOBAL denominators (tokens or sequences
of the whole minibatch, computed by the driver) and gradients are reduce-scattered with SUM, so an update over
W ranks equals the 1-rank update on the same batch (tests/integration/test_grpo_loop.py, tests/integration/test_fsdp.py check this).
"""

from __future__ import annotations

import copy
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import ray
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import fsdp, fused, microbatch
from ..algos import (LossInputs, entropy_from_logits, linear_logprobs, local_denominator, spec_policy_loss,
                     token_logprobs)
from ..logit_heads import HeadChoice, LogitTransform, head_for
from ..models.nemotron_h import bind_mamba_kernels
from ..plan import engine_max_model_len
from ..rollout.hf import engine_dtype
from ..spec.schema import Precision, RunSpec
from ..batch import TrainBatch, response_logits
from .hybrid import HybridRollout
from .packing import SEGMENTS, pack, packed_slices, segment_mamba_mixers, unpack
from .profile import Profiling, profiled
from .update_log import RouterLoad, UpdateLog, finite_norm

__all__ = ["TorchPolicyWorker", "local_denominator"]  # local_denominator (algos/loss.py): old import path


class TorchPolicyWorker(HybridRollout, Profiling):
    def __init__(self, spec: RunSpec, model_dir: str, rank: int, world: int, threads: int = 1):
        self.startup_marks = [("imports", time.time())]  # (phase, its end): the driver's start-up line (train/startup.py)
        import transformers.models.auto.modeling_auto  # noqa: F401  (load_model's import, timed on its own)

        self.startup_marks.append(("transformers", time.time()))
        torch.set_num_threads(threads)
        torch.manual_seed(spec.grpo.seed + rank)
        self.spec, self.model_dir, self.rank, self.world = spec, str(model_dir), rank, world
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.startup_marks.append(("device", time.time()))  # CUDA's initialisation
        # FSDP2 over the DP ranks, applied once the process group exists; train.cpu_offload: also on one rank
        self.offload = spec.train.cpu_offload and self.device.type == "cuda"
        self.sharded = world > 1 or self.offload
        self.model = fsdp.load_model(self.model_dir, self.device, self.sharded, engine_max_model_len(spec))  # meta if sharded
        self.startup_marks.append(("load", time.time()))
        # nemotron_h: the Mamba-2 kernels this device runs (none on CPU; unfused without causal-conv1d)
        self.mamba_path = bind_mamba_kernels(self.model, on_cuda=self.device.type == "cuda")
        if self.mamba_path and rank == 0:
            print(f"grpo-launcher: Mamba-2 path: {self.mamba_path}", flush=True)
        if spec.train.moe.freeze_router and spec.model.num_experts:
            fsdp.freeze_routers(self.model)
        if fused.wanted(spec.train.fused_kernels, spec.model.family, self.device):
            fused.apply(self.model, spec.model.family)
        # packing: Mamba-2 mixers run per sequence (policy/packing.py); hooked before the reference is copied
        self.mamba_mixers = segment_mamba_mixers(self.model) if spec.train.sequence_packing else 0
        # train.dynamic_batching: token-budget micro-batches (policy/microbatch.py), each cut to its own longest row;
        # Mamba-2 layers count rows in whole chunks (their scan's unit). Off: fixed rows at the minibatch's length
        # (a Mamba model without a chunk size in its config keeps fixed rows)
        self.granule = microbatch.mamba_chunk(self.model)
        self.token_budget = spec.train.dynamic_batching and self.granule > 0
        self.cut = spec.train.dynamic_batching and not spec.train.sequence_packing  # packed rows are laid out at max_total_sequence_length
        self.width_multiple = microbatch.WIDTH_MULTIPLE if self.device.type == "cuda" else 1  # (microbatch.widened)
        self.router_load = RouterLoad(self.model)  # train/moe/*: MoE routers' load per layer (none: dense)
        self.head = chunked_head(self.model, spec, self.model_dir)  # the family's logit post-processing per chunk
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if spec.loss.kl_coef > 0 else None
        if spec.train.activation_checkpointing:  # the policy only: the reference has no backward
            fsdp.checkpoint_layers(self.model)
        # fp32 master weights; bf16 compute on GPUs when train.precision=bfloat16 (autocast, or FSDP2's policy)
        self.bf16 = spec.train.precision == Precision.bfloat16 and self.device.type == "cuda"
        self.autocast = self.bf16 and not self.sharded
        if not self.sharded:
            self._build_optimizer()
        self.startup_marks.append(("setup", time.time()))  # kernels, reference copy, optimizer
        # an fp32 CPU run generates with the policy model itself (a sharded model cannot: its forward is a
        # collective, and each rank generates its own prompts); a GPU run with a copy in its precision
        same = self.device.type == "cpu" and engine_dtype(spec, self.device) == torch.float32 and not self.sharded
        self.init_engine(share_model=self.model if same else None)
        self.startup_marks.append(("engine", time.time()))

    def _build_optimizer(self) -> None:
        t = self.spec.train
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                     fused=self.device.type == "cuda" and not self.sharded)
        warm = max(1, t.warmup_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm))

    # ------------------------------------------------------------------ distributed set-up
    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_distributed(self, host: str, port: int) -> None:
        if self.sharded:
            # offload: the grad-norm and refit collectives run on the CPU shards (gloo), the layers' on the GPU
            backend = ("cpu:gloo,cuda:nccl" if self.offload else "nccl") if torch.cuda.is_available() else "gloo"
            limit = os.environ.get("GRPO_COLLECTIVE_TIMEOUT_S")  # the driver's deadlines (train/workers.py)
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world, timeout=timedelta(seconds=float(limit)) if limit else None)
        if self.sharded:
            fsdp.shard(self.model, self.bf16, self.offload)
            if self.ref is not None:
                fsdp.shard(self.ref, self.bf16, self.offload)
            fsdp.materialize([m for m in (self.model, self.ref) if m is not None], self.model_dir, self.device,
                             engine_max_model_len(self.spec), self.offload)
            self._build_optimizer()  # over the sharded parameters (fully_shard replaces them)

    # ------------------------------------------------------------------ logprobs
    def _weight_casts_kept(self) -> torch.autocast:
        """One autocast region around a whole optimizer step (or logprob pass): autocast caches the bf16 cast of
        each weight until its outermost region exits, so the fp32 master weights are cast once per step, not once
        per micro-batch (the forwards' own regions nest inside). Off where autocast is (CPU, fp32, FSDP2)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def _token_stats(self, model: torch.nn.Module, b: TrainBatch, entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs [B, T], entropy [B, T] or None) of the response tokens at temperature. Unpacked: the output
        layer runs from the shortest prompt's end on; packed (train.sequence_packing): over the packed rows, where
        a response token is predicted. Chunked (LogprobHead) unless train.logprob_chunk_tokens=0."""
        if self.spec.train.sequence_packing:
            p = pack(b, max(self.spec.train.max_total_sequence_length, b.input_ids.shape[1]),
                     mamba=self.mamba_mixers > 0)
            extra = {SEGMENTS: p.segments} if self.mamba_mixers else {}
            out = self._forward(model, p.targets, input_ids=p.input_ids, position_ids=p.position_ids,
                                attention_mask=None, **extra)  # transformers: a block-diagonal mask from the position ids
            out = unpack(out, p)  # [B, T, 2] or [B, T, V]
        else:
            L = b.input_ids.shape[1]
            keep = L - int(b.prompt_lens.min()) + 1  # positions L-keep .. L-1 hold every response prediction
            targets = torch.cat([b.input_ids[:, L - keep + 1:], b.input_ids[:, -1:]], 1)  # p predicts token p + 1
            out = self._forward(model, targets, input_ids=b.input_ids, attention_mask=b.attention_mask,
                                logits_to_keep=keep)
            out = response_logits(out, b.prompt_lens - (L - keep), b.response_ids.shape[1])
        if isinstance(model.get_output_embeddings(), LogprobHead):
            return out[..., 0], (out[..., 1] if entropy else None)
        logits = out / self.spec.rollout.temperature
        return token_logprobs(logits, b.response_ids), (entropy_from_logits(logits) if entropy else None)

    def _forward(self, model: torch.nn.Module, targets: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The model's output: [B, K, 2] (logprob, entropy) through a LogprobHead given targets [B, K], else logits."""
        head = model.get_output_embeddings()
        chunked = isinstance(head, LogprobHead)
        if chunked:
            head.targets = targets
        try:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = model(**inputs, use_cache=False).logits  # no KV cache (and none to update twice under AC)
            if not chunked:
                return logits
            assert head.result is not None  # the model post-processed it as logits: the head's own result counts
            return head.result
        finally:
            if chunked:
                head.targets = head.result = None

    def _micro_batches(self, b: TrainBatch, rows: int) -> microbatch.Groups:
        """The row indices of each micro-batch: within a token budget of `rows` full-length rows
        (policy/microbatch.py), fixed counts of `rows` (self.token_budget off), or packed (train.sequence_packing):
        consecutive sequences filling `rows` rows. Sharded: as many on every rank (FSDP2's collectives)."""
        t = self.spec.train
        lengths, responses = microbatch.lengths_of(b)
        capacity = max(t.max_total_sequence_length, b.input_ids.shape[1])
        if t.sequence_packing:
            groups = [list(range(s.start, s.stop)) for s in packed_slices(lengths, capacity, rows)]
        elif self.token_budget:
            most = max(self.spec.rollout.max_new_tokens, b.response_ids.shape[1])
            groups = microbatch.plan(lengths, responses, rows, capacity, most, self.granule)
        else:
            groups = microbatch.fixed(len(b), rows)
        if self.sharded:
            count = torch.tensor(len(groups), device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            groups = microbatch.even_out(groups, int(count))
        return groups

    @torch.no_grad()
    @profiled("logprobs")
    def logprobs(self, b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prev_logprobs [B, T], ref_logprobs [B, T] or None) for this rank's rows, in their order."""
        prev, ref = [], []
        b = b.to(self.device)
        groups = self._micro_batches(b, self.spec.train.logprob_batch_size)
        with self._weight_casts_kept():
            for g in groups:
                mb = microbatch.take(b, g, self.cut, self.width_multiple)
                prev.append(self._token_stats(self.model, mb)[0])
                if self.ref is not None:
                    ref.append(self._token_stats(self.ref, mb)[0])
        n, T = len(b), b.response_ids.shape[1]
        return (microbatch.restore(prev, groups, n, T).cpu(),
                microbatch.restore(ref, groups, n, T).cpu() if ref else None)

    # ------------------------------------------------------------------ update
    @profiled("update")
    def update(self, minibatches: list[TrainBatch], denominators: list[float]) -> dict[str, Any]:
        """One optimizer step per minibatch (this rank's shard); denominators are global per minibatch
        (0: no loss-bearing sample anywhere, so no step). See UpdateLog for what comes back.

        A minibatch without prev_logprobs is exactly on-policy (one step per rollout batch, decided by the
        plan): the update's own forward gives them (detached), returned as "prev_logprobs" (and
        "ref_logprobs" when loss.kl_coef > 0) so that the separate logprob pass is skipped.
        """
        log = UpdateLog()
        on_policy = minibatches[0].prev_logprobs is None
        self.router_load.on = True  # the update's forwards only (not the logprob pass or generation)
        for b, den in zip(minibatches, denominators):
            b = b.to(self.device)
            if den <= 0:
                log.skipped += 1
                if on_policy:
                    prev, ref = self.logprobs(b)
                    log.prev.append(prev)
                    log.ref.extend([ref] if ref is not None else [])
                continue
            self.opt.zero_grad(set_to_none=True)
            with self._weight_casts_kept():
                self._backward(b, den, on_policy, log)
            log.grad_norms.append(finite_norm(self._sync_and_clip(), log.parts[-1][0].get("loss")))
            self.opt.step()
            self.sched.step()
        self.router_load.on = False
        return {**log.result(self.sched.get_last_lr()[0], on_policy), **self.router_load.metrics(self.world, self.device)}

    def _backward(self, b: TrainBatch, den: float, on_policy: bool, log: UpdateLog) -> None:
        """The minibatch's gradients, micro-batch by micro-batch; old (and reference) logprobs logged in row order."""
        groups = self._micro_batches(b, self.spec.train.micro_batch_size)
        prev, ref = [], []
        for g in groups:
            mb = microbatch.take(b, g, self.cut, self.width_multiple)
            if on_policy and self.ref is not None:
                with torch.no_grad():
                    mb = mb.with_(ref_logprobs=self._token_stats(self.ref, mb)[0])
                ref.append(mb.ref_logprobs.cpu())
            metrics, weight, lp = self._micro_step(mb, den)
            log.parts.append((metrics, weight))
            prev.append(lp)
        n, T = len(b), b.response_ids.shape[1]
        log.prev.append(microbatch.restore(prev, groups, n, T))
        log.ref.extend([microbatch.restore(ref, groups, n, T)] if ref else [])

    def _micro_step(self, mb: TrainBatch, den: float) -> tuple[dict[str, float], float, torch.Tensor]:
        """Backward of this micro-batch's share of the loss; (metrics, share of the global denominator, old lp)."""
        lo = self.spec.loss
        lp, ent = self._token_stats(self.model, mb, entropy=True)
        old = lp.detach() if mb.prev_logprobs is None else mb.prev_logprobs
        x = LossInputs.of(mb, old)
        loss, _, m = spec_policy_loss(lp, x, lo, norm_len=self.spec.rollout.max_new_tokens, entropy=ent)
        share = local_denominator(lo.aggregation, x.effective_mask) / den
        (loss * share).backward()
        return {"loss": float(loss.detach()), **m}, float(share), old.detach().cpu()

    def _sync_and_clip(self) -> float:
        """Clip to the global norm; a sharded model's gradients were reduce-scattered (SUM) by its backward."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.spec.train.max_grad_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    # ------------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copy of the full fp32 weights (refit source for a separate rollout worker, e.g. vLLM); sharded:
        a collective, every rank gets them (param by param, each moved to the CPU once gathered)."""
        if self.sharded:
            return fsdp.full_weights(self.model, device=torch.device("cpu"))
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Full weights on the device; sharded: gathered (a collective) and cast to the engine's dtype."""
        if self.sharded:
            return fsdp.full_weights(self.model, dtype=engine_dtype(self.spec, self.device), device=self.device)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def weight_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The refit's pairs; sharded: each weight gathered (in the engine's dtype) only when it is consumed."""
        if self.sharded:
            return fsdp.iter_full_weights(self.model, dtype=engine_dtype(self.spec, self.device), device=self.device)
        return super().weight_items()

    def save(self, directory: str) -> None:
        """HF weights + optimizer state (full, name-keyed: any DP size resumes them) into a checkpoint's
        (temporary) directory. Sharded: every rank joins the gather, rank 0 writes."""
        weights = fsdp.full_model_state(self.model) if self.sharded else None
        optim = fsdp.optimizer_state(self.model, self.opt)
        if self.rank != 0:
            return
        path = Path(directory)
        fsdp.save_hf(self.model, weights, path / "policy")
        torch.save({"opt": optim, "sched": self.sched.state_dict()}, path / "optim.pt")
        for f in (path / "policy").iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())

    def load(self, directory: str) -> None:
        """Every rank reads the full files and keeps its shard; without optim.pt, the weights only (fresh AdamW and
        warm-up). The weights are read by transformers: a family
        whose files use other names than its modules (nemotron_h: backbone.*, one tensor per expert) is mapped."""
        from transformers import AutoModelForCausalLM  # here: the driver imports this module, not transformers

        path = Path(directory)
        optim = path / "optim.pt"  # absent in a checkpoint older than the newest: a fresh optimizer (the driver says so)
        state = torch.load(optim, weights_only=True) if optim.is_file() else None  # tensors and plain values only
        weights = AutoModelForCausalLM.from_pretrained(path / "policy", dtype=torch.float32).state_dict()
        fsdp.load_state(self.model, self.opt, weights, state["opt"] if state is not None else None)
        if state is not None:
            self.sched.load_state_dict(state["sched"])
        self._spec_hyperparameters()

    def _spec_hyperparameters(self) -> None:
        """The loaded state carries the checkpoint's lr and weight decay: this spec's win (a relaunch may change
        train.lr, train.warmup_steps, train.weight_decay; the warm-up lambda is always this spec's)."""
        t, sched = self.spec.train, self.sched
        sched.base_lrs = [t.lr for _ in self.opt.param_groups]
        for g, fn in zip(self.opt.param_groups, sched.lr_lambdas):
            g.update(initial_lr=t.lr, weight_decay=t.weight_decay, lr=t.lr * fn(sched.last_epoch))
        sched._last_lr = [g["lr"] for g in self.opt.param_groups]

    def ping(self) -> float:
        return time.time()


class LogprobHead(torch.nn.Module):
    """A causal LM's output layer (same weight and bias, same state-dict names) that, while `targets` [B, K] is set,
    computes [B, K, 2] = (logprob of the target at temperature, entropy) per position from hidden states, chunk by
    chunk (algos.linear_logprobs), with the family's logit post-processing (`transform`, logit_heads.py) applied
    per chunk, 0 where the target is -1 (not computed). The result is kept in `result`: the model's forward goes
    on to apply that post-processing to whatever this returns, so the caller reads `result`, not the model's
    output. Without targets: the plain output layer (generation with the policy model itself)."""

    def __init__(self, linear: torch.nn.Module, temperature: float, chunk: int, transform: LogitTransform | None = None):
        super().__init__()
        self.weight = linear.weight
        self.bias = getattr(linear, "bias", None)  # a Parameter registers as "bias", as in nn.Linear
        self.temperature, self.chunk, self.transform = temperature, chunk, transform
        self.targets: torch.Tensor | None = None
        self.result: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, K, H] -> [B, K, V] logits, or [B, K, 2] (logprob, entropy) with targets [B, K]
        if self.targets is None:
            return torch.nn.functional.linear(hidden, self.weight, self.bias)
        t = self.targets.flatten()
        at = (t >= 0).nonzero().squeeze(1)  # positions whose next token is wanted (-1: none, e.g. a packed prompt)
        lp, ent = linear_logprobs(hidden.flatten(0, 1).index_select(0, at), self.weight, t[at], bias=self.bias,
                                  transform=self.transform, temperature=self.temperature, chunk=self.chunk)
        out = torch.zeros(t.shape[0], 2, dtype=lp.dtype, device=lp.device)
        self.result = out.index_copy(0, at, torch.stack([lp, ent], -1)).view(*hidden.shape[:2], 2)
        return self.result.detach().clone()  # what the model's forward post-processes (in place, for some)


def chunked_head(model: torch.nn.Module, spec: RunSpec, model_dir: str) -> HeadChoice:
    """Put a LogprobHead in place of the model's output layer where the plan's head choice is chunked
    (logit_heads.head_for: the same choice the plan prints); an output layer that is not a plain nn.Linear keeps
    whole logits. Returns the choice made."""
    choice = head_for(model_dir, spec.model.family, spec.train.logprob_chunk_tokens)
    head = model.get_output_embeddings()
    if choice.chunk and type(head) is not torch.nn.Linear:
        choice = HeadChoice(0, None, f"whole logits: the output layer is a {type(head).__name__}, not an nn.Linear")
        print(f"grpo-launcher: logprob head: {choice.why}", flush=True)
    if choice.chunk:
        model.set_output_embeddings(LogprobHead(head, spec.rollout.temperature, choice.chunk, choice.transform))
    return choice


if TYPE_CHECKING:  # mypy holds the class to the contract the driver calls (interfaces.py)
    from ..interfaces import PolicyWorker

    _contract: type[PolicyWorker] = TorchPolicyWorker
