#!/usr/bin/env python
"""Whole-GPU memory at scale: the dry run's predicted peak vs nvidia-smi's measured peak, through `launch.py`.

    python benchmarks/memory_scale.py --out $OUT --only 0.1b,1.5b        # one H200 (the kit: scripts/gpu-kit.sh)
    python benchmarks/memory_scale.py --predict-only                     # the predicted side alone (any machine)

Each row is a real run of `python launch.py ...` (Ray, vLLM, the policy worker, the GRPO loop) on one GPU, the
same overrides first with `dry_run=true` (its "memory per GPU: ... peak X GiB" line is the prediction). While the
run goes, `nvidia-smi` samples the GPU's used memory every 100 ms (the whole card: every process, CUDA contexts
and NCCL included) and each compute process's share; the row's measured peak is the largest sample. The run dir
is deleted after each row (a 3 B run's checkpoint would fill the node's disk). err = predicted / measured - 1;
the target (issue 43): -3 % <= err <= +15 %.

Models are random Qwen2-shaped models built by the launcher itself (model.path unset), with its byte tokenizer;
prompts are exactly PROMPT bytes, so prompt and response lengths are what the row says.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every group's rewards vary, so each step runs its update in full: with env=math's grader a random model scores 0
# everywhere and the loop skips the update ("no update"), so the train and optimizer-step phases went unmeasured
# (the 2026-12-05 H100 rows 1.5b-megatron-mid and 0.1b-sleep did so)
REWARD = f"{ROOT}/benchmarks/workload_shapes.py:varied_reward"

QWEN = {  # Qwen2.5 shapes, untied: model.path=null builds untied models (the rows in memory.md were run so)
    "0.1b": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_kv_heads=2, ffn_hidden_size=2048,
                 vocab_size=32000),
    "1.5b": dict(num_layers=28, hidden_size=1536, num_attention_heads=12, num_kv_heads=2, ffn_hidden_size=8960,
                 vocab_size=151936),
    "3b": dict(num_layers=36, hidden_size=2048, num_attention_heads=16, num_kv_heads=2, ffn_hidden_size=11008,
               vocab_size=151936),
}
# name: (shape, backend, prompts, generations, prompt tokens, new tokens, micro batch, extra overrides)
ROWS = {
    "0.1b": ("0.1b", "torch", 16, 8, 256, 256, 8, ["rollout.gpu_memory_utilization=0.3"]),
    "1.5b": ("1.5b", "torch", 32, 8, 256, 1024, 8, ["rollout.gpu_memory_utilization=0.3"]),
    "3b-sleep": ("3b", "torch", 16, 8, 256, 512, 4, ["rollout.sleep_mode=true"]),
    "1.5b-megatron": ("1.5b", "megatron", 32, 8, 256, 1024, 8, ["rollout.gpu_memory_utilization=0.3"]),
    "1.5b-megatron-sleep": ("1.5b", "megatron", 16, 8, 256, 512, 4, ["rollout.sleep_mode=true"]),
    # not measured yet (issue 43's open rows): prompt-heavy, 0.1B asleep, a user's KV cache size on the GPU
    "1.5b-prompt": ("1.5b", "torch", 32, 8, 2048, 128, 4, ["rollout.gpu_memory_utilization=0.3"]),
    "0.1b-sleep": ("0.1b", "torch", 16, 8, 256, 256, 8, ["rollout.sleep_mode=true"]),
    "1.5b-kv": ("1.5b", "torch", 32, 8, 256, 1024, 8, ["rollout.gpu_memory_utilization=0.3",
                                                       "rollout.kv_cache_memory_mb=8192"]),
    # rows that fit an H100 (79.6 GiB; --gpu-gib): both backends awake at 1.5B, 128 x (256 + 512)
    "1.5b-mid": ("1.5b", "torch", 16, 8, 256, 512, 4, ["rollout.gpu_memory_utilization=0.3"]),
    "1.5b-megatron-mid": ("1.5b", "megatron", 16, 8, 256, 512, 4, ["rollout.gpu_memory_utilization=0.3"]),
    # the same with the fused kernels off (train.fused_kernels=false; on by default with a GPU): the policy worker's
    # peak with and without megatron's fused SwiGLU (counted 6f vs 10f B per token and layer: 9.6 GiB at 1.5b
    # decode-heavy, 2.9 GiB at mid) and with and without Liger on the torch worker (not counted by the model)
    "1.5b-megatron-unfused": ("1.5b", "megatron", 32, 8, 256, 1024, 8, ["rollout.gpu_memory_utilization=0.3",
                                                                        "train.fused_kernels=false"]),
    "1.5b-unfused": ("1.5b", "torch", 32, 8, 256, 1024, 8, ["rollout.gpu_memory_utilization=0.3",
                                                            "train.fused_kernels=false"]),
    "1.5b-megatron-mid-unfused": ("1.5b", "megatron", 16, 8, 256, 512, 4, ["rollout.gpu_memory_utilization=0.3",
                                                                            "train.fused_kernels=false"]),
    "1.5b-mid-unfused": ("1.5b", "torch", 16, 8, 256, 512, 4, ["rollout.gpu_memory_utilization=0.3",
                                                               "train.fused_kernels=false"]),
    # megatron's local core attention (train.core_attention=local): [rows, heads, T, T] scores in every layer and its
    # kept baddbmm scratch buffer, counted since 2026-12-06 (preflight/memory_estimate.py score_bytes); fits an H100
    "1.5b-megatron-mid-local": ("1.5b", "megatron", 16, 8, 256, 512, 4, ["rollout.gpu_memory_utilization=0.3",
                                                                          "train.core_attention=local"]),
}


def write_prompts(path: Path, n: int, length: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"question": "".join(rng.choice("abcdefgh ") for _ in range(length)),
                                "answer": "0"}) + "\n")


def overrides(row: str, out: Path, steps: int, gpu_gib: float) -> list[str]:
    shape, backend, prompts, gens, plen, new, micro, extra = ROWS[row]
    data = out / f"prompts_{plen}.jsonl"
    write_prompts(data, 4 * prompts, plen)
    return [f"name=mem-{row}", f"output_root={out}", "checkpoint.resume=fresh", "checkpoint.enabled=false",
            "rollout=vllm", *(f"model.{k}={v}" for k, v in QWEN[shape].items()),
            "model.max_position_embeddings=4096", "model.warm_start_steps=0",
            "env=math", f"env.reward_fn={REWARD}", f"env.train_path={data}", f"env.val_path={data}",
            f"env.max_prompt_tokens={plen}",
            f"rollout.max_new_tokens={new}", f"train.max_total_sequence_length={plen + new}",
            f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={gens}",
            f"train.global_batch_size={prompts * gens}", f"train.micro_batch_size={micro}",
            f"train.logprob_batch_size={2 * micro}", "train.precision=bfloat16", "train.lr=1e-6",
            f"train.backend={backend}", "cluster.gpus_per_node=1", f"cluster.gpu_memory_gib={gpu_gib}",
            f"grpo.max_steps={steps}", "grpo.val_period=0", "grpo.val_at_end=false", "logging.mlflow=false",
            *extra]


def card_gib() -> float:
    """GPU 0's memory as nvidia-smi reports it (H200 140.4 GiB, H100 79.6); 140.4 where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return round(int(out) / 1024, 1)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 140.4


def predicted_peak(args: list[str]) -> tuple[float, str]:
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args, "dry_run=true"], capture_output=True,
                          text=True, timeout=300)
    m = re.search(r"memory per GPU: .*?peak ([\d.]+) GiB.*? in the (\S+(?: step)?) phase", proc.stdout)
    if not m:
        raise RuntimeError(f"no memory line in the dry run (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    return float(m.group(1)), m.group(2)


class Sampler:
    """nvidia-smi's used memory of GPU 0 every 100 ms, and each compute process's every ~0.5 s (MiB)."""

    def __init__(self) -> None:
        self.total: list[tuple[float, int]] = []
        self.procs: dict[str, int] = {}
        self._stop = threading.Event()
        self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0", "-lms", "100"], stdout=subprocess.PIPE, text=True)
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._apps, daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        assert self._smi.stdout is not None
        for line in self._smi.stdout:
            if line.strip().isdigit():
                self.total.append((time.time(), int(line)))

    def _apps(self) -> None:
        while not self._stop.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 3 and parts[2].isdigit():
                    key = f"{parts[0]} {parts[1][-40:]}"
                    self.procs[key] = max(self.procs.get(key, 0), int(parts[2]))

    def stop(self) -> None:
        self._stop.set()
        self._smi.terminate()
        self._smi.wait(timeout=10)
        for t in self._threads:
            t.join(timeout=5)

    @property
    def peak_mib(self) -> int:
        return max((m for _, m in self.total), default=0)


def measure(row: str, out: Path, steps: int, gpu_gib: float) -> dict:
    args = overrides(row, out, steps, gpu_gib)
    pred, phase = predicted_peak(args)
    idle = Sampler()
    time.sleep(1.0)  # one second of samples before the launch: what the card holds with nothing of ours on it
    idle.stop()
    base = idle.peak_mib
    sampler = Sampler()
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=1500)
    sampler.stop()
    run_dir = out / f"mem-{row}"
    steps_s = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        steps_s = [json.loads(x).get("time/step_s") for x in metrics.read_text().splitlines() if x.strip()]
    shutil.rmtree(run_dir, ignore_errors=True)
    meas = (sampler.peak_mib - base) / 1024
    return {"row": row, "gpu_gib": gpu_gib, "overrides": args, "exit": proc.returncode, "wall_s": round(time.time() - t0, 1),
            "predicted_gib": pred, "predicted_phase": phase, "measured_gib": round(meas, 2),
            "baseline_mib": base, "err_pct": round(100 * (pred / meas - 1), 1) if meas > 0 else None,
            "per_process_mib": sampler.procs, "step_s": steps_s,
            "timeline": sampler.total[:: max(1, len(sampler.total) // 400)],
            "tail": (proc.stdout[-1500:] + proc.stderr[-2500:]) if proc.returncode else proc.stdout[-600:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/memory_scale"))
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--predict-only", action="store_true")
    ap.add_argument("--gpu-gib", type=float, default=None, help="the card's memory (default: nvidia-smi's, else 140.4)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    gib = a.gpu_gib or card_gib()
    for row in a.only.split(","):
        if a.predict_only:
            print(row, *predicted_peak(overrides(row, a.out, a.steps, gib)), flush=True)
            continue
        r = measure(row, a.out, a.steps, gib)
        (a.out / f"memory_scale_{row}.json").write_text(json.dumps(r, indent=1))
        print(f"{row}: exit {r['exit']} predicted {r['predicted_gib']} GiB ({r['predicted_phase']}) measured "
              f"{r['measured_gib']} GiB err {r['err_pct']} % wall {r['wall_s']} s procs {r['per_process_mib']}",
              flush=True)
        if r["exit"]:
            print(r["tail"], flush=True)


if __name__ == "__main__":
    main()
