#!/usr/bin/env python
"""One command that builds, checks and times the megatron backend on GPUs (and, for smoke tests, on CPU).

    python benchmarks/megatron_gpu.py --out $OUT                       # 1 GPU: all phases below
    python benchmarks/megatron_gpu.py --world 2 --tp 2 --out $OUT      # 2 GPUs, TP=2 (update phase)
    python benchmarks/megatron_gpu.py --world 2 --out $OUT             # 2 GPUs, DP=2 (update phase)
    GRPO_MEGATRON_CPU_SHIM=tests/megatron_cpu_shim.py python benchmarks/megatron_gpu.py --preset tiny --device cpu

Phases (rank 0 prints a table last and writes JSON to --out):
  1. bf16 matmul peak of this card (8192³, 3 warm-ups, median of 20, CUDA events);
  2. a random Llama-shaped HF checkpoint (preset 1b: 24 L, h 2048, 16 heads / 4 KV, FFN 5632, vocab 32000,
     untied: 1.21 B params) → MegatronPolicyWorker (HF → Megatron mapping, bf16, SDPA core attention);
  3. update phase: GRPO loss + backward + optimizer over one minibatch of `--minibatch` sequences of
     `--seq` tokens, micro-batch `--micro`; warm-up steps, then CUDA events, median of `--steps`;
     MFU = 6 · params · tokens / time / (peak · GPUs);  same for the logprob phase (2 · params · tokens);
  4. (1 process) a short GRPO loop: HF `generate` rollouts (bf16, on the GPU) → megatron logprobs →
     agreement with the rollout's logprobs → update → refit (state_dict → HF load_state_dict); the
     agreement is also shown against a stale (not refitted) HF copy;
  5. (1 process) the torch backend (TorchPolicyWorker's math, HF model bf16, fused AdamW) on the same batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PRESETS = {
    "1b": dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512),
}


def log(*a) -> None:
    print(*a, flush=True)


def versions() -> dict:
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except Exception as exc:  # noqa: BLE001
        out["megatron_core"] = f"import failed: {exc}"
    try:
        import transformer_engine  # noqa: F401

        out["transformer_engine"] = "present"
    except ImportError:
        out["transformer_engine"] = "absent"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
        out["cuda"] = torch.version.cuda
    return out


def matmul_peak() -> float:
    """Median bf16 TFLOP/s of an 8192³ product on random data."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(ts) / 1e12


def make_hf_model(preset: str, out: Path, device: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = out / f"llama-{preset}"
    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, **PRESETS[preset])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(path)
    del model
    return path


def make_spec(args):
    from grpo_launcher.spec.schema import (Precision, RolloutSpec, RunSpec, TrainBackend, TrainSpec)

    train = TrainSpec(backend=TrainBackend.megatron, precision=Precision(args.precision),
                      micro_batch_size=args.micro, logprob_batch_size=args.micro, global_batch_size=args.minibatch,
                      tensor_parallel_size=args.tp, lr=args.lr, max_grad_norm=1.0, core_attention=args.attention,
                      activation_checkpointing=args.recompute, distributed_optimizer=args.distributed_optimizer,
                      max_total_sequence_length=args.seq)
    rollout = RolloutSpec(temperature=1.0, max_new_tokens=args.seq - args.prompt)
    return RunSpec(train=train, rollout=rollout)


def synthetic_batch(B: int, seq: int, prompt: int, vocab: int, seed: int = 0):
    """B full-length rows: `prompt` prompt tokens + `seq - prompt` response tokens, random ids."""
    from grpo_launcher.train.batch import Generation, collate

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, seq), generator=g)
    gens = [Generation(ids[i, :prompt].tolist(), ids[i, prompt:].tolist(), [0.0] * (seq - prompt), False)
            for i in range(B)]
    return collate(gens, torch.randn(B, generator=g), torch.ones(B), pad_id=0)


def timed(fn, warmup: int, steps: int, cuda: bool) -> list[float]:
    out = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            e.record()
            torch.cuda.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


# ------------------------------------------------------------------------------ one rank


def run_rank(rank: int, world: int, args, model_dir: str, port: int, result_path: str) -> None:
    import torch.distributed as dist

    from grpo_launcher.policy.megatron_policy import MegatronPolicyWorker
    from grpo_launcher.policy.torch_policy import local_denominator
    from grpo_launcher.train.batch import shard_rows

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    spec = make_spec(args)
    res: dict = {"rank": rank, "world": world}
    t0 = time.perf_counter()
    w = MegatronPolicyWorker(spec, model_dir, rank, world)
    w.init_distributed("127.0.0.1", port)
    res["init_s"] = time.perf_counter() - t0
    params = sum(p.numel() for p in w.model.parameters())
    t = torch.tensor([params], dtype=torch.float64, device="cuda" if cuda else "cpu")
    if world > 1:  # distinct shards: TP splits; DP replicas counted once per replica
        from megatron.core import parallel_state as ps

        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    res["params"] = int(t.item())
    vocab = w.arch.vocab_size

    # ---- logprob + update phases on a synthetic minibatch
    batch = synthetic_batch(args.minibatch, args.seq, args.prompt, vocab)
    mine = batch.select(shard_rows(len(batch), world, rank))
    prev_holder = {}

    def do_logprobs():
        prev_holder["prev"], _ = w.logprobs(mine)

    lp_times = timed(do_logprobs, 1, max(2, args.steps // 2), cuda)
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, prev_holder["prev"])
    else:
        parts = [prev_holder["prev"]]
    prev = torch.cat(parts)
    b = batch.with_(prev_logprobs=prev + 0.01 * torch.randn(prev.shape))
    den = local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None])
    mine_b = b.select(shard_rows(len(b), world, rank))
    metrics_holder = {}

    def do_update():
        metrics_holder["m"] = w.update([mine_b], [den])

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    up_times = timed(do_update, args.warmup, args.steps, cuda)
    res["update_step_s"] = up_times
    res["logprob_s"] = lp_times
    res["update_metrics"] = metrics_holder["m"]
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    res["tokens_per_step"] = args.minibatch * args.seq

    # ---- GRPO loop with HF rollouts + refit (single process)
    if world == 1 and args.grpo_steps:
        res["grpo"] = grpo_loop(w, spec, model_dir, args, cuda)

    if world > 1:
        dist.barrier()
    if rank == 0:
        torch.save(res, result_path)
    del w
    if cuda:
        torch.cuda.empty_cache()

    if world == 1 and not args.skip_torch:
        res["torch_backend"] = torch_backend(spec, model_dir, batch, prev, args, cuda)
        torch.save(res, result_path)
    if world > 1:
        dist.destroy_process_group()


def grpo_loop(w, spec, model_dir: str, args, cuda: bool) -> list[dict]:
    """rollout (HF generate, bf16 on the GPU) → logprobs → agreement → update → refit; per step."""
    import copy

    from transformers import AutoModelForCausalLM

    from grpo_launcher import algos
    from grpo_launcher.policy.torch_policy import local_denominator
    from grpo_launcher.train.batch import Generation, collate

    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.precision == "bfloat16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    hf.load_state_dict(w.state_dict(), strict=True)  # refit before the first rollout, as the driver does
    P, G, new = args.grpo_prompts, args.grpo_gens, args.grpo_new_tokens
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(1, args.grpo_steps + 1):
        rec: dict = {"step": step}
        prompts = torch.randint(3, w.arch.vocab_size, (P, args.grpo_prompt_tokens), generator=g)
        ids = prompts.repeat_interleave(G, 0).to(dev)
        t0 = time.perf_counter()
        torch.manual_seed(step)
        with torch.no_grad():
            gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                              eos_token_id=None, return_dict_in_generate=True, output_logits=True)
        toks = gen.sequences[:, ids.shape[1]:]
        logits = torch.stack(gen.logits, 1).float()
        gen_lp = logits.log_softmax(-1).gather(-1, toks[..., None]).squeeze(-1).cpu()
        del logits, gen
        rec["rollout_s"] = time.perf_counter() - t0
        gens = [Generation(ids[i].tolist(), toks[i].tolist(), gen_lp[i].tolist(), True) for i in range(len(ids))]
        rewards = torch.randn(len(gens), generator=g)
        adv = algos.compute_advantages("group_norm", rewards, G)
        batch = collate(gens, adv, torch.ones(len(gens)), pad_id=0)
        t0 = time.perf_counter()
        prev, _ = w.logprobs(batch)
        rec["logprob_s"] = time.perf_counter() - t0
        mask = batch.response_mask.bool()
        d = (prev - batch.generation_logprobs)[mask].abs()
        rec["gen_vs_policy_absdiff_mean"] = float(d.mean())
        rec["gen_vs_policy_absdiff_max"] = float(d.max())
        batch = batch.with_(prev_logprobs=prev)
        den = local_denominator("seq_mean_token_mean", batch.response_mask)
        t0 = time.perf_counter()
        rec["metrics"] = w.update([batch], [den])
        rec["update_s"] = time.perf_counter() - t0
        stale = copy.deepcopy(hf) if step == args.grpo_steps else None
        t0 = time.perf_counter()
        sd = w.state_dict()
        hf.load_state_dict(sd, strict=True)  # what HFRolloutWorker.update_weights does
        if cuda:
            torch.cuda.synchronize()
        rec["refit_s"] = time.perf_counter() - t0
        if stale is not None:  # after the last update: fresh policy logprobs vs refitted and vs stale HF
            new_prev, _ = w.logprobs(batch)
            seqs = batch.input_ids.to(dev)
            for name, model in (("refitted", hf), ("stale", stale)):
                with torch.no_grad():
                    lg = model(input_ids=seqs).logits.float()
                T = batch.response_ids.shape[1]
                L = seqs.shape[1]
                lp = lg[:, L - T - 1:L - 1].log_softmax(-1).gather(-1, batch.response_ids.to(dev)[..., None])
                diff = (lp.squeeze(-1).cpu() - new_prev)[mask].abs()
                rec[f"policy_vs_{name}_hf_absdiff_mean"] = float(diff.mean())
                rec[f"policy_vs_{name}_hf_absdiff_max"] = float(diff.max())
            del stale
        log(f"grpo step {step}: {json.dumps({k: v for k, v in rec.items() if k != 'metrics'})}")
        out.append(rec)
    del hf
    return out


def torch_backend(spec, model_dir: str, batch, prev, args, cuda: bool) -> dict:
    """TorchPolicyWorker's update (same math module) on the GPU: HF model in bf16, fused AdamW."""
    from transformers import AutoModelForCausalLM

    from grpo_launcher.policy.torch_policy import TorchPolicyWorker, local_denominator

    dev = torch.device("cuda" if cuda else "cpu")

    class GPUTorchWorker(TorchPolicyWorker):
        def __init__(self):  # noqa: D401 — GPU variant of the reference backend for the comparison
            self.spec, self.rank, self.world = spec, 0, 1
            dtype = torch.bfloat16 if args.precision == "bfloat16" else torch.float32
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev)
            if args.recompute:
                self.model.gradient_checkpointing_enable()
            self.ref = None
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec.train.lr, fused=cuda)
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)

        def _logits(self, model, b):
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            B, L, V = logits.shape
            T = b.response_ids.shape[1]
            idx = (b.prompt_lens[:, None] - 1 + torch.arange(T, device=dev)[None, :]).clamp(max=L - 1)
            return logits.gather(1, idx[:, :, None].expand(B, T, V)) / spec.rollout.temperature

    def to_dev(b):
        return type(b)(**{f.name: (None if getattr(b, f.name) is None else getattr(b, f.name).to(dev))
                          for f in dataclasses.fields(b)})

    tw = GPUTorchWorker()
    b = to_dev(batch.with_(prev_logprobs=prev + 0.01 * torch.randn(prev.shape)))
    den = local_denominator(spec.loss.aggregation.value, b.response_mask * b.sample_mask[:, None])
    holder = {}
    tp = timed(lambda: holder.update(p=tw.logprobs(b)), 1, max(2, args.steps // 2), cuda)
    torch_prev = holder["p"][0].cpu()
    mask = batch.response_mask.bool()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = timed(lambda: holder.update(m=tw.update([b], [den])), args.warmup, args.steps, cuda)
    res = {"update_step_s": times, "logprob_s": tp, "update_metrics": holder["m"],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "params": sum(p.numel() for p in tw.model.parameters()),
           "megatron_vs_torch_logprob_absdiff_mean": float((torch_prev - prev)[mask].abs().mean()),
           "megatron_vs_torch_logprob_absdiff_max": float((torch_prev - prev)[mask].abs().max())}
    del tw
    return res


# ------------------------------------------------------------------------------ report


def summarize(res: dict, args, peak: float | None, info: dict) -> str:
    world = res["world"]
    tok = res["tokens_per_step"]
    rows = []

    def row(name, r, gpus):
        t = statistics.median(r["update_step_s"])
        lp = statistics.median(r["logprob_s"])
        P = res["params"]
        mfu = 6 * P * tok / t / (peak * 1e12 * gpus) if peak else float("nan")
        mfu_lp = 2 * P * tok / lp / (peak * 1e12 * gpus) if peak else float("nan")
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        rows.append(f"| {name} | {gpus} | {t * 1e3:.0f} | {tok / t:,.0f} | {tok / t / gpus:,.0f} | {100 * mfu:.1f} % "
                    f"| {tok / lp:,.0f} | {100 * mfu_lp:.1f} % | {mem} |")

    layout = f"megatron TP={args.tp} DP={world // args.tp}, {args.attention} attention, {args.precision}"
    row(layout + (", recompute" if args.recompute else ""), res, world)
    if "torch_backend" in res:
        row(f"torch backend (HF {args.precision} weights, fused AdamW)", res["torch_backend"], 1)
    head = ("| variant | GPUs | update step (ms) | update tok/s | tok/s/GPU | update MFU | logprob tok/s | "
            "logprob MFU | peak mem GiB |\n|---|---|---|---|---|---|---|---|---|")
    lines = [f"versions: {json.dumps(info)}", f"bf16 matmul peak: {peak:.0f} TFLOP/s" if peak else "no GPU peak",
             f"params: {res['params']:,}; minibatch {args.minibatch} × seq {args.seq} = {tok:,} tokens/step "
             f"(prompt {args.prompt} + response {args.seq - args.prompt}), micro-batch {args.micro}; "
             f"median of {args.steps} steps after {args.warmup} warm-up", head, *rows]
    if "torch_backend" in res:
        tb = res["torch_backend"]
        lines.append(f"megatron vs torch backend logprobs (bf16, same weights): mean |Δ| "
                     f"{tb['megatron_vs_torch_logprob_absdiff_mean']:.2e}, max {tb['megatron_vs_torch_logprob_absdiff_max']:.2e}")
    for rec in res.get("grpo", []):
        lines.append("grpo step {step}: rollout {rollout_s:.1f}s logprob {logprob_s:.2f}s update {update_s:.2f}s "
                     "refit {refit_s:.2f}s | |gen-policy| mean {gen_vs_policy_absdiff_mean:.2e} max "
                     "{gen_vs_policy_absdiff_max:.2e}".format(**rec)
                     + (" | after update: policy vs refitted HF mean {:.2e} (max {:.2e}), vs stale HF mean {:.2e}"
                        .format(rec["policy_vs_refitted_hf_absdiff_mean"], rec["policy_vs_refitted_hf_absdiff_max"],
                                rec["policy_vs_stale_hf_absdiff_mean"]) if "policy_vs_stale_hf_absdiff_mean" in rec
                        else "") + f" | loss {rec['metrics']['loss']:.4f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--precision", default="bfloat16")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "local"])
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--grpo-steps", type=int, default=3)
    ap.add_argument("--grpo-prompts", type=int, default=8)
    ap.add_argument("--grpo-gens", type=int, default=8)
    ap.add_argument("--grpo-prompt-tokens", type=int, default=64)
    ap.add_argument("--grpo-new-tokens", type=int, default=128)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/megatron_gpu_models")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/megatron_gpu_out"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    info = versions()
    log(f"versions: {info}")
    peak = matmul_peak() if cuda else None
    if peak:
        log(f"bf16 matmul peak: {peak:.0f} TFLOP/s")
    t0 = time.perf_counter()
    model_dir = make_hf_model(args.preset, Path(args.model_dir), args.device)
    log(f"HF checkpoint {model_dir} ready in {time.perf_counter() - t0:.1f}s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = out / f"megatron_result{args.tag}.pt"
    if args.world == 1:
        run_rank(0, 1, args, str(model_dir), port, str(result))
    else:
        import torch.multiprocessing as mp

        mp.start_processes(run_rank, args=(args.world, args, str(model_dir), port, str(result)), nprocs=args.world,
                           start_method="spawn", join=True)
    res = torch.load(result, weights_only=False)
    text = summarize(res, args, peak, info)
    cmd = "python benchmarks/megatron_gpu.py " + " ".join(sys.argv[1:])
    (out / f"megatron_gpu{args.tag}.md").write_text(f"command: `{cmd}`\n\n{text}\n")
    (out / f"megatron_gpu{args.tag}.json").write_text(json.dumps(
        {"args": vars(args), "versions": info, "peak_tflops": peak,
         **{k: v for k, v in res.items() if k != "grpo"}, "grpo": res.get("grpo")}, indent=1, default=str))
    result.unlink()
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
