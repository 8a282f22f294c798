"""train.backend=torch: a transformers causal LM, data-parallel over torch.distributed (gloo / NCCL).

One instance per DP rank. Losses are normalised by GLOBAL denominators (tokens or sequences of the
whole minibatch, computed by the driver) and gradients are all-reduced with SUM, so an update over W
ranks equals the 1-rank update on the same batch (tests/test_grpo_loop.py checks this).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..algos import entropy_from_logits, masked_mean, policy_loss, token_logprobs
from ..spec.schema import RunSpec
from ..train.batch import TrainBatch, response_logits


class TorchPolicyWorker:
    def __init__(self, spec: RunSpec, model_dir: str, rank: int, world: int, threads: int = 1):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        torch.manual_seed(spec.grpo.seed + rank)
        self.spec, self.rank, self.world = spec, rank, world
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        # fp32 master weights; bf16 compute on GPUs when train.precision=bfloat16
        self.autocast = spec.train.precision.value == "bfloat16" and self.device.type == "cuda"
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if spec.loss.kl_coef > 0 else None
        t = spec.train
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warm = max(1, t.warmup_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm))

    # ------------------------------------------------------------------ distributed set-up
    def address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_distributed(self, host: str, port: int) -> None:
        if self.world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world)

    # ------------------------------------------------------------------ logprobs
    def _logits(self, model, b: TrainBatch) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits  # [B, L, V]
        return response_logits(logits, b.prompt_lens, b.response_ids.shape[1]) / self.spec.rollout.temperature

    @torch.no_grad()
    def logprobs(self, b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prev_logprobs [B, T], ref_logprobs [B, T] or None) for this rank's rows."""
        prev, ref = [], []
        b = b.to(self.device)
        for rows in _chunks(len(b), self.spec.train.logprob_batch_size):
            mb = b.select(rows)
            prev.append(token_logprobs(self._logits(self.model, mb), mb.response_ids))
            if self.ref is not None:
                ref.append(token_logprobs(self._logits(self.ref, mb), mb.response_ids))
        return torch.cat(prev).cpu(), (torch.cat(ref).cpu() if ref else None)

    # ------------------------------------------------------------------ update
    def update(self, minibatches: list[TrainBatch], denominators: list[float]) -> dict[str, float]:
        """One optimizer step per minibatch (this rank's shard); denominators are global per minibatch."""
        sums: dict[str, float] = {}
        for b, den in zip(minibatches, denominators):
            b = b.to(self.device)
            self.opt.zero_grad(set_to_none=True)
            for rows in _chunks(len(b), self.spec.train.micro_batch_size):
                for k, v in self._micro_step(b.select(rows), den).items():
                    sums[k] = sums.get(k, 0.0) + v
            grad_norm = self._sync_and_clip()
            self.opt.step()
            self.sched.step()
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm
        sums = {k: v / len(minibatches) for k, v in sums.items()}
        sums["lr"] = self.sched.get_last_lr()[0]
        return sums

    def _micro_step(self, mb: TrainBatch, den: float) -> dict[str, float]:
        lo = self.spec.loss
        logits = self._logits(self.model, mb)
        lp = token_logprobs(logits, mb.response_ids)
        mask = mb.response_mask
        loss, _, m = policy_loss(
            lp, mb.prev_logprobs, mb.advantages, mask, sample_mask=mb.sample_mask,
            clip_low=lo.clip_low, clip_high=lo.clip_high, dual_clip_c=lo.dual_clip_c,
            ratio_level=lo.ratio_level.value, aggregation=lo.aggregation.value,
            is_weights=mb.is_weights,
            ref_logprobs=mb.ref_logprobs, kl_coef=lo.kl_coef, kl_estimator=lo.kl_estimator.value,
            kl_clamp=lo.kl_clamp, norm_len=self.spec.rollout.max_new_tokens)
        share = local_denominator(lo.aggregation.value, mask * mb.sample_mask[:, None]) / den
        (loss * share).backward()
        with torch.no_grad():
            ent = masked_mean(entropy_from_logits(logits), mask)
        weight = float(share)  # metrics become global-batch weighted averages after the driver sums ranks
        return {"loss": float(loss.detach()) * weight, "entropy": float(ent) * weight,
                **{k: float(v) * weight for k, v in m.items()}}

    def _sync_and_clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.world > 1:
            for p in params:  # SUM: each rank's loss already carries its share of the global denominator
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        return float(torch.nn.utils.clip_grad_norm_(params, self.spec.train.max_grad_norm))

    # ------------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, directory: str) -> None:
        """Rank 0 writes HF weights + optimizer state into a checkpoint's (temporary) directory."""
        if self.rank != 0:
            return
        path = Path(directory)
        self.model.save_pretrained(path / "policy")
        torch.save({"opt": self.opt.state_dict(), "sched": self.sched.state_dict()}, path / "optim.pt")
        for f in (path / "policy").iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())

    def load(self, directory: str) -> None:
        from safetensors.torch import load_file

        path = Path(directory)
        self.model.load_state_dict(load_file(path / "policy" / "model.safetensors"), strict=True)
        state = torch.load(path / "optim.pt", weights_only=False)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])

    def ping(self) -> float:
        return time.time()


def local_denominator(aggregation: str, mask: torch.Tensor) -> float:
    """This shard's part of the aggregation's denominator: tokens (token_mean) or non-empty sequences."""
    # mask: [B, T] effective loss mask
    if aggregation == "token_mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
