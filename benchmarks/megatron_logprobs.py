#!/usr/bin/env python
"""Issue 29 on the megatron backend, one GPU: whole logits vs the chunked output layer vs + megatron-core's fusions.

    python benchmarks/megatron_logprobs.py --out OUT/megatron_logprobs.md [--model-dir DIR]

Each row in a fresh process (benchmarks/memory_gpu.py's child: load_spec, the real MegatronPolicyWorker, a warm-up
step, then one measured logprob pass + update after torch.cuda.reset_peak_memory_stats()). The 1.21B Llama shape
(memory_gpu.py's "1b"), bf16 with fp32 master weights, 64 rows of 2048 tokens (1024 prompt + 1024 response),
micro-batch 4, logprob batch 64: the configuration whose logprob phase held 27 GiB of whole logits. The predicted
column is preflight/memory_estimate.py's logprobs phase (and its logits term) for the same spec.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

import memory_gpu as mg  # noqa: E402

MB, SEQ, LB = 4, 2048, 64
ROWS = [  # (label, train.logprob_chunk_tokens, train.fused_kernels)
    ("whole logits, no fusions (before)", 0, "false"),
    ("chunked output layer (4096 tokens)", 4096, "false"),
    ("chunked + megatron-core fusions (SwiGLU, residual add)", 4096, "null"),
]


def n_params() -> int:
    s = mg.SHAPES["1b"]
    h, f, v, n = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    return 2 * v * h + n * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h  # Llama, untied, no biases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir")
    ap.add_argument("--timeout", type=int, default=150)
    args = ap.parse_args()
    from gpu_step import matmul_peak

    from grpo_launcher.spec.compose import compose, to_spec
    from grpo_launcher.preflight.memory_estimate import estimate

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               CUDA_DEVICE_MAX_CONNECTIONS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", NCCL_NVLS_ENABLE="0", PYTHONWARNINGS="ignore")
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="megatron-lp-")) / "llama-1b"
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, mg.__file__, "--make-model", "1b", str(model_dir), "cuda"], env=env,
                       check=True, timeout=240)
    peak, n, tokens = matmul_peak(), n_params(), LB * SEQ
    lines = ["| megatron worker, 1.21B, 64 x 2048, micro 4, logprob batch 64 | logprob pass | logprob MFU "
             "| logprob-pass peak (predicted phase, of it logits) | update | update tok/s, MFU | step peak |",
             "|---|---|---|---|---|---|---|"]
    for label, chunk, fused in ROWS:
        ov = [*mg.overrides_for("1b", str(model_dir), "megatron", MB, SEQ, False, False, True, lb=LB, chunk=chunk),
              f"train.fused_kernels={fused}"]
        t = time.time()
        r = mg.run_child({"overrides": ov, "model_dir": str(model_dir), "gpu": True}, env, args.timeout)
        e = estimate(to_spec(compose(ov)))
        pred = f"{e.phases['logprobs']:.1f} GiB, {e.policy['logprob logits'].bytes / 2**30:.1f}"
        if "error" in r:
            lines.append(f"| {label} | {r['error']} | | ({pred}) | | | |")
        else:
            lp, up = r["logprobs_s"], r["update_s"]
            lines.append(f"| {label} | {lp:.2f} s | {100 * 2 * n * tokens / lp / peak / 1e12:.1f} % "
                         f"| {r['lp_alloc_gib']:.1f} GiB ({pred}) | {up:.2f} s "
                         f"| {tokens / up:,.0f}, {100 * 6 * n * tokens / up / peak / 1e12:.1f} % "
                         f"| {r['alloc_gib']:.1f} GiB |")
        print(lines[-1], f"({time.time() - t:.0f} s)", flush=True)
    text = "\n".join(lines) + (f"\n\nbf16 matmul peak {peak:.0f} TFLOP/s (8192^3); N = {n / 1e9:.3f}B; MFU = 6 N "
                               "(update) or 2 N (logprob pass) x 131,072 tokens / s / peak; one measured step after "
                               "a warm-up, each row in a fresh process.\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
