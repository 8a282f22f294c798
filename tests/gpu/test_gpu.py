"""The `gpu` tier: what a user's GPU node must do, run on one (`make test-gpu`; skipped without CUDA).

- `launch.py` end to end on the GPU for both backends, a ~113M-parameter model that learns the toy task;
- torch and megatron logprobs agree on the same weights;
- after an update, the refitted hybrid engine holds exactly the policy's weights (in its precision);
- rollout=vllm (vLLM's CUDA build, when installed) learns the toy task through launch.py with both backends;
- nemotron_h on the megatron backend (megatron-core's hybrid model, mamba-ssm's kernels): HF's logits on CUDA, and
  through launch.py with rollout=vllm.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# 10 layers x hidden 1024 (16 heads of 64, 4 KV heads), FFN 2816: 113M parameters
MODEL = ["model.num_layers=10", "model.hidden_size=1024", "model.num_attention_heads=16", "model.num_kv_heads=4",
         "model.ffn_hidden_size=2816", "model.warm_start_steps=150"]
GPU_RUN = ["cluster.gpus_per_node=1", "train.precision=bfloat16", "logging.mlflow=false", "train.lr=3e-5",
           "grpo.max_steps=400", "grpo.val_period=50", "checkpoint.save_period=100"]


def metrics(run_dir: Path) -> list[dict]:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = r
    return [rows[s] for s in sorted(rows)]


@pytest.mark.parametrize("backend,compiled", [("torch", "true"), ("megatron", "false")])
def test_launch_learns_on_the_gpu(tmp_path, backend, compiled):
    cmd = [sys.executable, str(ROOT / "launch.py"), f"output_root={tmp_path}", "name=gpu", f"train.backend={backend}",
           f"rollout.hf_compile={compiled}", *MODEL, *GPU_RUN]
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = metrics(tmp_path / "gpu")
    first = sum(r["train/reward_mean"] for r in rows[:10]) / 10  # means of 10 steps: one step is noisy
    last = sum(r["train/reward_mean"] for r in rows[-10:]) / 10
    print(f"{backend}: reward {first:.3f} -> {last:.3f}; step {rows[-1]['time/step_s']:.3f} s")
    assert last - first >= 0.3, [round(r["train/reward_mean"], 3) for r in rows]
    # the engine generated with the policy's weights: its logprobs match the trainer's (bf16 vs fp32 master)
    assert max(r["train/gen_vs_policy_logprob_absdiff"] for r in rows) < 0.05
    assert (tmp_path / "gpu" / "checkpoints").exists()


def test_cpu_offload_runs_through_launch_py(tmp_path):
    """train.cpu_offload on one GPU (FSDP2 + CPUOffloadPolicy on a one-rank group): a few steps through launch.py,
    the refit gathers the host shards onto the GPU for the engine (its logprobs match the policy's), a checkpoint."""
    cmd = [sys.executable, str(ROOT / "launch.py"), f"output_root={tmp_path}", "name=offload", "train.backend=torch",
           "train.cpu_offload=true", *MODEL, *GPU_RUN, "grpo.max_steps=6", "grpo.val_period=3",
           "checkpoint.save_period=3"]
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = metrics(tmp_path / "offload")
    print(f"offload: step {rows[-1]['time/step_s']:.3f} s; " + proc.stdout.split("memory per GPU")[-1][:120])
    assert len(rows) == 6 and all(r["train/grad_norm"] == r["train/grad_norm"] for r in rows)  # finite, not NaN
    assert max(r["train/gen_vs_policy_logprob_absdiff"] for r in rows) < 0.05
    assert (tmp_path / "offload" / "checkpoints").exists()


def test_cpu_offload_keeps_the_shards_on_the_host_and_matches_the_plain_worker(tmp_path):
    """The offloaded worker's parameters and AdamW state are CPU tensors; its logprobs and one update's loss equal
    the plain one-rank worker's on the same batch (bf16 compute on both)."""
    import dataclasses

    import torch.distributed as dist

    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    spec = _spec(tmp_path, "torch")
    model_dir = _model_dir(spec, tmp_path)
    plain = TorchPolicyWorker(spec, model_dir, 0, 1)
    off_spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, cpu_offload=True))
    off = TorchPolicyWorker(off_spec, model_dir, 0, 1)
    off.init_distributed("127.0.0.1", _free_port())
    try:
        assert off.sharded and all(p.device.type == "cpu" for p in off.model.parameters())
        _, batch = _batch(plain, spec)
        lp_plain, _ = plain.logprobs(batch)
        lp_off, _ = off.logprobs(batch)
        mask = batch.response_mask.bool()
        assert (lp_plain - lp_off)[mask].abs().mean() < 0.01
        den = [float(mask.sum())]
        m_plain = plain.update([batch.with_(prev_logprobs=lp_plain)], den)
        m_off = off.update([batch.with_(prev_logprobs=lp_plain)], den)
        print(f"loss {m_plain['loss']:.5f} / {m_off['loss']:.5f}, grad norm {m_plain['grad_norm']:.4f} / "
              f"{m_off['grad_norm']:.4f} (plain / offload)")
        assert abs(m_plain["loss"] - m_off["loss"]) < 0.01
        assert abs(m_plain["grad_norm"] - m_off["grad_norm"]) < 0.05 * m_plain["grad_norm"]
        assert all(v.device.type == "cpu" for s in off.opt.state.values() for v in s.values() if v.dim())
    finally:
        dist.destroy_process_group()


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM's CUDA build (scripts/gpu-kit.sh with VLLM=0.25.0)")
@pytest.mark.parametrize("backend,engine", [("torch", "offline"), ("megatron", "offline"), ("torch", "async+http")])
def test_launch_learns_with_vllm_rollouts_on_the_gpu(tmp_path, backend, engine):
    """rollout=vllm through launch.py: an engine actor beside the policy on the one GPU, asleep (level 2) through
    every update, refit over CUDA IPC (vLLM's weight-transfer API), the engine's logprobs within 0.05 of the
    policy's on every step. "async+http": AsyncLLM with its OpenAI server up, as env=nemo_gym runs it."""
    extra = ["rollout.sleep_mode=true"]
    extra += ["rollout.async_engine=true", "rollout.expose_http_server=true"] if engine == "async+http" else []
    cmd = [sys.executable, str(ROOT / "launch.py"), f"output_root={tmp_path}", "name=gpu", "rollout=vllm",
           f"train.backend={backend}", *MODEL, *GPU_RUN, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = metrics(tmp_path / "gpu")
    first = sum(r["train/reward_mean"] for r in rows[:10]) / 10
    last = sum(r["train/reward_mean"] for r in rows[-10:]) / 10
    lp = [r["train/gen_vs_policy_logprob_absdiff"] for r in rows]
    refit_ms = sorted(1e3 * r["time/refit_s"] for r in rows)[len(rows) // 2]
    freed = [r["rollout/sleep_freed_gib"] for r in rows]
    print(f"vllm/{backend}/{engine}: reward {first:.3f} -> {last:.3f}; step {rows[-1]['time/step_s']:.3f} s; "
          f"engine vs policy logprob |d| max {max(lp):.4f}; refit median {refit_ms:.1f} ms; "
          f"sleep freed {min(freed):.1f}-{max(freed):.1f} GiB, sleep median "
          f"{sorted(r['time/sleep_s'] for r in rows)[len(rows) // 2] * 1e3:.1f} ms")
    assert last - first >= 0.3, [round(r["train/reward_mean"], 3) for r in rows]
    assert max(lp) < 0.05  # the engine samples from the policy's distribution (bf16 engine vs fp32 master)
    assert refit_ms < 500  # CUDA IPC, no host round trip
    # asleep through every update: its weights and KV cache (most of gpu_memory_utilization) given back
    assert min(freed) > 0.25 * 0.5 * torch.cuda.get_device_properties(0).total_memory / 2**30, freed


@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM's CUDA build (scripts/gpu-kit.sh with VLLM=0.25.0)")
@pytest.mark.parametrize("mb", [None, 512])
def test_a_gpu_engine_holds_the_kv_cache_pre_flight_counts(tmp_path, mb):
    """rollout.kv_cache_memory_mb on CUDA: null gives the engine its budget's rest (rollout/vllm.py kv_cache_bytes:
    at least the dry run's "KV cache", the engine's weights in bf16 here), a user's size is the engine's and the dry
    run's; the engine allocates whole blocks, at most what it asked."""
    import os

    import ray

    from grpo_launcher.preflight.memory_estimate import estimate
    from grpo_launcher.rollout import rollout_class
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.train.workers import WORKER_ENV, _src

    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    spec = load_spec([f"output_root={tmp_path}", "rollout=vllm", *MODEL, *GPU_RUN, "model.warm_start_steps=0",
                      f"cluster.gpu_memory_gib={total:.1f}", "rollout.gpu_memory_utilization=0.3",
                      f"rollout.kv_cache_memory_mb={'null' if mb is None else mb}"])
    budget = estimate(spec).kv["available"]  # the dry run's "KV cache" (the engine's weights in model.dtype)
    want = mb * 2**20 if mb else None
    assert budget == want if mb else budget > 0
    env = dict(WORKER_ENV, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _src()) if p))
    ray.init(num_gpus=1, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="WARNING")
    try:
        engine = ray.remote(rollout_class("vllm")).options(num_gpus=1).remote(spec, _model_dir(spec, tmp_path), 1)
        size = ray.get(engine.kv_cache_bytes.remote(), timeout=600)
        ray.get(engine.shutdown.remote(), timeout=300)
    finally:
        ray.shutdown()
    print(f"kv_cache_memory_mb={mb}: asked {size['asked'] / 2**30:.2f} GiB, allocated {size['allocated'] / 2**30:.2f}")
    asked = size["asked"]
    assert asked == want if mb else budget <= asked <= 0.3 * total * 2**30, (size, budget)
    assert 0.95 * asked <= size["allocated"] <= asked, size


def _spec(tmp_path, backend: str):
    from grpo_launcher.spec.compose import load_spec

    return load_spec([f"output_root={tmp_path}", f"train.backend={backend}", *MODEL, *GPU_RUN,
                      "model.warm_start_steps=0", "train.global_batch_size=32", "grpo.num_prompts_per_step=4",
                      "train.logprob_batch_size=32", "train.micro_batch_size=8"])


def _model_dir(spec, tmp_path) -> str:
    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(spec.model, make_env(spec), "toy", tmp_path, seed=0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(worker, spec):
    from grpo_launcher.envs import make_env
    from grpo_launcher.batch import collate

    env = make_env(spec)
    prompts = [worker.engine.tokenizer(p.text)["input_ids"] for p in env.train_prompts(1, 0, 4)]
    gens = worker.generate(prompts, 8, seed=0)
    adv = torch.randn(len(gens))
    return gens, collate(gens, adv, torch.ones(len(gens)), worker.engine.tokenizer.pad_token_id)


def test_torch_and_megatron_logprobs_agree_and_refit_is_exact(tmp_path):
    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    spec_t, spec_m = _spec(tmp_path, "torch"), _spec(tmp_path, "megatron")
    model_dir = _model_dir(spec_t, tmp_path)
    tw = TorchPolicyWorker(spec_t, model_dir, 0, 1)
    mw = MegatronPolicyWorker(spec_m, model_dir, 0, 1)
    mw.init_distributed("127.0.0.1", _free_port())
    gens, batch = _batch(tw, spec_t)
    lp_t, _ = tw.logprobs(batch)
    lp_m, _ = mw.logprobs(batch)
    mask = batch.response_mask.bool()
    gen_lp = batch.generation_logprobs
    d_backends, d_engine = (lp_t - lp_m)[mask].abs(), (lp_t - gen_lp)[mask].abs()
    print(f"|torch - megatron| mean {d_backends.mean():.2e} max {d_backends.max():.2e}; "
          f"|policy - engine| mean {d_engine.mean():.2e} max {d_engine.max():.2e}")
    assert d_backends.mean() < 0.01 and d_backends.max() < 0.15  # same weights, bf16 compute on both
    assert d_engine.mean() < 0.01  # the engine (a bf16 copy) samples from the policy's distribution

    for w in (tw, mw):  # after an update, the engine holds exactly the policy's weights (in bf16)
        w.update([batch.with_(prev_logprobs=lp_t)], [float(mask.sum())])
        w.refit_engine()
        policy = w.hf_weights()
        engine = w.engine.model.state_dict()
        for k, v in policy.items():
            assert torch.equal(engine[k], v.to(engine[k].dtype)), k


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_and_packed_logprobs_match_whole_logits_in_bf16(tmp_path, packing):
    """Issue 29 / 26 on the GPU: the chunked output layer (and packed rows) against today's whole logits, bf16
    compute on the same weights: logprobs, loss and gradient norm within bf16 tolerance."""
    from dataclasses import replace

    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    spec = _spec(tmp_path, "torch")
    model_dir = _model_dir(spec, tmp_path)
    whole = TorchPolicyWorker(replace(spec, train=replace(spec.train, logprob_chunk_tokens=0)), model_dir, 0, 1)
    new = TorchPolicyWorker(replace(spec, train=replace(spec.train, sequence_packing=packing)), model_dir, 0, 1)
    _agree_in_bf16(whole, new, spec, f"packing={packing}: |chunked - whole|")


def _agree_in_bf16(ref, new, spec, label: str) -> None:
    """Two workers on the same weights and batch: logprobs, then one update's loss and grad norm, within bf16."""
    _, batch = _batch(ref, spec)
    mask = batch.response_mask.bool()
    lp_new, lp_ref = new.logprobs(batch)[0], ref.logprobs(batch)[0]
    d = (lp_new - lp_ref)[mask].abs()
    den = [float(mask.sum())]
    on, orf = (w.update([batch.with_(prev_logprobs=lp_ref)], den) for w in (new, ref))
    print(f"{label} logprob mean {d.mean():.2e} max {d.max():.2e}; loss {on['loss']:.6f} vs {orf['loss']:.6f}; "
          f"grad norm {on['grad_norm']:.5f} vs {orf['grad_norm']:.5f}")
    assert d.mean() < 5e-3 and d.max() < 0.1
    assert abs(on["loss"] - orf["loss"]) < 1e-3 and abs(on["grad_norm"] / orf["grad_norm"] - 1) < 0.02


def test_fused_kernels_match_the_hf_layers_in_bf16(tmp_path):
    """train.fused_kernels (Liger's RMSNorm, SwiGLU, RoPE) against the plain HF layers on the same weights."""
    pytest.importorskip("liger_kernel")
    from dataclasses import replace

    from grpo_launcher.policy.torch_policy import TorchPolicyWorker

    spec = _spec(tmp_path, "torch")
    model_dir = _model_dir(spec, tmp_path)
    plain, liger = (TorchPolicyWorker(replace(spec, train=replace(spec.train, fused_kernels=on)), model_dir, 0, 1)
                    for on in (False, True))
    _agree_in_bf16(plain, liger, spec, "|liger - hf|")


def _megatron_micro_step(w, batch, prev) -> tuple[float, float]:
    """One micro-step of the megatron worker (no optimizer step) from prev: (loss, grad norm over its fp32 grad
    buffers, where megatron's DDP accumulates the gradients)."""
    w._zero_grad()
    metrics, _, _ = w._micro_step(batch.with_(prev_logprobs=prev), float(batch.response_mask.sum()))
    norm = sum(float(p.main_grad.float().square().sum()) for p in w.model.module.parameters() if p.requires_grad)
    return metrics["loss"], norm ** 0.5


def _megatron_variants(tmp_path, label: str, configure, tol: tuple[float, float, float] = (5e-3, 0.1, 1e-3)):
    """One megatron worker on the GPU, two settings (configure(worker, 0 or 1) switches): logprobs and one
    micro-step's loss and grad norm agree, setting 1 against setting 0, within tol (logprob |diff| mean, max, loss;
    grad norm 2 %). Returns (model dir, batch, logprobs of setting 0, of setting 1)."""
    from megatron.core import parallel_state as ps

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker

    spec = _spec(tmp_path, "megatron")
    model_dir = _model_dir(spec, tmp_path)
    w = MegatronPolicyWorker(spec, model_dir, 0, 1)
    if ps.model_parallel_is_initialized():  # an earlier test's worker in this process
        ps.destroy_model_parallel()
    w.init_distributed("127.0.0.1", _free_port())
    try:
        _, batch = _batch(w, spec)
        mask = batch.response_mask.bool()
        out = []
        for setting in (0, 1):
            configure(w, setting)
            lp = w.logprobs(batch)[0]
            out.append((lp, *_megatron_micro_step(w, batch, out[0][0] if out else lp)))
    finally:
        ps.destroy_model_parallel()  # the next megatron worker in this process initializes its own groups
    (lp0, loss0, g0), (lp1, loss1, g1) = out
    d = (lp1 - lp0)[mask].abs()
    print(f"{label} logprob mean {d.mean():.2e} max {d.max():.2e}; loss {loss1:.6f} vs {loss0:.6f}; "
          f"grad norm {g1:.5f} vs {g0:.5f}")
    assert d.mean() < tol[0] and d.max() < tol[1]
    assert abs(loss1 - loss0) < tol[2] and abs(g1 / g0 - 1) < 0.02
    return model_dir, batch, lp0, lp1


def test_megatron_chunked_logprobs_match_whole_logits_in_bf16(tmp_path):
    """Issue 29 on the megatron backend: GPTModel's final hidden states through the chunked output layer
    (algos.linear_logprobs) against whole logits, bf16 on the same weights (megatron-core of the GPU kit)."""
    from dataclasses import replace

    def chunked(w, on: int) -> None:
        w.spec = replace(w.spec, train=replace(w.spec.train, logprob_chunk_tokens=4096 if on else 0))

    _megatron_variants(tmp_path, "megatron |chunked - whole|", chunked)


def test_megatron_fused_kernels_match_unfused_in_bf16(tmp_path):
    """train.fused_kernels=null on the megatron backend with CUDA: megatron-core's compiled SwiGLU and residual
    add are on. Against the same layers unfused (the shared TransformerConfig's flags off), bf16: within the
    torch-vs-megatron tolerance, and at least as close as the unfused layers to fp32 logprobs (the torch worker
    in fp32 on the same weights): the compiled SwiGLU rounds to bf16 once where the unfused one rounds twice."""
    from dataclasses import replace

    from grpo_launcher.policy.torch_policy import TorchPolicyWorker
    from grpo_launcher.spec.schema import Precision

    def fused(w, on: int) -> None:
        cfg = w.model.module.config
        if not on:
            assert cfg.bias_activation_fusion and cfg.bias_dropout_fusion  # what null resolved to on CUDA
        cfg.bias_activation_fusion = cfg.bias_dropout_fusion = bool(on)

    model_dir, batch, unfused, fused_lp = _megatron_variants(tmp_path, "megatron |fused - unfused|", fused,
                                                             tol=(0.01, 0.15, 5e-3))
    spec = _spec(tmp_path, "torch")
    fp32 = TorchPolicyWorker(replace(spec, train=replace(spec.train, precision=Precision.float32)), model_dir, 0, 1)
    ref = fp32.logprobs(batch)[0]
    mask = batch.response_mask.bool()
    d_fused, d_unfused = ((x - ref)[mask].abs().mean() for x in (fused_lp, unfused))
    print(f"|fused - fp32| mean {d_fused:.2e}; |unfused - fp32| mean {d_unfused:.2e}")
    assert d_fused < 1.1 * d_unfused


def _mamba_ssm_imports() -> bool:
    try:
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _mamba_ssm_imports(), reason="needs mamba-ssm's Triton kernels (scripts/gpu-kit.sh)")
@pytest.mark.parametrize("mamba_heads", [8, 4])  # in_proj width 328 and 196: causal-conv1d's kernels need 8 | width
def test_nemotron_h_kernel_path_matches_pure_torch_in_train_mode(monkeypatch, mamba_heads):
    """nemotron_h on the torch backend's GPU path (models/nemotron_h.py bind_mamba_kernels: mamba-ssm's Triton
    kernels, the fused train path only with causal-conv1d and a width its kernels take) gives the pure-torch
    path's loss and gradients, fp32."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling

    from grpo_launcher.models import nemotron_h as nh
    from nemotron_tiny import CONFIG

    for name in nh.MAMBA_FUNCTIONS:  # the rebinding is process-wide: restored after the test
        monkeypatch.setattr(modeling, name, getattr(modeling, name))
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**{**CONFIG, "chunk_size": 16, "mamba_num_heads": mamba_heads}))
    model = model.cuda().train()
    ids = torch.randint(3, 500, (2, 40), device="cuda")

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    path = nh.bind_mamba_kernels(model, on_cuda=True)
    assert path.startswith("mamba-ssm Triton kernels"), path
    kernel_loss, kernel_grads = loss_and_grads()
    assert nh.bind_mamba_kernels(model, on_cuda=False).startswith("pure torch")  # every function: torch reference
    torch_loss, torch_grads = loss_and_grads()
    print(f"{path}: loss {kernel_loss:.6f} vs pure torch {torch_loss:.6f}")
    assert abs(kernel_loss - torch_loss) < 1e-3  # Triton's dots may run in TF32
    worst = max(((kernel_grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in torch_grads.items())
    print(f"largest relative gradient difference: {worst:.2e}")
    assert worst < 1e-2


# ------------------------------------------------------------------------------ nemotron_h on the megatron backend


@pytest.mark.skipif(not _mamba_ssm_imports(), reason="needs mamba-ssm's Triton kernels (scripts/gpu-kit.sh)")
def test_megatron_nemotron_h_matches_hf_on_cuda(tmp_path, monkeypatch):
    """nemotron_h on train.backend=megatron on the GPU: megatron-core's hybrid model (the local spec of
    policy/megatron_hybrid.py; mamba-ssm's Triton chunk scan and gated norm, its fused path where causal-conv1d
    imports) gives HF NemotronH's logits (transformers on mamba-ssm's kernels) on the same fp32 weights, its HF-named
    export is those weights bit for bit, and after one update the hybrid engine holds the policy's weights."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling

    from grpo_launcher.models import nemotron_h as nh
    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker
    from grpo_launcher.spec.compose import load_spec
    from integration.test_megatron import _batch as random_batch
    from unit.test_megatron import _nemotron_h_dir

    for name in nh.MAMBA_FUNCTIONS:  # bind_mamba_kernels rebinds process-wide: restored after the test
        monkeypatch.setattr(modeling, name, getattr(modeling, name))
    path = _nemotron_h_dir(tmp_path)  # router bias non-zero, routed scaling 2.5
    spec = load_spec([f"output_root={tmp_path}", "model=nemotron_h_tiny",
                      "train.backend=megatron", "cluster.gpus_per_node=1", "train.precision=float32",
                      "logging.mlflow=false", "train.global_batch_size=32", "grpo.num_prompts_per_step=4",
                      "train.logprob_batch_size=32", "train.micro_batch_size=8"])
    w = MegatronPolicyWorker(spec, str(path), 0, 1)
    w.init_distributed("127.0.0.1", _free_port())
    try:
        ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
        w.model.eval()
        with torch.no_grad():
            logits = w.model(ids, torch.arange(40, device="cuda")[None].expand(2, 40), None).float()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        hf_path = nh.bind_mamba_kernels(hf, on_cuda=True)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        d = (logits - ref).abs().max().item()
        print(f"megatron vs HF nemotron_h on CUDA (HF: {hf_path}): max |logits d| {d:.2e}, "
              f"mem_eff path {w.model.module.config.use_mamba_mem_eff_path}")
        assert d < 2e-3  # the same Triton scan on both sides; TF32 may differ in the last bits
        sd, want = w.state_dict(), hf.state_dict()
        assert sd.keys() == want.keys() and all(torch.equal(sd[k], v.cpu()) for k, v in want.items())
        batch = random_batch(8, 500)
        lp, _ = w.logprobs(batch)
        w.update([batch.with_(prev_logprobs=lp)], [float(batch.response_mask.sum())])
        w.refit_engine()
        policy, engine = w.hf_weights(), w.engine.model.state_dict()
        assert max((policy[k].float() - v.float()).abs().max().item() for k, v in want.items() if k in policy) > 0
        for k, v in policy.items():
            assert torch.equal(engine[k], v.to(engine[k].dtype)), k
    finally:
        ps.destroy_model_parallel()  # the next megatron worker in this process initializes its own groups


def _nemotron_h_tiny_with_vllm(tmp_path, name: str, *overrides: str):
    """`launch.py model=nemotron_h_tiny rollout=vllm` in bf16 on one GPU; its metrics rows, the engine-vs-policy
    logprob gaps, and the mean reward of the first and last ten steps."""
    cmd = [sys.executable, str(ROOT / "launch.py"), f"output_root={tmp_path}", f"name={name}", "model=nemotron_h_tiny",
           "rollout=vllm", "cluster.gpus_per_node=1", "train.precision=bfloat16", "logging.mlflow=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = metrics(tmp_path / name)
    lp = [r["train/gen_vs_policy_logprob_absdiff"] for r in rows]
    first = sum(r["train/reward_mean"] for r in rows[:10]) / 10
    last = sum(r["train/reward_mean"] for r in rows[-10:]) / 10
    return rows, lp, first, last


@pytest.mark.skipif(not (_has_vllm() and _mamba_ssm_imports()),
                    reason="needs vLLM's CUDA build and mamba-ssm's Triton kernels (scripts/gpu-kit.sh)")
def test_launch_nemotron_h_on_megatron_with_vllm_rollouts(tmp_path):
    """`launch.py model=nemotron_h_tiny train.backend=megatron rollout=vllm` on one GPU (bf16): the run completes, the
    vLLM engine (refit from megatron's HF-named weights over CUDA IPC) samples with the policy's distribution, and
    the checkpoint megatron writes (NemotronH's file layout) loads in transformers."""
    from transformers import AutoModelForCausalLM

    steps = 30
    rows, lp, first, last = _nemotron_h_tiny_with_vllm(tmp_path, "nh", "train.backend=megatron",
                                                       "rollout.sleep_mode=true", f"grpo.max_steps={steps}",
                                                       "grpo.val_period=10", "checkpoint.save_period=10")
    step_s = sorted(r["time/step_s"] for r in rows)[len(rows) // 2]
    print(f"nemotron_h_tiny megatron + vllm: reward {first:.3f} -> {last:.3f} over {steps} steps; step median "
          f"{step_s:.2f} s; engine vs policy logprob |d| mean {sum(lp) / len(lp):.4f} max {max(lp):.4f}")
    assert len(rows) == steps
    assert max(lp) < 0.05  # the engine samples from the policy's distribution (bf16 engine vs fp32 master)
    policy = sorted((tmp_path / "nh" / "checkpoints").glob("step_*/policy"))[-1]
    _, info = AutoModelForCausalLM.from_pretrained(policy, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info


@pytest.mark.skipif(not (_has_vllm() and _mamba_ssm_imports()),
                    reason="needs vLLM's CUDA build and mamba-ssm's Triton kernels (scripts/gpu-kit.sh)")
def test_launch_nemotron_h_learns_with_vllm_rollouts(tmp_path):
    """`launch.py model=nemotron_h_tiny rollout=vllm` (torch backend, bf16, one GPU): vLLM's NemotronH engine
    (its own Mamba-2 kernels, the MoE library) is refit each step with the policy's Mamba, attention and expert
    weights by their checkpoint names, samples with the policy's distribution, and the policy learns the toy task."""
    steps = 100
    rows, lp, first, last = _nemotron_h_tiny_with_vllm(tmp_path, "nhv", f"grpo.max_steps={steps}",
                                                       "checkpoint.enabled=false")
    print(f"nemotron_h_tiny torch + vllm: reward {first:.3f} -> {last:.3f} over {steps} steps; engine vs policy "
          f"logprob |d| mean {sum(lp) / len(lp):.4f} max {max(lp):.4f}")
    assert len(rows) == steps
    assert last - first >= 0.3, [round(r["train/reward_mean"], 3) for r in rows]
    assert max(lp) < 0.05  # the engine samples from the policy's distribution (bf16 engine vs fp32 master)
