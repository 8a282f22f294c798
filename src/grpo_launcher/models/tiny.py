"""The tiny model, built here (no hub): byte-level tokenizer + small Qwen2 (or Nemotron-H, models/nemotron_h.py)
+ a short supervised warm start.

head_dim = hidden / heads stays ≥ 32 so vLLM's CPU attention can run the same model. The result is an
ordinary HF directory (safetensors + tokenizer), cached by a hash of everything that shapes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from ..spec.schema import ModelSpec
from .nemotron_h import build_model as build_nemotron_h

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, (reserved), eos
# steps: model.warm_start_steps. "data": the envs' warm-up pairs' version, in the cache key: a model built on older
# pairs is not reused (2: env=toy's leave the held-out prompts out)
WARMUP = {"batch": 64, "lr": 1e-3, "data": 2}
TOKENIZER_SIZE = 256 + len(SPECIALS)  # build_tokenizer's: the 256 bytes + SPECIALS (the least model.vocab_size)
BIG_ON_CPU = 100_000_000  # parameters above which a CPU build says how long it will take


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # here: pre-flight imports this module
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # vocab = the 256 byte symbols + specials: every character is one token, no merges
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(SPECIALS), special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["0123456789"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=1024)


def build_model(spec: ModelSpec, tokenizer, seed: int, device: str = "cpu"):
    import torch  # here: pre-flight imports this module

    if spec.family == "nemotron_h":  # the recipe's hybrid Mamba-2 / attention / MoE family
        return build_nemotron_h(spec, tokenizer, seed, device)
    from transformers import Qwen2Config, Qwen2ForCausalLM  # here: pre-flight imports this module

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=max(spec.vocab_size, len(tokenizer)), hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        **({"head_dim": spec.head_dim} if spec.head_dim else {}),  # null: hidden / heads (Qwen2's own default)
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.device(device):  # initialised where it will be warmed up: a GPU when the driver has one
        return Qwen2ForCausalLM(cfg).to(torch.float32)


def warm_start(model, tokenizer, examples: list[tuple[str, str]], seed: int, steps: int) -> float:
    """A few supervised steps on the env's format, so RL starts from a non-zero reward. Returns last loss."""
    import torch  # here: pre-flight imports this module

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP["lr"])
    loss = torch.tensor(0.0)
    dev = next(model.parameters()).device
    for i in range(steps):
        batch = rng.sample(examples, min(WARMUP["batch"], len(examples)))
        prompts = [tokenizer(p)["input_ids"] for p, _ in batch]
        seqs = [p + tokenizer(a)["input_ids"] + [tokenizer.eos_token_id] for p, (_, a) in zip(prompts, batch)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs], device=dev)
        labels = ids.clone()
        for row, (p, s) in enumerate(zip(prompts, seqs)):
            labels[row, : len(p)] = -100  # loss on the answer and EOS only
            labels[row, len(s):] = -100
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if steps >= 20 and (i + 1) % (steps // 4) == 0:
            print(f"grpo-launcher: warm start {i + 1}/{steps} (loss {loss.item():.3f})", flush=True)
    return float(loss.detach())


def cache_key(spec: ModelSpec, env_name: str, seed: int) -> str:
    blob = json.dumps([repr(spec), env_name, seed, WARMUP, SPECIALS], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_tiny_model(spec: ModelSpec, env, env_name: str, cache_root: Path, seed: int = 0) -> Path:
    """Return the directory of the tiny model for this env, building it (atomically) if needed."""
    out = cache_root / f"tiny-{env_name}-{cache_key(spec, env_name, seed)}"
    if (out / "config.json").exists():
        return out
    import torch  # here: pre-flight imports this module

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(spec, tokenizer, seed, device)
    n = sum(p.numel() for p in model.parameters())
    print(f"grpo-launcher: building the tiny model ({n / 1e6:.1f}M parameters, {spec.warm_start_steps} "
          f"warm-start steps on the {device}) into {out}", flush=True)
    if device == "cpu" and n > BIG_ON_CPU and spec.warm_start_steps:
        print(f"grpo-launcher: warning: warming up {n / 1e6:.0f}M parameters on the CPU takes a long time; "
              "run on a GPU node, set model.warm_start_steps=0 (random weights) or give model.path", flush=True)
    examples = env.warmup_examples(4096) if spec.warm_start_steps else []
    if examples:
        warm_start(model, tokenizer, examples, seed, spec.warm_start_steps)
    tmp = cache_root / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model  # the driver runs on: its CUDA cache goes back to the workers (benchmarks/results/nemotron_gpu.md)
    if device == "cuda":
        torch.cuda.empty_cache()
    try:
        os.rename(tmp, out)
    except OSError:  # another process built it first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out
