"""TRL GRPOTrainer with its own vLLM engine colocated on the GPU (`use_vllm=True, vllm_mode="colocate"`): the
`trl-vllm` row of benchmarks/gpu_step.py and benchmarks/workloads.py, the same work as their other rows.

`--shape NAME` (benchmarks/workload_shapes.py SHAPES; default prompt-heavy, gpu_step's work): the same random Qwen2
shape as ours (our byte tokenizer), prompts x G sequences of the shape's prompt tokens plus exactly its new ones
(vLLM's `min_tokens`), its micro-batch x (sequences / micro-batch) accumulation, fp32 master weights + bf16
autocast, no gradient checkpointing, TRL's other defaults (its vLLM at gpu_memory_utilization 0.3, its
importance-sampling correction, beta 0). The reward is 0: this measures speed only. prompt-heavy: the 1.21B shape,
8 prompts x G=8 of 1536 prompt tokens + 512 new, micro-batch 4 x 16 accumulation.

Phases, CUDA-synchronised: `rollout` = TRL's vLLM generate call; `refit` = its weight push into vLLM; `update` =
the rest of the optimizer step (TRL's old-logprob forward, the micro-batches' forward + backward, the optimizer).

    PYTHONPATH=/tmp/site:src python benchmarks/trl_vllm.py --steps 4 --skip 1 --out /tmp/trl-vllm   # on the GPU
    ... benchmarks/trl_vllm.py --shape decode-heavy ...

summary.json's `process_start_to_step1_s`: this process's start (psutil, as our start-up line) to the end of step 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

T0 = time.perf_counter()  # the step clock below is perf_counter too
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]
for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                   ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(key, value)

from gpu_step import matmul_peak, save_model  # noqa: E402
from workload_shapes import SHAPES, Workload, n_params  # noqa: E402

TINY = dict(SHAPES["prompt-heavy"].model, num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
            ffn_hidden_size=256, vocab_size=1024, max_position_embeddings=256)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, log: list[float]):
    """fn, its wall time (CUDA-synchronised at both ends) appended to log."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        sync()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            log.append(time.perf_counter() - t)
    return run


def make_trainer(model_dir: Path, args, w: Workload, steps: list[tuple[float, float]]):
    import datasets
    import pyarrow
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            steps.append((self.t, time.perf_counter()))
            if len(steps) == 1:
                args.step1_end_wall = time.time()

    letters = "abcdefgh "  # the byte tokenizer: one token per character, so PROMPT characters = PROMPT tokens
    rows = [{"prompt": "".join(letters[(i * 7 + j * 3) % 9] for j in range(args.prompt))}
            for i in range(max(64, w.prompts * args.steps))]
    # a fixed fingerprint: datasets' own hashing of the table has failed on the H200 image's pyarrow
    table = datasets.Dataset(pyarrow.Table.from_pylist(rows), fingerprint="trl-vllm-bench")
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"), max_steps=args.steps, per_device_train_batch_size=w.micro,
        gradient_accumulation_steps=w.sequences // w.micro, num_generations=w.gens, max_completion_length=args.new,
        learning_rate=1e-6, lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
        bf16=args.tiny is False, use_cpu=args.tiny, gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
        vllm_max_model_length=args.prompt + args.new, generation_kwargs={"min_tokens": args.new, "detokenize": False})
    return GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                       args=config, train_dataset=table, callbacks=[StepClock()])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    ap.add_argument("--vllm-memory", type=float, default=0.3, help="vllm_gpu_memory_utilization (TRL's default)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/trl-vllm"))
    ap.add_argument("--shape", default="prompt-heavy", choices=sorted(SHAPES), help="the work (workload_shapes.py)")
    ap.add_argument("--micro", type=int, default=None, help="per_device_train_batch_size (default: the shape's)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a saved checkpoint of the shape (gpu_step.save_model; workloads.py's, ours load it too); "
                         "default: build it here, before the clock's step 1 ends")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, short sequences, CPU: a smoke test of this script")
    args = ap.parse_args()
    w = SHAPES[args.shape]
    w = dataclasses.replace(w, micro=args.micro or w.micro)
    shape, args.prompt, args.new = (TINY, 64, 16) if args.tiny else (w.model, w.prompt, w.new)
    args.out.mkdir(parents=True, exist_ok=True)
    import trl
    import vllm

    peak = 1.0 if args.tiny else matmul_peak()
    steps: list[tuple[float, float]] = []
    model = args.model or save_model(args.out / "model", shape)
    trainer = make_trainer(model, args, w, steps)
    gen, sync = trainer.vllm_generation, {"rollout": [], "refit": []}
    gen.generate = timed(gen.generate, sync["rollout"])
    gen.sync_weights = timed(gen.sync_weights, sync["refit"])
    trainer.train()
    step_s = [end - start for start, end in steps]
    at = lambda xs, i: xs[i] if i < len(xs) else 0.0  # noqa: E731  (one generate and one push a step)
    rollout, refit = ([at(sync[k], i) for i in range(len(steps))] for k in ("rollout", "refit"))
    update = [s - rollout[i] - refit[i] for i, s in enumerate(step_s)]
    med = lambda xs: statistics.median(xs[args.skip:] or xs)  # noqa: E731
    tokens = w.sequences * (args.prompt + args.new)
    summary = {"versions": {"trl": trl.__version__, "vllm": vllm.__version__}, "steps_s": step_s,
               "rollout_s": sync["rollout"], "refit_s": sync["refit"], "median_step_s": med(step_s),
               "median_rollout_s": med(rollout), "median_refit_s": med(refit),
               "median_update_s": med(update), "update_tokens_per_s": tokens / med(update),
               "update_mfu_6nd": 6 * n_params(shape) * tokens / med(update) / (peak * 1e12),
               "time_to_first_step_s": steps[0][1] - T0 if steps else None, "peak_tflops": peak,
               "process_start_to_step1_s": step1_from_process_start(args), "shape": w.name}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("SUMMARY", json.dumps(summary), flush=True)
    return 0


def step1_from_process_start(args) -> float | None:
    """This process's start (as psutil tells it, like our start-up line) to the end of TRL's step 1."""
    import psutil

    end = getattr(args, "step1_end_wall", None)
    return end - psutil.Process().create_time() if end is not None else None


if __name__ == "__main__":
    sys.exit(main())
