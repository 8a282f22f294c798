"""The `gpu` tier: train.sequence_packing for nemotron_h where mamba-ssm's Triton kernels run (issue 40).

On CUDA with mamba-ssm (the GPU kit), packed rows reach the Mamba-2 kernels with `seq_idx` (policy/packing.py; the
torch conv1d made seq_idx-aware where causal-conv1d is absent, models/nemotron_h.py): true varlen, no padded
groups. The CPU tier checks the padded groups (transformers' torch scan takes no seq_idx) and the conv alone
(tests/unit/test_packing.py, tests/unit/test_nemotron_kernels.py); the Triton scan with seq_idx needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _mamba_ssm_imports() -> bool:
    try:
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _mamba_ssm_imports(), reason="needs mamba-ssm's Triton kernels (scripts/gpu-kit.sh)")
def test_packed_rows_reach_the_kernels_with_seq_idx_and_equal_the_unpacked_batch(tmp_path, monkeypatch):
    """A nemotron_h model (Mamba-2, MoE, attention) on the GPU, fp32: the packed micro-batches' Mamba mixers run once
    on the packed rows with seq_idx (never per sequence), and the logprobs, loss and gradients equal the unpacked
    batch's; with seq_idx withheld the state runs on into the next sequence and they do not."""
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling

    from grpo_launcher.models import nemotron_h as nh
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker
    from grpo_launcher.spec.compose import load_spec
    from nemotron_tiny import tiny_nemotron_h
    from unit.test_hybrid import SMALL
    from unit.test_packing import _hybrid_batch

    for name in nh.MAMBA_FUNCTIONS:  # the rebinding is process-wide: restored after the test
        monkeypatch.setattr(modeling, name, getattr(modeling, name))
    model_dir = str(tiny_nemotron_h())
    over = [f"output_root={tmp_path}", f"model.path={model_dir}", *SMALL, "train.micro_batch_size=4",
            "train.precision=float32"]
    packed = TorchPolicyWorker(load_spec([*over, "train.sequence_packing=true"]), model_dir, 0, 1)
    padded = TorchPolicyWorker(load_spec(over), model_dir, 0, 1)
    assert packed.device.type == "cuda" and packed.mamba_path.startswith("mamba-ssm Triton kernels")
    assert nh.varlen_mamba() and packed.mamba_mixers == 1
    print(f"Mamba-2 path: {packed.mamba_path}")

    calls: list[bool] = []  # whether each scan that ran got seq_idx (spies: they call the bound functions)

    def spy(name: str):
        bound = getattr(modeling, name)

        def call(*args, **kwargs):
            out = bound(*args, **kwargs)
            if out is not None:  # the fused function's torch reference returns None: the unfused path runs
                calls.append(kwargs.get("seq_idx") is not None)
            return out

        monkeypatch.setattr(modeling, name, call)

    batch = _hybrid_batch(model_dir)  # 16 sequences of 5-28 tokens, across the scan's 16-token chunks
    mask = batch.response_mask.bool()
    spy("mamba2_chunk_scan")
    spy(nh.FUSED)  # with causal-conv1d, train mode runs the fused split-conv1d-scan instead
    pa = packed.logprobs(batch)[0]
    slices = len(packed._micro_batches(batch, packed.spec.train.logprob_batch_size))
    assert calls and all(calls) and len(calls) == slices  # one call per packed micro-batch: the rows, not groups
    calls.clear()
    pb = padded.logprobs(batch)[0]
    assert calls and not any(calls)
    gap = (pa - pb)[mask].abs().max().item()
    print(f"packed (seq_idx) vs unpacked logprobs: max |d| {gap:.2e}")
    assert gap < 2e-3  # Triton's dots may run in TF32; the chunks fall at other places in a packed row
    packed.mamba_mixers = 0  # the keyword withheld: one state runs across each row's sequences
    assert (packed.logprobs(batch)[0] - pb)[mask].abs().max() > 1e-2
    packed.mamba_mixers = 1
    den = [float(batch.response_mask.sum())]
    packed.opt.step = padded.opt.step = lambda: None  # the gradients stay as the backward left them
    oa, ob = packed.update([batch], den), padded.update([batch], den)
    print(f"loss {oa['loss']:.6f} vs {ob['loss']:.6f}; grad norm {oa['grad_norm']:.6f} vs {ob['grad_norm']:.6f}")
    assert abs(oa["loss"] - ob["loss"]) < 1e-3 and abs(oa["grad_norm"] - ob["grad_norm"]) < 1e-2 * ob["grad_norm"]
