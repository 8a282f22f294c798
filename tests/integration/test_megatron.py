"""train.backend=megatron: HF ↔ Megatron mapping, pre-flight rules, and the worker on CPU (gloo + the test shim).

Fast tests need no megatron-core; the @slow ones import it (extra `megatron`) and start processes:
TP=2 vs TP=1 vs the torch backend on one batch, EP=2 vs EP=1 on a tiny Qwen3-MoE, HF logits parity,
and a 5-step GRPO run through launch.py. nemotron_h (megatron-core's hybrid model) runs where mamba-ssm imports (the
GPU kit's build; the shim binds its torch references on CPU): HF logits parity at EP=1 and EP=2, and one step equal
to the torch backend's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, share_models
from unit.test_megatron import SHIM, _hf_state, _nemotron_h_dir, _tiny_hf, _tiny_qwen2, needs_mamba_ssm


# ------------------------------------------------------------------------------ worker on CPU (slow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(B: int, vocab: int, seed: int = 0, pad_input: bool = False):
    """`pad_input`: the pad token (0) as an input in a prompt and mid-response (a tokenizer's pad in a chat template,
    a multi-turn sequence): the HF model's embedding never trains its row through the lookup."""
    from grpo_launcher.batch import Generation, collate

    g = torch.Generator().manual_seed(seed)
    gens = []
    for i in range(B):
        p = torch.randint(3, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        if pad_input and i < 2:
            (p if i == 0 else r)[1 - i] = 0
        gens.append(Generation(p, r, [-1.0] * len(r), truncated=False))
    adv = torch.randn(B, generator=g)
    return collate(gens, adv, torch.ones(B), pad_id=0)


def _worker_job(rank: int, world: int, spec, model_dir: str, batch, out: str, port: int) -> None:
    """What the driver does for one step, on one rank: logprobs → update → refit weights."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker
    from grpo_launcher.algos import local_denominator
    from grpo_launcher.batch import shard_rows

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    prev, _ = w.logprobs(batch.select(shard_rows(len(batch), world, rank)))
    parts = [None] * world
    dist.all_gather_object(parts, prev)
    prev = torch.cat(parts)
    noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    b = batch.with_(prev_logprobs=prev + noise)  # ratios ≠ 1: clipping is exercised
    den = max(local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None]), 1.0)
    m = w.update([b.select(shard_rows(len(b), world, rank))], [den])
    metrics = [None] * world
    dist.all_gather_object(metrics, m)
    ids = batch.input_ids[:2]
    sd = w.state_dict()
    if rank == 0:
        summed = {k: sum(x[k] for x in metrics) for k in m if k not in ("grad_norm", "lr")}
        summed.update(grad_norm=m["grad_norm"], lr=m["lr"])
        torch.save({"prev": prev, "metrics": summed, "sd": sd, "ids": ids}, out)
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, spec, model_dir: Path, batch, out: Path) -> dict:
    import torch.multiprocessing as mp

    mp.start_processes(_worker_job, args=(world, spec, str(model_dir), batch, str(out), _free_port()),
                       nprocs=world, start_method="spawn", join=True)
    return torch.load(out, weights_only=False)


def _megatron_spec(**train):
    from grpo_launcher.spec.schema import LossSpec, RunSpec, TrainBackend, TrainSpec

    t = dict(backend=TrainBackend.megatron, lr=1e-3, micro_batch_size=4, logprob_batch_size=4,
             global_batch_size=8, max_grad_norm=0.05)
    t.update(train)
    return RunSpec(train=dataclasses.replace(TrainSpec(), **t), loss=LossSpec())


@pytest.mark.slow
def test_tp2_equals_tp1_equals_torch_backend(tmp_path):
    """One driver step (logprobs, GRPO update with clipping) on the tiny Qwen2: TP=2 ≡ TP=1 ≡ torch backend, with
    the pad token among the inputs (megatron trained its zero embedding row: grad norm 2011 vs 1.40 on a Qwen3)."""
    pytest.importorskip("megatron.core")
    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    model_dir = _tiny_qwen2(tmp_path)
    batch = _batch(8, 259, pad_input=True)
    tp1 = _run(1, _megatron_spec(), model_dir, batch, tmp_path / "tp1.pt")
    tp2 = _run(2, _megatron_spec(tensor_parallel_size=2), model_dir, batch, tmp_path / "tp2.pt")

    spec = dataclasses.replace(_megatron_spec(), train=dataclasses.replace(_megatron_spec().train, backend="torch"))
    tw = TorchPolicyWorker(spec, str(model_dir), 0, 1)
    prev, _ = tw.logprobs(batch)
    noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    b = batch.with_(prev_logprobs=prev + noise)
    den = local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None])
    tm = tw.update([b], [den])
    tsd = tw.state_dict()

    mask = batch.response_mask.bool()
    for other in (tp2, {"prev": prev, "metrics": tm, "sd": tsd}):
        assert torch.allclose(tp1["prev"][mask], other["prev"][mask], atol=1e-5, rtol=0)
        for k in ("loss", "pg_loss", "clip_fraction", "entropy", "grad_norm"):
            assert tp1["metrics"][k] == pytest.approx(other["metrics"][k], rel=1e-4, abs=1e-6), k
        assert set(tp1["sd"]) == set(other["sd"])
        for k, v in tp1["sd"].items():
            assert torch.allclose(v, other["sd"][k], atol=2e-5, rtol=0), k
    assert tp1["metrics"]["clip_fraction"] > 0  # the check above covered clipped tokens too
    # the update moved the weights (refit carries the new policy)
    hf, _ = _hf_state(model_dir)
    assert max((tp1["sd"][k] - hf[k]).abs().max().item() for k in hf) > 1e-4
    # refit: the rollout worker's strict load accepts the HF-named state dict
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).load_state_dict(tp2["sd"], strict=True)


def _logits_job(rank: int, world: int, spec, model_dir: str, ids, out: str, port: int) -> None:
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        logits = w.model(ids, pos, None)
    sd = w.state_dict()
    if rank == 0:
        torch.save({"logits": logits, "sd": sd}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind,world,train", [
    ("llama", 2, {"tensor_parallel_size": 2}),
    pytest.param("qwen3-tied", 1, {}, marks=pytest.mark.extended),
    pytest.param("qwen3_moe", 1, {"moe": {"token_dispatcher": "allgather", "router_dtype": "float32",
                                          "freeze_router": True}}, marks=pytest.mark.extended),
    pytest.param("qwen3_moe", 2, {"expert_parallel_size": 2, "moe": {"token_dispatcher": "allgather"}},
                 marks=pytest.mark.extended),
])
def test_megatron_logits_match_hf_and_export_is_exact(tmp_path, kind, world, train):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from grpo_launcher.spec.schema import MoESpec, Precision

    path = _tiny_hf(kind.removesuffix("-tied"), tmp_path, tie=kind.endswith("-tied"))
    if "moe" in train:
        moe = dict(train.pop("moe"))
        if "router_dtype" in moe:
            moe["router_dtype"] = Precision(moe["router_dtype"])
        train["moe"] = MoESpec(**moe)
    spec = _megatron_spec(**train)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "out.pt"
    mp.start_processes(_logits_job, args=(world, spec, str(path), ids, str(out), _free_port()), nprocs=world,
                       start_method="spawn", join=True)
    res = torch.load(out, weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    local_v = res["logits"].shape[-1]
    assert torch.allclose(res["logits"], ref[..., :local_v], atol=1e-4, rtol=0)  # rank 0's vocab shard
    sd = hf.state_dict()
    assert set(res["sd"]) == set(sd)
    for k, v in sd.items():
        assert torch.equal(res["sd"][k], v), k  # load → export without an update: bit-exact


@pytest.mark.slow
def test_grpo_run_with_megatron_backend(tmp_path):
    """`python launch.py train.backend=megatron grpo.max_steps=5` completes on CPU (shim via env)."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ, GRPO_MEGATRON_CPU_SHIM=SHIM)
    cmd = [sys.executable, "-u", str(ROOT / "launch.py"), "train.backend=megatron", "grpo.max_steps=5",
           "logging.mlflow=false", f"output_root={share_models(tmp_path)}", "logging.profile_step=3"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ckpts = list((tmp_path / "tiny-grpo" / "checkpoints").rglob("model.safetensors"))
    assert ckpts, proc.stdout[-2000:]
    # logging.profile_step=3: step 3's phases by kernel class, as printed and as written per rank
    assert "grpo-launcher: profile of step 3" in proc.stdout
    phases = json.loads((tmp_path / "tiny-grpo" / "profile" / "step_3" / "rank_0" / "rank_0.json").read_text())
    assert {"generate", "update"} <= set(phases) and phases["update"]["classes_ms"]["gemm"] > 0


def _grads_job(rank: int, world: int, spec, model_dir: str, batch, out: str, port: int) -> None:
    """One worker, two output-layer paths (train.logprob_chunk_tokens 0 = whole logits, then 3): each path's
    logprob pass and one micro-step's loss, metrics and gradients, from the same weights (no optimizer step)."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    from grpo_launcher.batch import shard_rows

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    den = local_denominator(spec.loss.aggregation.value, batch.response_mask * batch.sample_mask[:, None])
    rows = shard_rows(len(batch), world, rank)
    batch = batch.select(rows)  # TP=2: the replica gathers both ranks' rows
    res = {}
    for chunk in (0, 3):
        w.spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, logprob_chunk_tokens=chunk))
        prev, ref = w.logprobs(batch)
        noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1 + rank))
        b = batch.with_(prev_logprobs=prev + noise, ref_logprobs=ref)
        w._zero_grad()
        metrics, _, _ = w._micro_step(w._replica_batch(b)[0], den)  # TP ranks step on the same rows
        grads = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
        res[chunk] = {"prev": prev, "ref": ref, "step": metrics, "grads": grads}
    if rank == 0:  # TP=2: rank 0's rows and weight shards
        torch.save({**res, "rows": rows}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.extended  # CI's time: make test runs the megatron worker in the three tests above
@pytest.mark.parametrize("tie,tp", [(False, 1), (True, 1), (False, 2)], ids=["untied", "tied", "tp2"])
def test_chunked_output_layer_equals_whole_logits(tmp_path, tie, tp):
    """The output layer in chunks of 3 tokens (algos.linear_logprobs over GPTModel's final hidden states; TP=2:
    its vocab-parallel form) gives the whole-logits path's logprobs (policy and reference), loss, entropy, KL and
    gradients (TP=2: rank 0's rows and shards), at a sampling temperature of 0.7."""
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from grpo_launcher.spec.schema import LossSpec

    model_dir = _tiny_hf("qwen3", tmp_path, tie=tie)
    spec = _megatron_spec(tensor_parallel_size=tp)
    spec = dataclasses.replace(spec, loss=LossSpec(kl_coef=0.1),
                               rollout=dataclasses.replace(spec.rollout, temperature=0.7))
    batch, out = _batch(4, 256), tmp_path / "out.pt"
    mp.start_processes(_grads_job, args=(tp, spec, str(model_dir), batch, str(out), _free_port()), nprocs=tp,
                       start_method="spawn", join=True)
    res = torch.load(out, weights_only=False)
    whole, chunked = res[0], res[3]
    mask = batch.response_mask[res["rows"]].bool()
    for k in ("prev", "ref"):
        assert torch.allclose(chunked[k][mask], whole[k][mask], atol=1e-5, rtol=0), k
    for k in ("loss", "pg_loss", "entropy", "kl"):
        assert chunked["step"][k] == pytest.approx(whole["step"][k], rel=1e-5, abs=1e-7), k
    assert set(chunked["grads"]) == set(whole["grads"]) and whole["grads"]
    for k, g in whole["grads"].items():
        assert torch.allclose(chunked["grads"][k], g, atol=1e-6, rtol=1e-4), k


def _vocab_parallel_job(rank: int, world: int, out: str, port: int) -> None:
    import torch.distributed as dist

    from grpo_launcher.algos.linear_logprobs import vocab_parallel_linear_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 30, (11,), generator=g)
    h = hidden.clone().requires_grad_()
    w = weight.chunk(world)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_linear_logprobs(h, w, targets, group=None, vocab_start=rank * 30 // world,
                                             temperature=0.7, chunk=4)
    (lp * torch.arange(11.0, dtype=torch.float64)).sum().backward()  # a different weight per token
    parts = [torch.empty_like(w.grad) for _ in range(world)]
    dist.all_gather(parts, w.grad)
    if rank == 0:
        torch.save({"lp": lp.detach(), "ent": ent, "h_grad": h.grad, "w_grad": torch.cat(parts)}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.extended  # CI's time: 2 spawned gloo ranks
def test_vocab_parallel_linear_logprobs_equal_the_whole_vocabulary(tmp_path):
    """algos.vocab_parallel_linear_logprobs on 2 gloo ranks (each 15 of 30 vocabulary rows, chunks of 4 of 11
    tokens) = linear_logprobs over the whole weight in fp64: logprobs, entropy and both gradients."""
    import torch.multiprocessing as mp

    from grpo_launcher.algos import linear_logprobs

    out = tmp_path / "vp.pt"
    mp.start_processes(_vocab_parallel_job, args=(2, str(out), _free_port()), nprocs=2, start_method="spawn",
                       join=True)
    res = torch.load(out, weights_only=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 30, (11,), generator=g)
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=0.7, chunk=4)
    (lp * torch.arange(11.0, dtype=torch.float64)).sum().backward()
    for got, want in ((res["lp"], lp), (res["ent"], ent), (res["h_grad"], hidden.grad), (res["w_grad"], weight.grad)):
        assert torch.allclose(got, want.detach(), atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------ nemotron_h (hybrid)


@pytest.mark.slow
@pytest.mark.extended  # CI's time: make test trains nemotron_h on the torch backend (test_fsdp.py)
@needs_mamba_ssm
@pytest.mark.parametrize("world", [1, 2], ids=["ep1", "ep2"])
def test_megatron_nemotron_h_logits_match_hf_and_export_is_exact(tmp_path, world):
    """megatron-core's hybrid model (local spec; on CPU the mixer's kernels bound to mamba-ssm's torch references by
    the shim) gives HF NemotronH's logits (transformers' pure-torch path) on the same weights, EP=1 and EP=2; its
    HF-named export without an update is the loaded state dict, bit for bit."""
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from grpo_launcher.models.nemotron_h import bind_mamba_kernels
    from grpo_launcher.spec.schema import MoESpec

    path = _nemotron_h_dir(tmp_path)
    spec = _megatron_spec(expert_parallel_size=world, moe=MoESpec(token_dispatcher="allgather"))
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(0))  # 37: not whole chunks of 16
    out = tmp_path / "out.pt"
    mp.start_processes(_logits_job, args=(world, spec, str(path), ids, str(out), _free_port()), nprocs=world,
                       start_method="spawn", join=True)
    res = torch.load(out, weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert bind_mamba_kernels(hf, on_cuda=False).startswith("pure torch")  # mamba-ssm imports: no Triton on CPU
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    print(f"megatron vs HF nemotron_h logits: max |d| {(res['logits'] - ref).abs().max():.2e}")
    assert torch.allclose(res["logits"], ref, atol=1e-5, rtol=0)
    sd = hf.state_dict()
    assert res["sd"].keys() == sd.keys() and all(torch.equal(res["sd"][k], v) for k, v in sd.items())


@pytest.mark.slow
@pytest.mark.extended  # CI's time, as the logits test above
@needs_mamba_ssm
def test_megatron_nemotron_h_step_equals_the_torch_backend(tmp_path):
    """One driver step (logprobs, a clipped GRPO update) of nemotron_h on megatron = the torch backend's: logprobs,
    loss metrics, grad norm and the updated weights (through the Mamba, attention and MoE layers' backward). Megatron
    runs token-budget micro-batches (train.dynamic_batching: rows in whole scan chunks, one micro-batch here), the
    torch backend fixed rows of 4."""
    pytest.importorskip("megatron.core")
    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker
    from grpo_launcher.spec.schema import MoESpec

    path = _nemotron_h_dir(tmp_path)
    batch = _batch(8, 512)
    moe = MoESpec(token_dispatcher="allgather", load_balancing_type="none")
    mg = _run(1, _megatron_spec(moe=moe, dynamic_batching=True), path, batch, tmp_path / "m.pt")
    spec = _megatron_spec(moe=moe)
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, backend="torch"))
    tw = TorchPolicyWorker(spec, str(path), 0, 1)
    prev, _ = tw.logprobs(batch)
    noise = 0.3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    b = batch.with_(prev_logprobs=prev + noise)
    tm = tw.update([b], [local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None])])
    tsd = tw.state_dict()
    mask = batch.response_mask.bool()
    assert torch.allclose(mg["prev"][mask], prev[mask], atol=1e-5, rtol=0)
    for k in ("loss", "pg_loss", "clip_fraction", "entropy", "grad_norm"):
        assert mg["metrics"][k] == pytest.approx(tm[k], rel=1e-4, abs=1e-6), k
    assert mg["metrics"]["clip_fraction"] > 0
    assert mg["sd"].keys() == tsd.keys()
    worst = max((mg["sd"][k] - v).abs().max().item() for k, v in tsd.items())
    print(f"nemotron_h megatron vs torch after one update: max |d weight| {worst:.2e}")
    assert worst < 2e-5


def _aux_grads_job(rank: int, world: int, spec, model_dir: str, batches, out: str, port: int) -> None:
    """One worker: for each batch, one update's gradients (no optimizer step) with every advantage 0 and the old
    logprobs the current ones, so that the MoE router's balancing loss is the only gradient."""
    os.environ["GRPO_MEGATRON_CPU_SHIM"] = SHIM
    import torch.distributed as dist

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    w.opt.step = lambda: None  # the gradients stay as the backward left them
    res = []
    for batch in batches:
        prev, _ = w.logprobs(batch)
        b = batch.with_(prev_logprobs=prev, advantages=torch.zeros_like(batch.advantages))
        w.update([b], [float(b.response_mask.sum())])
        res.append({n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None})
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.extended  # CI's time: make test runs the megatron worker in test_tp2_equals_tp1_equals_torch_backend
@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_megatron_moe_balancing_loss_weighs_the_same_whatever_the_batch_size(tmp_path, balancing):
    """train.moe.aux_loss_coeff on megatron: the router's balancing loss is a mean over the step, so a batch and the
    same rows twice give the same gradient. Before: megatron's routers multiplied it by each micro-batch's token
    count (calculate_per_token_loss, for a finalize_model_grads(num_tokens) we never call), summed over micro-batches:
    the coefficient weighed tokens-per-micro-batch × micro-batches times too much, and twice as much for the
    doubled batch."""
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from grpo_launcher.spec.schema import MoESpec

    path = _tiny_hf("qwen3_moe", tmp_path)
    spec = _megatron_spec(micro_batch_size=4, global_batch_size=16, max_grad_norm=1e9,
                          moe=MoESpec(token_dispatcher="allgather", load_balancing_type=balancing,
                                      aux_loss_coeff=0.01))
    batch = _batch(8, 256)
    twice = batch.select(torch.arange(16) % 8)  # rows 0-7, then the same again
    out = tmp_path / "out.pt"
    mp.start_processes(_aux_grads_job, args=(1, spec, str(path), [batch, twice], str(out), _free_port()), nprocs=1,
                       start_method="spawn", join=True)
    once, doubled = torch.load(out, weights_only=False)
    router = [k for k in once if ".router." in k]
    assert router and all(once[k].abs().max() > 0 for k in router)  # the balancing loss reached the routers
    for k, g in once.items():
        assert torch.allclose(doubled[k], g, atol=1e-7, rtol=1e-4), (k, (doubled[k].norm() / g.norm()).item())
