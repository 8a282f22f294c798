"""Side by side on one GPU: our full GRPO step through `launch.py` vs TRL GRPOTrainer, same work.

Same model shape (1.21B: 24 layers, hidden 2048, 16/4 heads, FFN 5632, vocab 32000, untied; Qwen2 family on
both sides), same batch (8 prompts x 8 generations, prompt 1536 tokens + 512 new, micro-batch 4), same
precision (fp32 master weights + bf16 compute), random weights (speed only). Ours runs as a user runs it:
`python launch.py ... cluster.gpus_per_node=1` (Ray, the hybrid HF engine, the policy workers), and its
per-phase times are read from RUN_DIR/metrics.jsonl. Its reward is a seeded random draw per completion
(workload_shapes.varied_reward): with equal rewards in every group (env=math's grader on a random model) a step
takes no optimizer step (since cf31336) and the update would be its forward alone; TRL steps whatever the rewards.
TRL runs the harness in ../shared/peers/trl (trl_grpo_gpu.py, carried into the kit with its wheels); `trl-vllm`
is TRL with its own vLLM engine colocated (benchmarks/trl_vllm.py, TRL's wheels beside the kit's vLLM). The other
shapes of the workload matrix: benchmarks/workloads.py.

    python benchmarks/gpu_step.py --steps 4 --trl-dir .gpu-kit/trl --trl-wheels .gpu-kit/trlwhl --out OUT
    python benchmarks/gpu_step.py --only ours-torch,ours-megatron      # a subset
    python benchmarks/gpu_step.py --only ours-torch,ours-vllm-torch,ours-vllm-megatron   # HF engine vs vLLM
    python benchmarks/gpu_step.py --only ours-vllm-torch,trl,trl-vllm   # both engines on each side

    python benchmarks/gpu_step.py --worker --out OUT      # the torch worker alone: before/after per change, packing
    python benchmarks/gpu_step.py --worker --fsdp --out OUT   # ... one GPU: replicated vs FSDP2 vs FSDP2 + offload

`ours-vllm-<backend>` rows: `rollout=vllm` (vLLM's CUDA build, an engine actor beside the policy on the same GPU,
CUDA graphs on: rollout.enforce_eager=false), refit over CUDA IPC (rollout/vllm_compat.py).

Update-phase tokens/s = 64 x (1536 + mean generated length) / update seconds; MFU = 6 N tokens / s / peak,
peak = a measured 8192^3 bf16 matmul (as the TRL harness measures it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from workload_shapes import SHAPES, Workload, n_params, startup_seconds  # noqa: E402

PROMPT_HEAVY = SHAPES["prompt-heavy"]  # this script's shape: 1.21B, 8 x 8 x (1536 + 512), micro-batch 4
SHAPE = PROMPT_HEAVY.model
PROMPT, NEW, PROMPTS, GENS, MICRO = (PROMPT_HEAVY.prompt, PROMPT_HEAVY.new, PROMPT_HEAVY.prompts, PROMPT_HEAVY.gens,
                                     PROMPT_HEAVY.micro)
REWARD = f"{ROOT}/benchmarks/workload_shapes.py:varied_reward"  # every group varies: the update runs in full


def write_prompts(path: Path, n: int, seed: int = 0, prompt: int = PROMPT) -> None:
    """Questions of exactly `prompt` byte-tokens (the tiny model's tokenizer is one token per byte)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"question": "".join(rng.choice("abcdefgh ") for _ in range(prompt)),
                                "answer": "0"}) + "\n")


def save_model(out: Path, shape: dict, device: str | None = None) -> Path:
    """The random model of a workload's shape (model.* keys) in bf16 on disk, with our byte tokenizer: what
    workloads.py's rows load (ours through model.path; vLLM loads a path; TRL loads it again in fp32 to train).
    Built on `device` (default: CUDA if there is one)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_launcher.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.model_max_length = shape["max_position_embeddings"]
    cfg = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                      intermediate_size=shape["ffn_hidden_size"], num_hidden_layers=shape["num_layers"],
                      num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_kv_heads"],
                      max_position_embeddings=shape["max_position_embeddings"],
                      tie_word_embeddings=shape.get("tie_word_embeddings", False),
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_name(backend: str, separate_logprobs: bool, vllm: bool = False) -> str:
    return f"bench-{'vllm-' if vllm else ''}{backend}{'-sep' if separate_logprobs else ''}"


def ours_overrides(backend: str, steps: int, data: Path, out: Path, separate_logprobs: bool,
                   profile: bool = False, vllm: bool = False, w: Workload = PROMPT_HEAVY,
                   model_path: Path | None = None) -> list[str]:
    """launch.py's arguments for workload w (a GPU run: bf16 autocast over fp32 master weights; w.gpus=0: CPU):
    the model built from its model.* keys, or read from model_path (save_model's checkpoint of the same shape)."""
    model = [f"model.path={model_path}"] if model_path else [
        *(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in w.model.items()),
        "model.warm_start_steps=0"]
    gbs = w.sequences // (2 if separate_logprobs else 1)  # 2 optimizer steps force the separate pass
    return [
        f"name={run_name(backend, separate_logprobs, vllm)}", f"output_root={out}", "checkpoint.resume=fresh",
        *(["rollout=vllm", "rollout.enforce_eager=false"] if vllm else []),
        *([f"rollout.gpu_memory_utilization={w.vllm_memory}"] if vllm and w.vllm_memory is not None else []),
        *model, "env=math", f"env.reward_fn={REWARD}", f"env.train_path={data}", f"env.val_path={data}",
        f"env.max_prompt_tokens={w.prompt}",
        f"rollout.max_new_tokens={w.new}", f"train.max_total_sequence_length={w.prompt + w.new}",
        f"grpo.num_prompts_per_step={w.prompts}", f"grpo.num_generations_per_prompt={w.gens}",
        f"train.global_batch_size={gbs}", f"train.micro_batch_size={w.micro}",
        f"train.logprob_batch_size={w.micro * 2}", *(["train.precision=bfloat16"] if w.gpus else []),
        "train.lr=1e-6", f"train.backend={backend}", f"cluster.gpus_per_node={w.gpus}",
        f"grpo.max_steps={steps}", "grpo.val_period=0", "grpo.val_at_end=false", "checkpoint.enabled=false",
        "logging.mlflow=false", *([f"logging.profile_step={steps}"] if profile else []),
    ]


def run_ours(name: str, backend: str, args, data: Path, separate: bool, vllm: bool = False,
             w: Workload = PROMPT_HEAVY, env: dict | None = None, model_path: Path | None = None) -> dict:
    """`python launch.py ...` for workload w, its per-phase medians over steps skip+1..steps from metrics.jsonl,
    and its start-up line (process start -> end of step 1)."""
    steps = args.steps + (1 if args.profile else 0)  # the profiled step comes last, outside the medians
    cmd = [sys.executable, str(ROOT / "launch.py"),
           *ours_overrides(backend, steps, data, args.out, separate, profile=args.profile, vllm=vllm, w=w,
                           model_path=model_path)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, env=env)
    wall = time.time() - t0
    (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-6000:], flush=True)
        return {"name": name, "error": f"exit {proc.returncode}"}
    run_dir = args.out / run_name(backend, separate, vllm)
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    steady = [rows[s] for s in sorted(rows) if args.skip < s <= args.steps]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in steady)  # noqa: E731
    gen_len = med("train/gen_len_mean")
    tokens = w.sequences * (w.prompt + gen_len)
    phases = {p: med(f"time/{p}_s") for p in ("rollout", "logprobs", "update", "refit", "step")}
    return {"name": name, "wall_s": wall, "gen_len": gen_len, "phases": phases,
            "update_tok_s": tokens / phases["update"],
            "logprob_tok_s": tokens / phases["logprobs"] if phases["logprobs"] else None,
            "gen_tok_s": w.sequences * gen_len / phases["rollout"],
            "lp_absdiff": med("train/gen_vs_policy_logprob_absdiff"),
            "first_step_s": rows[min(rows)]["time/step_s"], "profile": read_profile(run_dir, steps, args.profile),
            "startup_s": startup_seconds(proc.stdout + proc.stderr),
            "refit_parts": {p: med(f"time/refit_{p}_ms") for p in REFIT_PARTS if f"time/refit_{p}_ms" in steady[-1]}}


REFIT_PARTS = ("start", "pack", "load", "finish", "engine")  # time/refit_<part>_ms (tracking/metric_names.py)


def read_profile(run_dir: Path, step: int, on: bool) -> dict:
    path = run_dir / "profile" / f"step_{step}" / "rank_0" / "rank_0.json"
    return json.loads(path.read_text()) if on and path.exists() else {}


def run_trl(args) -> dict:
    out = args.out / "trl"
    cmd = ["bash", str(args.trl_dir / "run_gpu.sh"), str(args.trl_wheels), str(out), "--arch", "qwen2",
           "--param-dtype", "fp32", "--steps", str(args.steps), "--skip", str(args.skip)]
    return peer_row("trl", cmd, out, os.environ)


def run_trl_vllm(args, w: Workload = PROMPT_HEAVY, model_path: Path | None = None) -> dict:
    """TRL with its colocated vLLM engine (benchmarks/trl_vllm.py --shape w.name [--model model_path]), TRL's
    wheels installed beside the kit's vLLM."""
    site = Path("/tmp/site-trl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, sorted(args.trl_wheels.glob("*.whl")))], check=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    out = args.out / "trl-vllm"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_vllm.py"), "--steps", str(args.steps),
           "--skip", str(args.skip), "--out", str(out), "--shape", w.name,
           "--micro", str(w.micro), *(["--model", str(model_path)] if model_path else [])]
    return peer_row("trl-vllm", cmd, out, env)


def peer_row(name: str, cmd: list[str], out: Path, env) -> dict:
    proc = subprocess.run(cmd, text=True, capture_output=True, env=env)
    log = out.parent / f"{name}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-6000:], flush=True)
        return {"name": name, "error": f"exit {proc.returncode} (log: {log})"}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {"name": name, "summary": summary, "log_tail": proc.stdout[-2500:]}


# --worker: the update and the logprob pass of the policy worker alone (no Ray, no rollout), before/after each change
# of issue 29 in one process, and packed vs unpacked on long-tailed lengths (issue 26). (label, overrides,
# weight casts kept over a step, Liger kernels, long-tailed batch)
WORKER_ROWS = [
    ("before: whole logits, casts per micro-batch", ["train.logprob_chunk_tokens=0"], False, False, False),
    ("chunked logits", [], False, False, False),
    ("chunked + casts once per step", [], True, False, False),
    ("+ train.fused_kernels (Liger RMSNorm/SwiGLU/RoPE)", [], True, True, False),
    ("long-tailed lengths, unpacked", [], True, True, True),
    ("long-tailed lengths, train.sequence_packing=true", ["train.sequence_packing=true"], True, True, True),
]
# --fsdp (issue 26): today's one-GPU path (the plain module, autocast) vs FSDP2 on the same one GPU (no spec key asks
# for it on one rank: fsdp.shard applied here, as init_distributed applies it over several) vs train.cpu_offload
FSDP_ROWS = [
    ("replicated (one rank: the plain module, autocast)", [], True, True, False),
    ("FSDP2 on one GPU (fully_shard at world 1)", ["FSDP2"], True, True, False),
    ("FSDP2 + train.cpu_offload (shards, grads, AdamW on the host)", ["train.cpu_offload=true"], True, True, False),
]


def bench_batch(long_tail: bool, vocab: int, seed: int = 0):
    """64 rows: prompt 1536 + 512 new (the launch.py rows' shape), or long-tailed: prompts 128-512, responses
    lognormal (median ~154, capped at 1536), so that a padded batch is mostly padding."""
    import math

    import torch

    from grpo_launcher.batch import Generation, collate

    rng = random.Random(seed)
    gens = []
    for _ in range(PROMPTS * GENS):
        p, n = (rng.randint(PROMPT // 12, PROMPT // 3),
                min(PROMPT, max(8, int(math.exp(rng.gauss(math.log(PROMPT / 10), 1.0)))))) if long_tail \
            else (PROMPT, NEW)
        ids = [rng.randrange(3, vocab) for _ in range(p + n)]
        gens.append(Generation(ids[:p], ids[p:], [0.0] * n, False))
    return collate(gens, torch.randn(len(gens)), torch.ones(len(gens)), pad_id=0)


def worker_rows(args, peak: float) -> list[dict]:
    import gc
    from contextlib import nullcontext

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_gpu as mg

    from grpo_launcher.algos import local_denominator
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker
    from grpo_launcher.spec.compose import compose, to_spec

    model_dir = args.out / "llama-1b"
    if not (model_dir / "config.json").exists():
        mg.make_model("1b", model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    base = [o for o in mg.overrides_for("1b", str(model_dir), "torch", MICRO, PROMPT + NEW, False, False, True,
                                        lb=2 * MICRO) if not o.startswith(("rollout.max_new", "env.max_prompt"))]
    base += [f"rollout.max_new_tokens={NEW}", f"env.max_prompt_tokens={PROMPT}"]
    rows = []
    for label, extra, kept, liger, long_tail in FSDP_ROWS if args.fsdp else WORKER_ROWS:
        if torch.distributed.is_initialized():  # the last FSDP row's one-rank group
            torch.distributed.destroy_process_group()
        cpu = [] if torch.cuda.is_available() else ["cluster.gpus_per_node=0"]  # a CPU smoke run of the code
        overrides = [o for o in extra if o != "FSDP2"]
        spec = to_spec(compose([*base, *overrides, *cpu, f"train.fused_kernels={str(liger and not cpu).lower()}"]))
        try:
            w = TorchPolicyWorker(spec, str(model_dir), 0, 1)
            if "FSDP2" in extra or w.sharded:
                one_rank_fsdp(w, force="FSDP2" in extra)
        except Exception as exc:  # noqa: BLE001  (e.g. Liger absent: the row says so, the others run)
            rows.append({"row": label, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        if not kept:
            w._weight_casts_kept = nullcontext  # type: ignore[method-assign]  (today's: a cast per micro-batch)
        b = bench_batch(long_tail, spec.model.vocab_size).to(w.device)
        tokens = float(b.attention_mask.sum())
        den = local_denominator(spec.loss.aggregation.value, b.response_mask)
        n = sum(p.numel() for p in w.model.parameters())
        times: dict[str, list[float]] = {"logprobs": [], "update": []}
        for rep in range(3):  # the first: warm-up (optimizer states, kernels)
            if rep == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            prev, _ = w.logprobs(b)
            torch.cuda.synchronize()
            lp_s = time.perf_counter() - t
            lp_peak = torch.cuda.max_memory_allocated() / 2**30
            t = time.perf_counter()
            w.update([b.with_(prev_logprobs=prev.to(w.device))], [den])
            torch.cuda.synchronize()
            if rep:
                times["logprobs"].append(lp_s)
                times["update"].append(time.perf_counter() - t)
        up, lp = statistics.median(times["update"]), statistics.median(times["logprobs"])
        rows.append({"row": label, "tokens": tokens, "update_s": up, "update_tok_s": tokens / up,
                     "update_mfu": 100 * 6 * n * tokens / up / (peak * 1e12), "logprobs_s": lp,
                     "logprob_mfu": 100 * 2 * n * tokens / lp / (peak * 1e12), "logprob_peak_gib": lp_peak,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(json.dumps(rows[-1]), flush=True)
        del w, prev
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def one_rank_fsdp(w, force: bool) -> None:
    """A one-rank process group and the worker's own FSDP2 set-up (train.cpu_offload: init_distributed does it);
    force: shard the plain module in place (fsdp.shard) and rebuild the optimizer over the shards."""
    import socket

    import torch

    from grpo_launcher.policy import fsdp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if not force:
        w.init_distributed("127.0.0.1", port)
        return
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                         init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    w.sharded, w.autocast = True, False
    fsdp.shard(w.model, w.bf16)
    w._build_optimizer()


def worker_markdown(rows: list[dict], peak: float) -> str:
    out = ["| worker, 1.21B, 64 rows, micro-batch 4, logprob batch 8 | real tokens | update | update MFU "
           "| logprob pass | logprob MFU | peak of the logprob pass | peak |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['row']} | {r['error']} | | | | | | |")
            continue
        out.append(f"| {r['row']} | {r['tokens']:,.0f} | {r['update_s']:.2f} s, {r['update_tok_s']:,.0f} tok/s "
                   f"| {r['update_mfu']:.1f} % | {r['logprobs_s']:.2f} s | {r['logprob_mfu']:.1f} % "
                   f"| {r['logprob_peak_gib']:.1f} GiB | {r['peak_gib']:.1f} GiB |")
    return "\n".join(out) + f"\n\nbf16 matmul peak {peak:.0f} TFLOP/s; MFU = 6 N (update) or 2 N (logprob pass) " \
        "x real tokens / s / peak; medians of 2 after a warm-up.\n"


def matmul_peak(device: str = "cuda", size: int = 8192) -> float:
    """TFLOP/s of a size^3 matmul: bf16 on a GPU; on device="cpu" (a smoke run) fp32."""
    import torch

    x = torch.randn(size, size, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        x @ x
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        x @ x
    sync()
    return 2 * size ** 3 * 10 / (time.perf_counter() - t0) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    ap.add_argument("--only", default="ours-torch,ours-megatron,ours-megatron-sep,trl")
    ap.add_argument("--trl-dir", type=Path, default=ROOT / ".gpu-kit" / "trl")
    ap.add_argument("--trl-wheels", type=Path, default=ROOT / ".gpu-kit" / "trlwhl")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu-step"))
    ap.add_argument("--profile", action="store_true",
                    help="ours: one more step under logging.profile_step (kernel classes per phase), not in the medians")
    ap.add_argument("--worker", action="store_true",
                    help="instead: the torch worker's update and logprob pass alone, per change (WORKER_ROWS)")
    ap.add_argument("--fsdp", action="store_true",
                    help="with --worker: one GPU, replicated vs FSDP2 vs FSDP2 + train.cpu_offload (FSDP_ROWS)")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "prompts.jsonl"
    write_prompts(data, 256)
    peak = matmul_peak()
    print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    if args.worker:
        text = worker_markdown(worker_rows(args, peak), peak)
        (args.out / "worker.md").write_text(text)
        print(text, flush=True)
        return 0
    results = []
    for name in args.only.split(","):
        print(f"--- {name}", flush=True)
        if name in PEERS:
            results.append(PEERS[name](args))
        else:
            parts = name.split("-")  # ours-<backend>[-sep] or ours-vllm-<backend>[-sep]
            vllm = parts[1] == "vllm"
            backend = parts[2] if vllm else parts[1]
            results.append(run_ours(name, backend, args, data, separate=name.endswith("-sep"), vllm=vllm))
        print(json.dumps(results[-1], indent=1, default=str)[:3000], flush=True)
        (args.out / "results.json").write_text(json.dumps({"peak_tflops": peak, "results": results}, indent=1))
        (args.out / "results.md").write_text(markdown(results, peak))  # after each run: a timeout keeps the rest
    print((args.out / "results.md").read_text(), flush=True)
    return 0


PEERS = {"trl": run_trl, "trl-vllm": run_trl_vllm}


def markdown(results: list[dict], peak: float) -> str:
    """The side-by-side table: each of ours, each peer (TRL with HF generate, TRL with its colocated vLLM), and
    ours / peer (the peer's time over ours: > 1 means we are faster)."""
    ours = [r for r in results if r["name"] not in PEERS and "error" not in r]
    peers = [(r["name"], r["summary"]) for r in results if r["name"] in PEERS and r.get("summary")]
    mfu = lambda tok_s: 100 * 6 * n_params(SHAPE) * tok_s / (peak * 1e12)  # noqa: E731
    head = "| | " + " | ".join([r["name"] for r in ours] + [name for name, _ in peers] + [
        f"{r['name']} / {name}" for name, _ in peers for r in ours]) + " |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]

    def row(label, vals, peer_val, ratio=None):
        cells = vals + [peer_val(t) for _, t in peers] + [ratio(r, t) if ratio else "" for _, t in peers for r in ours]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    ph = lambda r, k: r["phases"][k]  # noqa: E731
    row("full step", [f"{ph(r, 'step'):.2f} s" for r in ours], lambda t: f"{t['median_step_s']:.2f} s",
        lambda r, t: f"{t['median_step_s'] / ph(r, 'step'):.2f}x")
    row("rollout", [f"{ph(r, 'rollout'):.2f} s, {r['gen_tok_s']:,.0f} tok/s" for r in ours],
        lambda t: f"{t['median_rollout_s']:.2f} s", lambda r, t: f"{t['median_rollout_s'] / ph(r, 'rollout'):.2f}x")
    row("separate logprob pass", [f"{ph(r, 'logprobs'):.2f} s, {mfu(r['logprob_tok_s']) / 3:.1f} % MFU"
                                  if r["logprob_tok_s"] else "none (from the update)" for r in ours],
        lambda t: "in the update" if "median_refit_s" in t else "none")
    row("update", [f"{ph(r, 'update'):.2f} s, {r['update_tok_s']:,.0f} tok/s, {mfu(r['update_tok_s']):.1f} % MFU"
                   for r in ours],
        lambda t: f"{t['median_update_s']:.2f} s, {t['update_tokens_per_s']:,.0f} tok/s, "
                  f"{100 * t['update_mfu_6nd']:.1f} % MFU",
        lambda r, t: f"{r['update_tok_s'] / t['update_tokens_per_s']:.2f}x")
    row("refit", [f"{1e3 * ph(r, 'refit'):.1f} ms" for r in ours],
        lambda t: f"{1e3 * t['median_refit_s']:.1f} ms" if "median_refit_s" in t else "n/a (same model)")
    row("engine vs policy logprob |Δ|", [f"{r.get('lp_absdiff', 0.0):.4f}" for r in ours], lambda t: "")
    row("first step", [f"{r['first_step_s']:.1f} s" for r in ours],
        lambda t: f"{t['time_to_first_step_s']:.1f} s" if t.get("time_to_first_step_s") is not None else "")
    failed = [f"{r['name']}: {r['error']}" for r in results if "error" in r]
    return "\n".join(rows) + f"\n\nbf16 matmul peak {peak:.0f} TFLOP/s; MFU = 6 N tokens / s / peak " \
        f"(N = {n_params(SHAPE):,}; a forward-only pass counts 2 N, hence / 3). trl-vllm's update is the step less " \
        "its generate and weight push (benchmarks/trl_vllm.py).\n" + "".join(f"\nfailed: {f}" for f in failed)

if __name__ == "__main__":
    sys.exit(main())
