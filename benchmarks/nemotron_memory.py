"""One nemotron_h Mamba-2 block, train forward + backward: what it saves and its peak, measured vs the memory model.

    python benchmarks/nemotron_memory.py                          # nemotron_h_1b's width, rows of 16/64/100/300
    python benchmarks/nemotron_memory.py --batch 32 --seq 16 64   # the GPU: the Mamba-2 path this node binds

The block is transformers' NemotronHBlock at the model's width (fp32 weights, bf16 autocast, as the torch worker runs
it), its Mamba-2 functions bound as the worker binds them (models/nemotron_h.py bind_mamba_kernels: mamba-ssm's
Triton kernels on CUDA where they import, the torch references otherwise). After a warm-up pass (gradients and
autocast's weight casts exist), one forward + backward is measured:
  saved: the bytes of the storages autograd keeps for the backward (saved-tensor hooks; the parameters and cached
         weight casts, the same in two forwards, left out), vs preflight/memory_shapes.mamba_saved_bytes;
  peak:  the allocator's peak over the pass above what was allocated before it (CUDA: max_memory_allocated; CPU:
         the profiler's allocation events), vs mamba_saved_bytes + mamba_work_bytes (the memory model's activations
         + its transient "work" for one block).
err = predicted / measured - 1. Results: benchmarks/results/memory.md ("Mamba-2 layers").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from grpo_launcher.models import nemotron_h as nh  # noqa: E402
from grpo_launcher.preflight import memory_shapes as shapes  # noqa: E402
from grpo_launcher.spec.compose import load_spec  # noqa: E402


def saved_bytes(run) -> dict[int, int]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return seen


def peak_bytes(step, device: torch.device) -> float:
    """The allocator's peak during step() above its level before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cur = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        cur += n
        peak = max(peak, cur)
    return peak


def measure(model: str, batch: int, seq: int, device: torch.device) -> dict:
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    spec = load_spec([f"model={model}", "model.num_layers=1"])  # Nano's pattern starts with a Mamba-2 layer
    torch.manual_seed(0)
    with torch.device(device):
        block = NemotronHBlock(NemotronHConfig(**nh.nemotron_h_config(spec.model, 512, 2, 0)), 0).float()
    words = nh.bind_mamba_kernels(block, on_cuda=device.type == "cuda")
    path = "torch" if device.type != "cuda" else nh.mamba_train_path(
        nh._imports("mamba_ssm", nh.MAMBA_FUNCTIONS["mamba2_chunk_scan"][1]),
        nh._imports("causal_conv1d", nh.MAMBA_FUNCTIONS["causal_conv1d_fn"][1]), True)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[0, seq // 2:] = 0  # right padding, as the worker's batches
    outs: list[torch.Tensor] = []

    def forward() -> torch.Tensor:
        x = torch.randn(batch, seq, spec.model.hidden_size, device=device, requires_grad=True)
        return block(x, attention_mask=mask.clone())

    with torch.autocast(device.type, dtype=torch.bfloat16):
        forward().float().sum().backward()  # warm-up: gradients, weight casts, kernel compilation
        first = saved_bytes(lambda: outs.append(forward()))
        second = saved_bytes(lambda: outs.append(forward()))
        saved = sum(n for k, n in second.items() if k not in first)
        outs.clear()
        peak = peak_bytes(lambda: forward().float().sum().backward(), device)
    a = shapes.arch_of(spec)
    pred_saved = batch * shapes.mamba_saved_bytes(a, path, seq, 2)
    pred_peak = pred_saved + batch * shapes.mamba_work_bytes(a, path, seq, 2) + shapes.mamba_fixed_bytes(a, path, True)
    return dict(path=path, words=words, batch=batch, seq=seq, saved=saved, pred_saved=pred_saved, peak=peak,
                pred_peak=pred_peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="nemotron_h_1b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, nargs="+", default=[16, 64, 100, 300])
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where CUDA is available")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{args.model}: one Mamba-2 block, train forward + backward, bf16 autocast, on {name}")
    print("| path | batch × seq | saved MiB (meas / pred) | err | peak MiB (meas / pred) | err |")
    print("|---|---|---|---|---|---|")
    for seq in args.seq:
        r = measure(args.model, args.batch, seq, device)
        mib = 2**20
        print(f"| {r['path']} | {r['batch']} × {r['seq']} | {r['saved'] / mib:.1f} / {r['pred_saved'] / mib:.1f} | "
              f"{r['pred_saved'] / r['saved'] - 1:+.1%} | {r['peak'] / mib:.1f} / {r['pred_peak'] / mib:.1f} | "
              f"{r['pred_peak'] / r['peak'] - 1:+.1%} |", flush=True)
    print(f"Mamba-2 path: {r['words']}")


if __name__ == "__main__":
    main()
