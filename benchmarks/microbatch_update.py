"""Token-budget micro-batches vs fixed row counts (policy/microbatch.py): the torch worker's logprob pass and update
on one synthetic decode-heavy batch (a long tail of response lengths), both paths in one process, same weights.

    python benchmarks/microbatch_update.py [--rows 64] [--prompt 32] [--max-new 480] [--micro 8] [--repeats 3]
    python benchmarks/microbatch_update.py --shape qwen2-1.5b --bf16 --rows 256 --prompt 256 --max-new 1024 --micro 4
        (on a GPU: Qwen2.5-1.5B's shape, random weights, train.precision=bfloat16)

The fixed-row path is the worker's own default (train.dynamic_batching=false: `micro` rows at a time at the
batch's length); the token budget is train.dynamic_batching=true (the worker's token_budget and cut on). Prints
the padded tokens each path processes and the median seconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_launcher.batch import Generation, collate
from grpo_launcher.models.tiny import build_tokenizer
from grpo_launcher.policy import microbatch
from grpo_launcher.policy.torch_policy import TorchPolicyWorker
from grpo_launcher.spec.compose import load_spec


SHAPES = {  # random Qwen2 models: ~7M parameters (CPU), Qwen2.5-1.5B's shape (GPU)
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2),
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2),
}


def model_dir(root: Path, shape: str) -> str:
    """A random Qwen2 of the shape, with the tiny model's byte tokenizer, written once."""
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(root / "model")
    build_tokenizer().save_pretrained(root / "model")  # the tiny model's byte-level tokenizer (pre-flight reads it)
    return str(root / "model")


def decode_heavy_batch(rows: int, prompt: int, max_new: int, vocab: int):
    """Responses with a long tail: most short (16..max_new/4), an eighth at max_new (truncated)."""
    g = torch.Generator().manual_seed(0)
    gens = []
    for i in range(rows):
        k = max_new if i % 8 == 3 else int(torch.randint(16, max_new // 4, (1,), generator=g))
        ids = torch.randint(3, vocab, (prompt + k,), generator=g).tolist()
        gens.append(Generation(ids[:prompt], ids[prompt:], [-1.0] * k, k == max_new))
    return collate(gens, torch.randn(rows, generator=g), torch.ones(rows), pad_id=0)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=480)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--bf16", action="store_true", help="train.precision=bfloat16 (bf16 compute on a GPU)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mb-bench-"))
    path = model_dir(root, args.shape)
    total = args.prompt + args.max_new
    spec = load_spec([f"output_root={root}", f"model.path={path}", "logging.mlflow=false",
                      f"train.micro_batch_size={args.micro}", f"train.logprob_batch_size={args.micro}",
                      f"train.global_batch_size={args.rows}", f"grpo.num_prompts_per_step={args.rows // 8}",
                      f"train.max_total_sequence_length={total}", f"rollout.max_new_tokens={args.max_new}",
                      f"env.max_prompt_tokens={args.prompt}", f"train.precision={'bfloat16' if args.bf16 else 'float32'}"])
    torch.set_num_threads(2)
    w = TorchPolicyWorker(spec, path, 0, 1, threads=2)
    w.opt.step = lambda: None  # the same weights for every call
    batch = decode_heavy_batch(args.rows, args.prompt, args.max_new, 256)  # byte-level ids: the tokenizer's range
    lengths, _ = microbatch.lengths_of(batch)
    print(f"{args.rows} rows, prompt {args.prompt}, responses {min(lengths) - args.prompt}..{args.max_new} "
          f"(real tokens {sum(lengths)}), micro_batch_size={args.micro}, {w.device}")
    for name, on in (("fixed rows", False), ("token budget", True)):  # as train.dynamic_batching=false / true
        w.token_budget = w.cut = on
        groups = w._micro_batches(batch, args.micro)
        padded = microbatch.padded_tokens(groups, lengths, cut=on)
        prev, _ = w.logprobs(batch)
        b = batch.with_(prev_logprobs=prev)
        den = [float(b.response_mask.sum())]
        lp_s = timed(lambda: w.logprobs(batch), args.repeats)
        up_s = timed(lambda: w.update([b], den), args.repeats)
        print(f"{name:>12}: {len(groups)} micro-batches, {padded} padded tokens; logprobs {lp_s:.2f} s, "
              f"update {up_s:.2f} s ({sum(lengths) / up_s:.0f} real tok/s)")


if __name__ == "__main__":
    main()
