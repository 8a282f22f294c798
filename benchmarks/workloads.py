"""The workload matrix (issue 41): one command per shape, ours (both backends, through `launch.py`) vs TRL
GRPOTrainer with its colocated vLLM, on one GPU.

Shapes (benchmarks/workload_shapes.py SHAPES; random weights, speed only, fp32 master weights + bf16 on both sides):

- prompt-heavy: gpu_step.py's work, 1.21B Qwen2, 8 prompts x 8 generations, 1536 prompt + 512 new tokens.
- decode-heavy: Qwen2.5-1.5B's shape (tied), 32 x 8 = 256 completions of 1024 new tokens after 256 prompt tokens,
  vLLM at TRL's default memory share (0.3) on both sides.
- long-context: the same 1.5B shape, 4 x 8 sequences of 7168 prompt + 1024 new = 8,192 tokens, vLLM at 0.3.

Rows: `ours-vllm-<backend>` is `python launch.py rollout=vllm rollout.enforce_eager=false train.backend=<backend>
cluster.gpus_per_node=1 model.path=OUT/<shape>/model ...` exactly as a user runs it (gpu_step.ours_overrides; the
checkpoint is the shape's random model in bf16 with our byte tokenizer, gpu_step.save_model: model.path=null builds
untied models only); its per-phase times are the medians of steps skip+1..steps in RUN_DIR/metrics.jsonl, its
start-up the launcher's own line ("start-up X s to the end of step 1", from the process's start). Its reward is a
seeded random draw per completion (workload_shapes.varied_reward), so that every step takes its optimizer step.
`ours-<backend>` (no vllm) is the HF engine. `trl-vllm` is benchmarks/trl_vllm.py --shape <shape> --model <the same
checkpoint> (TRL's wheels installed beside the kit's vLLM, as gpu_step.py does).

Per row: full step, rollout, update (ours: logprob + update phases; TRL: the step less its generate and weight
push), refit, process start -> end of step 1, tok/s per GPU (prompt + generated tokens of a step / step time /
every GPU the run holds), the rollout over the decode floor (workload_shapes.py: weight + live KV bytes per decode
step over --hbm-bytes-s, default the H200's 4.8e12 B/s) and the update MFU (6 N tokens / s over a bf16 8192^3
matmul measured in a child process). Output: OUT/<shape>/results.{md,json}, each row's log, its run directory and
the checkpoint beside them. A later command on the same OUT/<shape> replaces the rows it runs and keeps the others
(each row records its device and peak; --fresh starts over); --copy-to DIR copies the small files (table, logs,
metrics.jsonl, TRL's summary) there after each row.

On one H200 (pre-flight predicts 98-120 GiB a GPU for these shapes: not an H100), the GPU kit installed in
/tmp/site and TRL's four wheels in .gpu-kit/trlwhl (trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19;
../shared/peers/trl/README.md's pip download line; only the `trl-vllm` row needs them), VLLM_USE_FLASHINFER_SAMPLER=0
(the kit has no FlashInfer and TRL does not turn vLLM's sampler off; ours does):

    export PYTHONPATH=/tmp/site:$PWD/src VLLM_USE_FLASHINFER_SAMPLER=0
    python3 benchmarks/workloads.py --shape prompt-heavy --steps 3 --out /tmp/wl --copy-to $OUT/prompt-heavy
    python3 benchmarks/workloads.py --shape decode-heavy --steps 3 --out /tmp/wl --copy-to $OUT/decode-heavy
    python3 benchmarks/workloads.py --shape long-context --steps 3 --out /tmp/wl --copy-to $OUT/long-context
    python3 benchmarks/workloads.py --shape decode-heavy ... --only ours-vllm-megatron   # one row, into the table

On one H100 (79.6 GiB) only decode-heavy fits, at half its micro-batch on both sides: `--micro 2 --hbm-bytes-s
3.35e12` (results/workloads.md).

A row takes its start-up (~90-140 s for the 1.5B shape, issue 41) plus its steps; where a command may run only
10 minutes, run a shape's rows in two commands on the same warm machine (--only; the second adds its rows to the
first's table).

On a CPU (tiny model, cluster.gpus_per_node=0, the HF engine, 2 steps, no TRL; megatron through its CPU shim,
GRPO_MEGATRON_CPU_SHIM=1): the table is produced, its figures say nothing about a GPU:

    python benchmarks/workloads.py --cpu-smoke --out /tmp/workloads-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_step as gs  # noqa: E402
import workload_shapes as ws  # noqa: E402

GPU_ROWS = "ours-vllm-torch,ours-vllm-megatron,trl-vllm"
CPU_ROWS = "ours-torch,ours-megatron"


def run_row(name: str, w: ws.Workload, args, data: Path, model: Path) -> dict:
    """One row, on the shape's checkpoint `model`: trl-vllm, or ours-[vllm-]<backend> through launch.py."""
    if name == "trl-vllm":
        return gs.run_trl_vllm(args, w, model_path=model)
    parts = name.split("-")  # ours-<backend> or ours-vllm-<backend>
    vllm = parts[1] == "vllm"
    backend = parts[-1]
    env = {**os.environ, "GRPO_MEGATRON_CPU_SHIM": "1"} if backend == "megatron" and not w.gpus else None
    return gs.run_ours(name, backend, args, data, separate=False, vllm=vllm, w=w, env=env, model_path=model)


# the table's rows: (label, figure, its cell); a time's row also gets ours-vs-TRL ratio columns (TRL / ours: > 1 =
# ours faster)
ROWS = [
    ("full step", "step", lambda f: f"{f['step']:.2f} s"),
    ("rollout", "rollout", lambda f: f"{f['rollout']:.2f} s"),
    ("rollout / decode floor", None, lambda f: f"{f['rollout_over_floor']:.2f}x"),
    ("update", "update", lambda f: f"{f['update']:.2f} s, {100 * f['update_mfu']:.1f} % MFU"),
    ("refit", "refit", lambda f: f"{1e3 * f['refit']:.1f} ms"),
    ("refit's parts, ms (policy rank 0's waits; engine: its own)", None,
     lambda f: ", ".join(f"{k} {v:.1f}" for k, v in f.get("refit_parts", {}).items())),
    ("process start -> end of step 1", "startup",
     lambda f: f"{f['startup']:.1f} s" if f["startup"] is not None else "n/a"),
    ("tok/s per GPU (prompt + generated)", None, lambda f: f"{f['tok_s_per_gpu']:,.0f}"),
    ("generated tok/s per GPU", None, lambda f: f"{f['gen_tok_s_per_gpu']:,.0f}"),
    ("mean generated length", None, lambda f: f"{f['gen_len']:.1f}"),
    ("device", None, lambda f: f.get("device", "")),
]


def ratio(trl: dict, ours: dict, key: str | None) -> str:
    if key is None or not trl.get(key) or not ours.get(key):
        return ""
    return f"{trl[key] / ours[key]:.2f}x"


def markdown(w: ws.Workload, results: list[dict], bandwidth: float) -> str:
    ok = [r for r in results if "figures" in r]
    trl = next((r["figures"] for r in ok if r["name"] == "trl-vllm"), None)
    ours = [r for r in ok if r["name"] != "trl-vllm"] if trl else []
    n, floor = ws.n_params(w.model), ws.workload_decode_floor_s(w, bandwidth)
    head = [r["name"] for r in ok] + [f"trl-vllm / {r['name']}" for r in ours]
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    out = [f"### {w.name}: {size}, {w.prompts} x {w.gens} x ({w.prompt} + {w.new}), micro-batch {w.micro}",
           "", "| | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for label, key, cell in ROWS:
        cells = [cell(r["figures"]) for r in ok] + [ratio(trl, r["figures"], key) for r in ours]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    kind = "bf16" if w.gpus else "fp32 (CPU)"
    failed = "".join(f"\nfailed: {r['name']}: {r['error']}" for r in results if "error" in r)
    return "\n".join(out) + (
        f"\n\nN = {n:,}; decode floor {floor:.3g} s ({w.sequences} sequences, {w.new} decode steps, bf16 weights + "
        f"KV at {bandwidth:.3g} B/s); {kind} matmul peak {peaks(results)}; MFU = 6 N tokens / update s / peak; "
        f"{max(w.gpus, 1)} {'GPU' if w.gpus else 'CPU process (no GPU)'} per run; trl-vllm / ours: > 1 = ours "
        f"faster.\n{failed}")


def measured_peak() -> tuple[float, str]:
    """gpu_step.matmul_peak (bf16, 8192^3) in a child process, whose CUDA context and cached memory go with it;
    and the GPU's name."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import gpu_step, torch; "
            "print(torch.cuda.get_device_name().replace(' ', '_'), gpu_step.matmul_peak())")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks")], check=True, text=True,
                         capture_output=True).stdout.split()
    return float(out[-1]), out[-2].replace("_", " ")


def peaks(results: list[dict]) -> str:
    """Each device's measured peak, as its rows recorded it (rows of several commands: one entry each)."""
    seen = {(r["device"], round(r["peak_tflops"], 3)) for r in results if "peak_tflops" in r}
    return ", ".join(f"{p:.3g} TFLOP/s ({d})" for d, p in sorted(seen)) or "not measured"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(ws.SHAPES), default="decode-heavy")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny shape on CPU, the HF engine, no TRL")
    ap.add_argument("--only", default=None, help=f"rows, comma-separated (default {GPU_ROWS}; --cpu-smoke {CPU_ROWS})")
    ap.add_argument("--steps", type=int, default=None, help="default 4 (--cpu-smoke 2)")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    ap.add_argument("--hbm-bytes-s", type=float, default=ws.H200_HBM_BYTES_S, help="HBM bandwidth of the floor")
    ap.add_argument("--trl-wheels", type=Path, default=ROOT / ".gpu-kit" / "trlwhl")
    ap.add_argument("--out", type=Path, default=Path("/tmp/workloads"))
    ap.add_argument("--copy-to", type=Path, default=None,
                    help="after each row, copy the table, logs, metrics.jsonl and TRL's summary here (e.g. $OUT)")
    ap.add_argument("--micro", type=int, default=None,
                    help="train.micro_batch_size on both sides (default: the shape's; 2 fits decode-heavy on an H100)")
    ap.add_argument("--fresh", action="store_true", help="drop the rows an earlier command left in OUT/<shape>")
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.cpu_smoke else 4)
    args.only = args.only or (CPU_ROWS if args.cpu_smoke else GPU_ROWS)
    args.profile = False  # gpu_step.run_ours's option: no profiled step here
    return args


def main() -> int:
    args = parse_args()
    w = ws.CPU_SMOKE if args.cpu_smoke else ws.SHAPES[args.shape]
    w = dataclasses.replace(w, micro=args.micro or w.micro)
    args.out = (args.out / w.name).resolve()  # gpu_step's runs and logs land here
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "prompts.jsonl"
    gs.write_prompts(data, max(256, w.prompts * (args.steps + 1)), prompt=w.prompt)
    model = args.out / "model"
    if not (model / "config.json").exists():
        gs.save_model(model, w.model, device="cpu")  # no CUDA context in this process: the GPU is the rows'
    peak, device = measured_peak() if w.gpus else (max(gs.matmul_peak("cpu", 1024) for _ in range(5)), "cpu")
    print(f"{w.name}: matmul peak {peak:.1f} TFLOP/s on {device}", flush=True)
    names = args.only.split(",")
    results = [r for r in earlier_rows(args.out / "results.json", args.fresh) if r["name"] not in names]
    for name in names:
        print(f"--- {name}", flush=True)
        r = {**run_row(name, w, args, data, model), "peak_tflops": peak, "device": device}
        if "error" not in r and ("phases" in r or r.get("summary")):
            r["figures"] = {**ws.row_figures(r, w, peak, args.hbm_bytes_s), "device": device}
        results.append(r)
        print(json.dumps(r.get("figures", r), indent=1, default=str)[:2000], flush=True)
        text = markdown(w, results, args.hbm_bytes_s)  # after each row: a timeout keeps the rest
        (args.out / "results.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(
            {"shape": w.name, "workload": {**vars(w), "n_params": ws.n_params(w.model)},
             "hbm_bytes_s": args.hbm_bytes_s, "steps": args.steps, "skip": args.skip, "results": results},
            indent=1, default=str))
        if args.copy_to:
            copy_small_files(args.out, args.copy_to)
    print((args.out / "results.md").read_text(), flush=True)
    return 0 if all("figures" in r for r in results) else 1


def copy_small_files(shape_dir: Path, dest: Path) -> None:
    """The table, each row's log, each run's metrics.jsonl and TRL's summary.json into dest (no model, no run
    directories): after each row, so that a command cut at its time limit still leaves what it finished."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in [*shape_dir.glob("results.*"), *shape_dir.glob("*.log")]:
        shutil.copy(f, dest / f.name)
    for f in [*shape_dir.glob("bench-*/metrics.jsonl"), *shape_dir.glob("trl-vllm/summary.json")]:
        shutil.copy(f, dest / f"{f.parent.name}.{f.name}")


def earlier_rows(path: Path, fresh: bool) -> list[dict]:
    """The rows an earlier command wrote to this OUT/<shape> (rows run a call at a time on one warm machine);
    each keeps the peak and device it was measured with."""
    return [] if fresh or not path.exists() else json.loads(path.read_text())["results"]


if __name__ == "__main__":
    sys.exit(main())
