"""The CUDA IPC refit's direct load (rollout/vllm_compat.py DIRECT_REFIT, the engine's WeightRefitExtension): which
engines take a packed buffer straight into their weights, what the buffer's tensors are, what is sent.

The load itself runs on a GPU only (vLLM's CPU build repacks each weight after loading, and refits by state dict):
tests/gpu/test_gpu.py and benchmarks/workloads.py (the logprob gap between engine and policy) check it there."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_launcher.rollout import vllm_compat
from grpo_launcher.rollout.checkpoint_names import CheckpointNames
from grpo_launcher.rollout.vllm import WeightRefitExtension


def test_a_packed_buffers_tensors_are_views_of_it_in_their_dtypes_and_shapes():
    """The sender packs each tensor's bytes back to back, all in the engine's dtype (vLLM 0.25's packed producer);
    the engine's views of the buffer are those tensors, without a copy (vLLM's own consumer clones each one)."""
    torch.manual_seed(0)
    sent = [(n, torch.randn(*shape).to(torch.bfloat16)) for n, shape in [("a", (3, 5)), ("b", (7,)), ("c", (2, 2, 2))]]
    packed = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in sent] + [torch.zeros(64, dtype=torch.uint8)])
    info = {"names": [n for n, _ in sent], "shapes": [list(t.shape) for _, t in sent],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in sent],
            "tensor_sizes": [t.numel() * t.element_size() for _, t in sent]}
    got = vllm_compat.packed_views(packed, info)  # the buffer is larger than its contents (a 1 GiB cap)
    assert [n for n, _ in got] == ["a", "b", "c"]
    for (_, want), (_, view) in zip(sent, got):
        assert view.dtype == want.dtype and torch.equal(view, want)
        assert view.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()  # a view, not a copy


class _Worker(WeightRefitExtension):
    """The attributes of vLLM's GPU worker that the extension reads, and its three layerwise-reload RPCs recorded."""

    def __init__(self, model_type: str, quant: str | None):
        model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2))
        for m in model:
            if quant:
                m.quant_method = type(quant, (), {})()
        self.model_runner = type("Runner", (), {"model": model})()
        self.model_config = type("Config", (), {"hf_config": type("HF", (), {"model_type": model_type})()})()
        self.device = torch.device("cuda", 0)
        self.calls: list[str] = []

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("layerwise")

    def finish_weight_update(self):
        self.calls.append("finish")


@pytest.mark.parametrize("model_type,quant,cuda,direct", [
    ("qwen2", "UnquantizedLinearMethod", True, True),
    ("llama", None, True, True),
    ("qwen2", "Fp8LinearMethod", True, False),  # a quantized layer post-processes its weights after loading
    ("qwen3_moe", "UnquantizedLinearMethod", True, False),  # FusedMoE does too
    ("nemotron_h", None, True, False),
    ("qwen2", "UnquantizedLinearMethod", False, False),  # vLLM's CPU linear repacks (and drops) each weight
])
def test_an_engine_loads_a_refit_directly_only_where_nothing_follows_the_load(monkeypatch, model_type, quant, cuda,
                                                                               direct):
    """A DIRECT_REFIT family, unquantized, on CUDA: each buffer goes straight into the weights (one load, no
    layerwise start or finish). Anything else takes vLLM's layerwise reload, as before."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: cuda)
    loaded = []
    monkeypatch.setattr(vllm_compat, "load_packed_ipc", lambda model, info, index: loaded.append((info, index)))
    w = _Worker(model_type, quant)
    assert w.grpo_start_refit() is direct
    w.grpo_load_ipc({"names": []})
    w.grpo_finish_refit()
    assert w.calls == ([] if direct else ["start", "layerwise", "finish"])
    assert loaded == ([({"names": []}, 0)] if direct else [])


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("llama", True), ("qwen2", False), ("nemotron_h", False)])
def test_the_ipc_refit_sends_no_tied_head_to_an_engine_that_loads_directly(tmp_path, family, tied):
    """The tied `lm_head.weight` alias (the embedding again: 0.44 GiB of the 1.5B shape's 3.3, a fourth IPC buffer)
    is not sent over CUDA IPC to a DIRECT_REFIT family: its load copies into the embedding, which the head is. The
    state-dict refit (vLLM-CPU's layerwise reload needs it) and untied heads are unchanged."""
    from nemotron_tiny import CONFIG

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tied)
    cfg = AutoConfig.for_model(family, **(CONFIG if family == "nemotron_h" else small))
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    by_dict = dict(CheckpointNames(str(tmp_path))(model.state_dict().items()))
    by_ipc = dict(CheckpointNames(str(tmp_path), ipc=True)(model.state_dict().items()))
    dropped = {"lm_head.weight"} if cfg.tie_word_embeddings and family in vllm_compat.DIRECT_REFIT else set()
    assert "lm_head.weight" in by_dict and set(by_dict) - set(by_ipc) == dropped
    assert all(torch.equal(by_ipc[k], by_dict[k]) for k in by_ipc)
    assert bool(dropped) == (tied and family != "nemotron_h")
