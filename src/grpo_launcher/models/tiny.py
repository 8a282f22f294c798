"""The tiny model, built here (no hub): byte-level tokenizer + small Qwen2 + a short supervised warm start.

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

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, (reserved), eos
WARMUP = {"steps": 80, "batch": 64, "lr": 1e-3}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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


def build_model(spec: ModelSpec, tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=max(spec.vocab_size, len(tokenizer)), hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return Qwen2ForCausalLM(cfg).to(torch.float32)


def warm_start(model, tokenizer, examples: list[tuple[str, str]], seed: int) -> float:
    """A few supervised steps on the env's format, so RL starts from a non-zero reward. Returns last loss."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP["lr"])
    loss = torch.tensor(0.0)
    for _ in range(WARMUP["steps"]):
        batch = rng.sample(examples, min(WARMUP["batch"], len(examples)))
        prompts = [tokenizer(p)["input_ids"] for p, _ in batch]
        seqs = [p + tokenizer(a)["input_ids"] + [tokenizer.eos_token_id] for p, (_, a) in zip(prompts, batch)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
        labels = ids.clone()
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            labels[i, : len(p)] = -100  # loss on the answer and EOS only
            labels[i, len(s):] = -100
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def cache_key(spec: ModelSpec, env_name: str, seed: int) -> str:
    blob = json.dumps([repr(spec), env_name, seed, WARMUP, SPECIALS], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_tiny_model(spec: ModelSpec, env, env_name: str, cache_root: Path, seed: int = 0) -> Path:
    """Return the directory of the tiny model for this env, building it (atomically) if needed."""
    out = cache_root / f"tiny-{env_name}-{cache_key(spec, env_name, seed)}"
    if (out / "config.json").exists():
        return out
    import torch

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer, seed)
    examples = env.warmup_examples(4096)
    if examples:
        warm_start(model, tokenizer, examples, seed)
    tmp = cache_root / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process built it first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out
