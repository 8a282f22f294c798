"""The hybrid HF engine alone on a GPU: compiled (static cache + CUDA graphs) vs eager decoding.

Component figures for the rollout phase of benchmarks/gpu_step.py (which measures the whole step through
launch.py): the same 1.21B shape and batch (8 prompts x 8, prompt 1536 + 512 new tokens), bf16 weights.

    python benchmarks/hf_engine.py --calls 3
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import GENS, NEW, PROMPT, PROMPTS, SHAPE  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/hf-engine"))
    a = ap.parse_args()
    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model
    from grpo_launcher.rollout.hf import HFEngine
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec([*(f"model.{k}={v}" for k, v in SHAPE.items()), "model.warm_start_steps=0",
                      f"rollout.max_new_tokens={NEW}", f"train.max_total_sequence_length={PROMPT + NEW}",
                      f"env.max_prompt_tokens={PROMPT}", "train.precision=bfloat16", "cluster.gpus_per_node=1",
                      f"grpo.num_prompts_per_step={PROMPTS}", f"grpo.num_generations_per_prompt={GENS}",
                      "train.global_batch_size=64", "train.micro_batch_size=4", "train.logprob_batch_size=8",
                      "logging.mlflow=false"])
    model_dir = ensure_tiny_model(spec.model, make_env(spec), "toy", a.out, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (PROMPT,), generator=g).tolist() for _ in range(PROMPTS)]
    for compiled in (True, False):
        s = replace(spec, rollout=replace(spec.rollout, hf_compile=compiled))
        eng = HFEngine(s, str(model_dir), torch.device("cuda"))
        for i in range(a.calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gens = eng.generate(prompts, GENS, seed=i)
            dt = time.perf_counter() - t0
            n = sum(len(x.response_ids) for x in gens)
            print(f"compiled={compiled} call {i}: {n} tokens in {dt:.2f} s = {n / dt:,.0f} tok/s; "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        del eng
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
