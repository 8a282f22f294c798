#!/usr/bin/env python
"""Calibrate the memory pre-flight (preflight/memory_estimate.py): predicted vs measured GPU memory of one update.

    python benchmarks/memory_gpu.py --out $OUT/memory.md            # 1 GPU (H200): the configurations below
    python benchmarks/memory_gpu.py --cpu-smoke --out /tmp/m.md      # CPU, tiny shape: the same code path

For every configuration, in a FRESH subprocess (so peaks never mix): the spec is built with
`grpo_launcher.spec.compose.load_spec(overrides)` (the project's own config path), the project's own policy
worker (TorchPolicyWorker / MegatronPolicyWorker) is constructed from it, and on a synthetic GRPO minibatch
of 2 micro-batches (rows of `seq` tokens: half prompt, half response) it runs: logprobs, one warm-up update
(so that the optimizer states exist), then — after torch.cuda.reset_peak_memory_stats() — logprobs and ONE
update. Measured: torch.cuda.max_memory_allocated / max_memory_reserved over that step, and the memory
used on the device outside PyTorch's pool (CUDA context, NCCL) = (total − free) − reserved. Predicted:
preflight.memory_estimate.estimate(spec) for the same spec (the policy's allocated peak over its phases, and ×
the allocator slack for reserved). A row passes when predicted is within 15 % of measured and never under it
by more than 5 %.

The model is a random Llama-shaped HF checkpoint (1.21 B: 24 layers, hidden 2048, 16 / 4 heads, FFN 5632,
vocab 32000, untied; built once, on the GPU, in its own subprocess, saved in bf16). No network access.
Megatron needs megatron-core importable (see benchmarks/results/megatron_gpu.md: the wheel in .whl/).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {
    "1b": dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=704, vocab_size=4000, max_position_embeddings=1024),
}

# (backend, micro batch, seq, activation checkpointing, reference model). ≥ 8 rows, < 6 minutes on one H200.
GPU_CONFIGS = [  # the most telling rows first: the time budget skips from the end
    ("torch", 1, 1024, False, False),
    ("megatron", 1, 1024, False, False),
    ("torch", 4, 2048, False, False),
    ("megatron", 4, 2048, False, False),
    ("torch", 2, 4096, False, True),
    ("megatron", 4, 4096, False, False),
    ("megatron", 8, 4096, True, False),
    ("megatron", 4, 2048, False, True),
    ("torch", 2, 2048, False, False),
    ("megatron", 2, 4096, True, True),
]
CPU_CONFIGS = [  # megatron's recomputation needs CUDA (its RNG tracker): off on CPU
    ("torch", 1, 128, False, False),
    ("torch", 2, 128, False, True),
    ("megatron", 2, 128, False, False),
    ("megatron", 1, 128, False, True),
]
# The logprob phase alone (--logprob-rows): (micro batch, seq, logprob batch, train.logprob_chunk_tokens), torch.
# Batch 64 x 2048 is the 1.21B dry run whose peak phase was the logprob pass (27 GiB of whole logits).
LOGPROB_CONFIGS = [(4, 2048, 64, 0), (4, 2048, 64, 4096)]
TIME_BUDGET_S = 330  # stop starting new configurations after this (the whole run must stay < 6 min)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the model


def make_model(shape: str, path: Path, device: str) -> None:
    """A random Llama checkpoint (bf16 on GPU, fp32 on CPU) + the tiny byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_launcher.models.tiny import build_tokenizer

    cfg = LlamaConfig(tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(path)
    build_tokenizer().save_pretrained(path)


# ------------------------------------------------------------------------------ one configuration


def overrides_for(shape: str, model_dir: str, backend: str, mb: int, seq: int, ckpt: bool, ref: bool,
                  gpu: bool, lb: int | None = None, chunk: int | None = None) -> list[str]:
    s = SHAPES[shape]
    half = seq // 2
    lb = lb or mb  # the minibatch: 2 micro-batches, or one logprob batch
    return [
        f"model.path={model_dir}", "model.name=bench", "model.family=llama",
        f"model.num_layers={s['num_hidden_layers']}", f"model.hidden_size={s['hidden_size']}",
        f"model.num_attention_heads={s['num_attention_heads']}", f"model.num_kv_heads={s['num_key_value_heads']}",
        f"model.ffn_hidden_size={s['intermediate_size']}", f"model.vocab_size={s['vocab_size']}",
        f"model.max_position_embeddings={s['max_position_embeddings']}",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        "cluster=local", f"cluster.gpus_per_node={1 if gpu else 0}",
        "cluster.gpu_memory_gib=null",  # measure every row, also those the pre-flight would refuse
        "rollout=vllm",  # no rollout=hf engine copy inside the policy worker: the policy alone is measured
        f"rollout.max_new_tokens={half}", f"env.max_prompt_tokens={half}",
        f"train.backend={backend}", f"train.precision={'bfloat16' if gpu else 'float32'}",
        f"train.micro_batch_size={mb}", f"train.logprob_batch_size={lb}",
        f"train.global_batch_size={max(2 * mb, lb)}", f"grpo.num_prompts_per_step={max(mb, lb // 2)}",
        *([f"train.logprob_chunk_tokens={chunk}"] if chunk is not None else []),
        f"train.max_total_sequence_length={seq}", f"train.activation_checkpointing={str(ckpt).lower()}",
        "train.lr=1e-6", "grpo.num_generations_per_prompt=2",
        f"loss.kl_coef={0.01 if ref else 0.0}", "logging.mlflow=false", "checkpoint.enabled=false",
        "name=h16-memory-bench", f"output_root={tempfile.gettempdir()}/h16-memory-bench",
    ]


def synthetic_batch(B: int, seq: int, vocab: int, seed: int = 0):
    import torch

    from grpo_launcher.batch import Generation, collate

    g = torch.Generator().manual_seed(seed)
    prompt = seq // 2
    ids = torch.randint(3, vocab, (B, seq), generator=g)
    gens = [Generation(ids[i, :prompt].tolist(), ids[i, prompt:].tolist(), [0.0] * (seq - prompt), False)
            for i in range(B)]
    return collate(gens, torch.randn(B, generator=g), torch.ones(B), pad_id=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(cfg: dict) -> dict:
    """Runs in its own process: build the spec and the worker, measure one update step."""
    import torch

    from grpo_launcher.policy import policy_class
    from grpo_launcher.policy.torch_policy import local_denominator
    from grpo_launcher.spec.compose import load_spec

    from grpo_launcher.spec.compose import compose, to_spec
    from grpo_launcher.spec.errors import ConfigError

    unvalidated = False
    try:
        spec = load_spec(cfg["overrides"])
    except ConfigError as err:  # a rule unrelated to memory must not cost the measurement: say so, go on
        print(err.render(), file=sys.stderr, flush=True)
        spec, unvalidated = to_spec(compose(cfg["overrides"])), True
    cuda = torch.cuda.is_available() and cfg["gpu"]
    t0 = time.perf_counter()
    worker = policy_class(spec.train.backend.value)(spec, cfg["model_dir"], 0, 1)
    worker.init_distributed("127.0.0.1", free_port())
    init_s = time.perf_counter() - t0
    batch = synthetic_batch(spec.train.global_batch_size, spec.train.max_total_sequence_length,
                            spec.model.vocab_size)
    den = local_denominator(spec.loss.aggregation.value, batch.response_mask * batch.sample_mask[:, None])
    out: dict = {"init_s": round(init_s, 1), **({"spec_unvalidated": True} if unvalidated else {})}

    def step() -> tuple[float, float]:
        t = time.perf_counter()
        prev, ref = worker.logprobs(batch)
        t_lp = time.perf_counter() - t
        if cuda:  # the logprob phase's own peak (the counters were reset before the measured step)
            out["lp_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        b = batch.with_(prev_logprobs=prev + 0.01 * torch.randn(prev.shape), ref_logprobs=ref)
        t = time.perf_counter()
        worker.update([b], [den])
        return t_lp, time.perf_counter() - t

    if cuda:
        step()  # warm-up: the optimizer states exist from here on (the steady state)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t_lp, t_up = step()
    else:  # CPU: no allocator counters; the profiler's allocation events (from before the warm-up, so that the
        # gradients and optimizer states it allocates are seen freed and re-made) give the peak above the
        # resident state of the measured step
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
            with record_function("measured_step"):
                t_lp, t_up = step()
        kin = prof.profiler.kineto_results.events()
        mark = next(e for e in kin if e.name() == "measured_step")
        events = sorted((e.start_ns(), e.nbytes()) for e in kin if e.name() == "[memory]")
        level = sum(n for t, n in events if t < mark.start_ns())
        cur, peak = level, level
        for t, n in events:
            if t >= mark.start_ns():
                cur += n
                peak = max(peak, cur)
        out["dynamic_mib"] = (peak - level) / 2**20
    out.update(logprobs_s=round(t_lp, 2), update_s=round(t_up, 2))
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out.update(alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                   reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                   outside_gib=(total - free - torch.cuda.memory_reserved()) / 2**30,
                   device_total_gib=total / 2**30, gpu=torch.cuda.get_device_name(0))
    return out


def predict(overrides: list[str], device_gib: float | None) -> dict:
    from dataclasses import replace

    from grpo_launcher.spec.compose import compose, to_spec
    from grpo_launcher.preflight.memory_estimate import CUDA_CONTEXT_GIB, estimate

    spec = to_spec(compose(overrides))
    spec = replace(spec, cluster=replace(spec.cluster, gpu_memory_gib=device_gib))
    e = estimate(spec)
    p = e.policy
    dynamic = max(sum(p[k].bytes for k in ("autocast copies", "activations", "activation work", "logits") if k in p),
                  (e.phases["logprobs"] - e.phases["generate"]) * 2**30)
    return {"alloc_gib": e.policy_alloc_gib, "reserved_gib": e.policy_reserved_gib, "phase": e.policy_phase,
            "dynamic_mib": dynamic / 2**20,
            "phases": e.phases, "context_gib": CUDA_CONTEXT_GIB if spec.cluster.gpus_per_node else 0.0}


# ------------------------------------------------------------------------------ the driver


def verdict(pred: float, meas: float | None) -> str:
    if meas is None or meas <= 0:
        return "n/a"
    err = pred / meas - 1
    return f"{100 * err:+.1f} % {'ok' if -0.05 <= err <= 0.15 else 'OUT'}"


def table(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| # | backend | micro | seq | ckpt | ref | predicted alloc GiB | measured max_allocated GiB | err "
             "| predicted reserved GiB | measured max_reserved GiB | err | outside torch GiB (pred / meas) "
             "| predicted peak phase | step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        m, p = r.get("measured") or {}, r["predicted"]
        ma, mr = m.get("alloc_gib"), m.get("reserved_gib")
        f = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
        status = r.get("error")
        lines.append(
            f"| {i} | {r['backend']} | {r['micro']} | {r['seq']} | {'on' if r['ckpt'] else 'off'} "
            f"| {'yes' if r['ref'] else 'no'} | {p['alloc_gib']:.2f} | {f(ma) if not status else status} "
            f"| {verdict(p['alloc_gib'], ma)} | {p['reserved_gib']:.2f} | {f(mr)} | {verdict(p['reserved_gib'], mr)} "
            f"| {p['context_gib']:.2f} / {f(m.get('outside_gib'))} | {p['phase']} "
            f"| {m.get('update_s', '—')} |")
    return "\n".join(lines)


def cpu_table(rows: list[dict]) -> str:
    """CPU smoke: the memory above the resident state (activations, work, logits), profiler vs prediction."""
    lines = ["CPU check (fp32 torch / bf16-or-fp32 megatron as the spec says; the CPU workers keep no GPU-layout "
             "optimizer, so only the dynamic part compares): peak allocated above the resident state during "
             "logprobs + one update, torch.profiler memory events vs preflight/memory_estimate.py.", "",
             "| # | backend | micro | seq | ref | predicted dynamic MiB | measured dynamic MiB | err |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        m = (r.get("measured") or {}).get("dynamic_mib")
        pd = r["predicted"]["dynamic_mib"]
        err = "n/a" if not m else f"{100 * (pd / m - 1):+.1f} %"
        lines.append(f"| {i} | {r['backend']} | {r['micro']} | {r['seq']} | {'yes' if r['ref'] else 'no'} "
                     f"| {pd:.1f} | {'—' if m is None else f'{m:.1f}'} | {err} |")
    return "\n".join(lines)


def run_child(cfg: dict, env: dict, timeout: int) -> dict:
    """One configuration in a fresh process; its RESULT line, or {"error": ...}."""
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env, text=True,
                           capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s"}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[-1][7:]) if line else {"error": f"no result (rc {p.returncode})"}
    if not line or "error" in res:
        log(p.stderr[-3000:])
    return res


def logprob_table(shape: str, model_dir: Path, gpu: bool, env: dict, timeout: int) -> str:
    """The logprob pass's peak (measured from a reset before it) vs the pre-flight's logprobs phase, per chunk."""
    lines = ["| micro | seq | logprob batch | train.logprob_chunk_tokens | predicted logprobs phase GiB "
             "(of it: logprob logits) | measured peak of the pass GiB | err | logprob pass s |",
             "|---|---|---|---|---|---|---|---|"]
    for mb, seq, lb, chunk in LOGPROB_CONFIGS:
        ov = overrides_for(shape, str(model_dir), "torch", mb, seq, False, False, gpu, lb=lb, chunk=chunk)
        res = run_child({"overrides": ov, "model_dir": str(model_dir), "gpu": gpu}, env, timeout)
        from grpo_launcher.spec.compose import compose, to_spec
        from grpo_launcher.preflight.memory_estimate import estimate

        e = estimate(to_spec(compose(ov)))
        pred, logits = e.phases["logprobs"], e.policy["logprob logits"].bytes / 2**30
        meas = res.get("lp_alloc_gib")
        lines.append(f"| {mb} | {seq} | {lb} | {chunk} | {pred:.2f} ({logits:.2f}) | "
                     f"{res.get('error') or f'{meas:.2f}' if meas is not None else '—'} | {verdict(pred, meas)} "
                     f"| {res.get('logprobs_s', '—')} |")
        log(lines[-1])
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here too")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (no measurement): the code path")
    ap.add_argument("--model-dir", help="reuse a checkpoint built by an earlier run")
    ap.add_argument("--only", help="comma-separated row numbers (1-based) to run")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per configuration")
    ap.add_argument("--predict-only", action="store_true", help="the predicted side only (no model, no run)")
    ap.add_argument("--logprob-rows", action="store_true",
                    help="instead of the rows above: the logprob phase's peak, whole vs chunked logits (torch)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--make-model", nargs=3, metavar=("SHAPE", "DIR", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_model:
        make_model(args.make_model[0], Path(args.make_model[1]), args.make_model[2])
        return 0
    if args.child:
        cfg = json.loads(args.child)
        try:
            res = child(cfg)
        except Exception as exc:  # noqa: BLE001  (reported in the table, the run goes on)
            import traceback

            traceback.print_exc()
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            res = {"error": "OOM" if "out of memory" in msg.lower() else msg}
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    t_start = time.time()
    gpu = not args.cpu_smoke
    shape = "1b" if gpu else "tiny"
    configs = GPU_CONFIGS if gpu else CPU_CONFIGS
    if args.only:
        keep = {int(x) for x in args.only.split(",")}
        configs = [c for i, c in enumerate(configs, 1) if i in keep]
    if args.predict_only:
        rows = [{"backend": b, "micro": mb, "seq": seq, "ckpt": ck, "ref": rf,
                 "predicted": predict(overrides_for(shape, "/nonexistent", b, mb, seq, ck, rf, gpu), None),
                 "error": "not run"} for b, mb, seq, ck, rf in configs]
        text = table(rows, f"Predicted only (preflight/memory_estimate.py), model {shape}: run without --predict-only "
                           "to measure.")
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               CUDA_DEVICE_MAX_CONNECTIONS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", NCCL_NVLS_ENABLE="0", PYTHONWARNINGS="ignore")
    if not gpu:
        env.setdefault("GRPO_MEGATRON_CPU_SHIM", "1")  # megatron-core on CPU (policy/megatron_cpu.py)
        env["CUDA_VISIBLE_DEVICES"] = ""
    tmp = Path(tempfile.mkdtemp(prefix="h16-memory-"))
    model_dir = Path(args.model_dir) if args.model_dir else tmp / f"llama-{shape}"
    if not (model_dir / "config.json").exists():
        t = time.time()
        subprocess.run([sys.executable, __file__, "--make-model", shape, str(model_dir), "cuda" if gpu else "cpu"],
                       env=env, check=True, timeout=240)
        log(f"model {shape} built in {time.time() - t:.0f} s: {model_dir}")
    if args.logprob_rows:
        text = logprob_table(shape, model_dir, gpu, env, args.timeout)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    device_gib = None
    rows = []
    for backend, mb, seq, ckpt, ref in configs:
        ov = overrides_for(shape, str(model_dir), backend, mb, seq, ckpt, ref, gpu)
        row = {"backend": backend, "micro": mb, "seq": seq, "ckpt": ckpt, "ref": ref,
               "overrides": ov}
        if time.time() - t_start > TIME_BUDGET_S:
            row.update(predicted=predict(ov, device_gib), error="skipped (time budget)")
            rows.append(row)
            continue
        t = time.time()
        cfg = {"overrides": ov, "model_dir": str(model_dir), "gpu": gpu}
        try:
            p = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env, text=True,
                               capture_output=True, timeout=args.timeout)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(line[-1][7:]) if line else {"error": f"no result (rc {p.returncode})"}
            if not line or "error" in res:
                log(p.stderr[-3000:])
        except subprocess.TimeoutExpired:
            res = {"error": f"timeout {args.timeout}s"}
        if "device_total_gib" in res:
            device_gib = res["device_total_gib"]
        row["measured"] = None if "error" in res else res
        if "error" in res:
            row["error"] = res["error"]
        row["predicted"] = predict(ov, device_gib)
        rows.append(row)
        m = row["measured"] or {}
        log(f"{backend:8s} mb {mb} seq {seq} ckpt {ckpt!s:5} ref {ref!s:5}: predicted "
            f"{row['predicted']['alloc_gib']:.2f} GiB, measured {m.get('alloc_gib', res.get('error'))} "
            f"({time.time() - t:.0f} s)")
    gpu_name = next((r["measured"]["gpu"] for r in rows if r.get("measured") and "gpu" in r["measured"]),
                    "CPU (smoke: nothing measured)")
    header = (f"Memory pre-flight calibration: {gpu_name}, model {shape} "
              f"({SHAPES[shape]['num_hidden_layers']} layers, hidden {SHAPES[shape]['hidden_size']}), "
              f"minibatch = 2 micro-batches, rows = seq tokens (half prompt, half response), bf16 on GPU. "
              f"Total {time.time() - t_start:.0f} s.")
    text = table(rows, header)
    if not gpu:
        text += "\n\n" + cpu_table(rows)
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
