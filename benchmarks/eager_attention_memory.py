"""A softcapped (Gemma-2) model's policy forward + backward on eager vs sdpa attention: what eager adds, measured on
the CPU vs the memory model's count (preflight/memory_shapes.eager_score_bytes).

    python benchmarks/eager_attention_memory.py                    # T = 1024, 2048; fp32 and bf16 autocast
    python benchmarks/eager_attention_memory.py --seq 2048 4096 --rows 2    # on a GPU: CUDA's allocator peaks

models/attention.py runs a model whose config caps attention logits (attn_logit_softcapping) with transformers'
eager attention, which materialises [rows, heads, T, T] scores in every layer; sdpa does not. The model is a tiny
random Gemma2ForCausalLM (hidden 64, 8 heads of 16, 4 KV heads, 2 layers) built from its config class, so that the
T×T term dominates. Each (attention, dtype, T) runs in a fresh subprocess, after a warm-up pass:
  saved: bytes of the storages autograd keeps for the backward (saved-tensor hooks), one forward, less the shared
         [rows, 1, T, T] mask the CPU SDPA kernel saves;
  peak:  the process's peak RSS over forward + backward above its RSS before (/proc/self/clear_refs resets the peak;
         MALLOC_MMAP_THRESHOLD_ makes glibc mmap each tensor and unmap it on free: RSS follows torch's allocations;
         on a GPU: torch.cuda.max_memory_allocated above memory_allocated before);
  lp:    the same over a no_grad forward (the logprob pass).
eager − sdpa is compared with layers × rows × T × eager_score_bytes (saved and peak: saved + one layer's backward
work, the memory model's "activation work"; lp: eager_forward_score_bytes, one layer + the masks). Results: benchmarks/results/memory.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=16, max_position_embeddings=8192, query_pre_attn_scalar=16,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096)


def rss(field: str) -> int:
    """VmRSS / VmHWM of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class Peak:
    """The peak above the level at entry: CUDA's max_memory_allocated on a GPU, else the process's peak RSS."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.bytes = cuda, 0

    def __enter__(self) -> Peak:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.base = rss("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
        return self

    def __exit__(self, *_: object) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self.bytes = rss("VmHWM") - self.base


def one(attn: str, bf16: bool, seq: int, rows: int) -> dict:
    """Runs in the child: the measurement of one (attention, dtype, T), on the GPU where there is one."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(2)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    model = Gemma2ForCausalLM(Gemma2Config(**CONFIG, attn_implementation=attn)).float().train().to(dev)
    ids = torch.randint(0, 256, (rows, seq), device=dev)
    mask = torch.ones(rows, seq, dtype=torch.long, device=dev)
    mask[0, -3:] = 0  # right padding, as the worker's rows have: a 4-D mask, not is_causal

    def forward():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().sum()

    forward().backward()  # warm-up: .grad buffers exist
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        mask4d = t.dim() == 4 and t.shape[1] == 1 and t.shape[-2:] == (seq, seq)  # the layers' shared [b, 1, T, T]
        if ptr not in params and not mask4d:  # mask (the CPU SDPA kernel saves it): not per-layer scores
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with Peak(cuda) as train:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        loss.backward()
    del loss
    with Peak(cuda) as lp, torch.no_grad():
        forward()
    return {"attn": attn, "bf16": bf16, "seq": seq, "rows": rows, "saved": sum(seen.values()), "peak": train.bytes,
            "lp": lp.bytes, "device": dev.type}


def megatron_local(bf16: bool, seq: int, heads: int, groups: int, head_dim: int) -> dict:
    """Runs in the child: bytes autograd saves for megatron's local DotProductAttention and for the worker's SDPA core
    attention (policy/megatron_policy.py sdpa_attention_class), each followed by a linear on its output (the layer's
    linear_proj, which saves it), one row of `seq` tokens; the causal mask and SDPA's logsumexp left out (not
    per-score terms). The CPU build (policy/megatron_cpu.py), world size 1 (gloo)."""
    import socket

    import torch
    import torch.distributed as dist

    os.environ["GRPO_MEGATRON_CPU_SHIM"] = "1"
    from grpo_launcher.policy import megatron_cpu

    megatron_cpu.install()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from grpo_launcher.policy.megatron_policy import sdpa_attention_class

    ps.initialize_model_parallel(1)
    megatron_cpu.after_parallel_init()
    dt = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=head_dim, bf16=bf16, params_dtype=dt,
                            attention_dropout=0.0, masked_softmax_fusion=False, use_cpu_initialization=True)
    # the worker passes no mask (megatron builds the causal one, on "cuda": the CPU build cannot run `local` so)
    mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
    out = {}
    for name, cls in (("local", DotProductAttention), ("sdpa", sdpa_attention_class())):
        att = cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").train()
        proj = torch.nn.Linear(heads * head_dim, heads * head_dim, bias=False, dtype=dt)
        q = torch.randn(seq, 1, heads, head_dim, dtype=dt, requires_grad=True) * 1
        k, v = (torch.randn(seq, 1, groups, head_dim, dtype=dt, requires_grad=True) * 1 for _ in range(2))
        seen: dict[int, int] = {}

        def pack(t):
            shared = t.dtype == torch.bool or (t.dim() == 3 and t.shape[-1] == seq and t.dtype == torch.float32
                                               and name == "sdpa")  # the mask; SDPA's logsumexp [b, n, s]
            if not shared:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            proj(att(q, k, v, mask).reshape(seq, -1))
        out[name] = sum(seen.values())
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--child", nargs=4)
    ap.add_argument("--megatron-local", nargs=5, type=int, metavar=("BF16", "SEQ", "HEADS", "GROUPS", "HEAD_DIM"))
    a = ap.parse_args()
    if a.megatron_local:
        bf16, seq, heads, groups, head_dim = a.megatron_local
        print(json.dumps(megatron_local(bool(bf16), seq, heads, groups, head_dim)))
        return
    if a.child:
        attn, bf16, seq, rows = a.child
        print(json.dumps(one(attn, bf16 == "1", int(seq), int(rows))))
        return
    sys.path.insert(0, str(ROOT / "src"))
    from grpo_launcher.preflight import memory_shapes as shapes

    arch = shapes.Arch(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, vocab=256, attention=2, mlp=2, moe=0,
                       mamba=0)
    mib = 2**20
    # glibc: every allocation of 128 KiB or more is its own mmap, unmapped on free (no dynamic threshold), so that
    # RSS follows torch's allocations and frees
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    print("| dtype | rows × T | eager − sdpa saved MiB (meas / pred) | peak MiB (meas / pred) | logprob pass MiB "
          "(meas / pred) |\n|---|---|---|---|---|")
    for bf16 in (False, True):
        act = 2 if bf16 else 4
        for seq in a.seq:
            r = {}
            for attn in ("eager", "sdpa"):
                out = subprocess.run([sys.executable, __file__, "--child", attn, str(int(bf16)), str(seq),
                                      str(a.rows)], capture_output=True, text=True, check=True, env=env).stdout
                r[attn] = json.loads(out.strip().splitlines()[-1])
            tokens = a.rows * seq
            saved = arch.attention * shapes.eager_score_bytes(arch, act, seq) * tokens
            peak = saved + shapes.eager_score_bytes(arch, act, seq) * tokens  # + one layer's work
            lp = shapes.eager_forward_score_bytes(arch, act, seq) * tokens
            d = {k: r["eager"][k] - r["sdpa"][k] for k in ("saved", "peak", "lp")}
            print(f"| {'bf16 autocast' if bf16 else 'fp32'} | {a.rows} × {seq} | {d['saved'] / mib:.1f} / "
                  f"{saved / mib:.1f} | {d['peak'] / mib:.1f} / {peak / mib:.1f} | {d['lp'] / mib:.1f} / "
                  f"{lp / mib:.1f} |", flush=True)


if __name__ == "__main__":
    main()
