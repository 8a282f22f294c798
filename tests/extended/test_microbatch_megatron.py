"""Token-budget micro-batches on train.backend=megatron (CPU, gloo + the test shim): the logprob pass and the update
equal the fixed-row path's on a batch of very uneven lengths (policy/microbatch.py), in the batch's order."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from integration.test_megatron import _free_port, _megatron_spec
from unit.test_megatron import SHIM, _tiny_qwen2
from unit.test_microbatch import uneven_batch

pytestmark = pytest.mark.extended  # make test: the megatron worker in test_megatron.py; the token budget on the torch
# backend in tests/unit/test_microbatch.py


def _both_paths_job(rank: int, world: int, spec, model_dir: str, batch, out: str, port: int) -> None:
    """One worker: logprobs and one update's metrics and gradients (no optimizer step), token budget then fixed rows."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.policy import microbatch
    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    w.opt.step = lambda: None  # the gradients stay as the backward left them
    assert w.token_budget and w.cut  # train.dynamic_batching=true; "rows" below is the default's path
    lengths, _ = microbatch.lengths_of(batch)
    res = {}
    for name, on in (("budget", True), ("rows", False)):
        w.token_budget = w.cut = on
        groups = w._micro_batches(batch, spec.train.micro_batch_size)
        prev, _ = w.logprobs(batch)
        noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
        b = batch.with_(prev_logprobs=prev + noise)
        m = w.update([b], [float(b.response_mask.sum())])
        grads = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
        res[name] = {"prev": prev, "metrics": m, "grads": grads, "micro": len(groups),
                     "tokens": microbatch.padded_tokens(groups, lengths, cut=on)}
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_token_budget_equals_the_fixed_rows(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    model_dir = _tiny_qwen2(tmp_path)
    spec = _megatron_spec(micro_batch_size=4, logprob_batch_size=4, global_batch_size=32,
                          max_total_sequence_length=64, dynamic_batching=True)
    spec = dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, max_new_tokens=48))
    batch, out = uneven_batch(32, 259), tmp_path / "out.pt"
    mp.start_processes(_both_paths_job, args=(1, spec, str(model_dir), batch, str(out), _free_port()), nprocs=1,
                       start_method="spawn", join=True)
    res = torch.load(out, weights_only=False)
    a, b = res["budget"], res["rows"]
    assert a["micro"] < b["micro"] and a["tokens"] < 0.5 * b["tokens"]
    mask = batch.response_mask.bool()
    assert (a["prev"] - b["prev"])[mask].abs().max() < 1e-5
    for k in ("loss", "pg_loss", "grad_norm"):
        assert a["metrics"][k] == pytest.approx(b["metrics"][k], rel=1e-5, abs=1e-6), k
    assert set(a["grads"]) == set(b["grads"]) and a["grads"]
    for k, g in b["grads"].items():
        assert torch.allclose(a["grads"][k], g, atol=1e-6, rtol=1e-4), k
