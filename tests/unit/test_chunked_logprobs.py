"""Logprobs without whole logits (algos.linear_logprobs, the torch worker's LogprobHead): equal to the whole-logits
path (algos.token_logprobs / entropy_from_logits), values and gradients, on the CPU."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_launcher.algos import entropy_from_logits, linear_logprobs, token_logprobs
from grpo_launcher.logit_heads import LogitTransform
from grpo_launcher.policy.torch_policy import LogprobHead, TorchPolicyWorker
from grpo_launcher.spec.compose import load_spec
from unit.test_hybrid import SMALL, rollout_batch, setup


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_logprobs_equal_whole_logits_with_gradients(chunk):
    torch.manual_seed(0)
    N, H, V, temp = 23, 8, 40, 0.7
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    t, g = torch.randint(0, V, (N,)), torch.randn(N, dtype=torch.float64)
    lp, ent = linear_logprobs(h, w, t, temperature=temp, chunk=chunk)
    (lp * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = h @ w.t() / temp
    want = token_logprobs(logits, t)
    (want * g).sum().backward()
    assert torch.allclose(lp, want, atol=1e-12) and torch.allclose(ent, entropy_from_logits(logits), atol=1e-12)
    assert torch.allclose(gh, h.grad, atol=1e-12) and torch.allclose(gw, w.grad, atol=1e-12)
    assert not ent.requires_grad  # a metric


TRANSFORMS = {"none": None, "softcap": LogitTransform(softcap=1.5), "multiply": LogitTransform(multiply=3.0),
              "divide": LogitTransform(divide=4.0), "both": LogitTransform(multiply=2.0, softcap=2.5)}


@pytest.mark.parametrize("kind", TRANSFORMS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logprobs_apply_the_family_post_processing_and_bias(kind, with_bias):
    """softmax(f(h w^T + b) / T) chunk by chunk = the whole logits put through f (Gemma's cap·tanh(z/cap), Granite's
    z/s, Cohere's z·s), values and gradients in hidden, weight and bias."""
    torch.manual_seed(2)
    N, H, V, temp, f = 19, 6, 30, 0.8, TRANSFORMS[kind]
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if with_bias else None
    t, g = torch.randint(0, V, (N,)), torch.randn(N, dtype=torch.float64)
    lp, ent = linear_logprobs(h, w, t, bias=b, transform=f, temperature=temp, chunk=4)
    params = [h, w] + ([b] if b is not None else [])
    got = torch.autograd.grad((lp * g).sum(), params)
    z = torch.nn.functional.linear(h, w, b)
    logits = (f(z) if f is not None else z) / temp
    want = token_logprobs(logits, t)
    expect = torch.autograd.grad((want * g).sum(), params)
    assert torch.allclose(lp, want, atol=1e-12) and torch.allclose(ent, entropy_from_logits(logits), atol=1e-12)
    for a, e in zip(got, expect):
        assert torch.allclose(a, e, atol=1e-12)


def test_chunked_logprobs_pass_gradcheck_and_follow_autocast():
    torch.manual_seed(1)
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 9, (6,))
    assert torch.autograd.gradcheck(lambda a, b: linear_logprobs(a, b, t, chunk=4)[0], (h, w))
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the GEMMs in bf16, the softmax in fp32, grads in fp32
        lp, _ = linear_logprobs(h32, w32, t, chunk=4)
        want = token_logprobs(torch.nn.functional.linear(h32, w32), t)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and w32.grad.dtype == torch.float32
    assert (lp - want).abs().max() < 1e-6


@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_the_worker_with_a_chunked_head_equals_whole_logits(model_root, kl):
    """The separate logprob pass, the update's loss, grad norm and new weights (and the reference's KL) match."""
    spec, env, model_dir = setup(model_root)
    over = [f"output_root={model_root}", *SMALL, f"loss.kl_coef={kl}"]
    chunked = TorchPolicyWorker(load_spec([*over, "train.logprob_chunk_tokens=7"]), model_dir, 0, 1)
    whole = TorchPolicyWorker(load_spec([*over, "train.logprob_chunk_tokens=0"]), model_dir, 0, 1)
    assert isinstance(chunked.model.lm_head, LogprobHead) and isinstance(whole.model.lm_head, torch.nn.Linear)
    assert chunked.model.state_dict().keys() == whole.model.state_dict().keys()
    batch = rollout_batch(chunked, env)  # the engine shares the chunked model: its head gives plain logits then
    mask = batch.response_mask.bool()
    (pa, ra), (pb, rb) = chunked.logprobs(batch), whole.logprobs(batch)
    assert (pa - pb)[mask].abs().max() < 1e-5
    if kl:
        assert (ra - rb)[mask].abs().max() < 1e-5
    den = [float(batch.response_mask.sum())]
    chunked.opt.step = whole.opt.step = lambda: None  # the gradients stay as the backward left them
    oa, ob = chunked.update([batch], den), whole.update([batch], den)
    for k in ("loss", "kl", "entropy", "grad_norm"):
        assert abs(oa[k] - ob[k]) < 1e-5, k
    for (k, x), y in zip(chunked.model.named_parameters(), whole.model.parameters()):  # Adam's first step is ~lr·sign(g)
        assert torch.allclose(x.grad, y.grad, atol=1e-6), k  # (the grads before the step: no step taken)


class _BF16Casts(TorchDispatchMode):
    """Counts casts to bf16 of tensors (weights or activations) that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.n += func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
        return func(*args, **kwargs)


def test_weight_casts_kept_over_a_step_give_todays_update(model_root, monkeypatch):
    """bf16 autocast (on the CPU here, as a GPU run does): one region per optimizer step, each weight cast once,
    equals today's region per micro-batch (a cast per micro-batch) on loss, grad norm and new weights."""
    spec, env, model_dir = setup(model_root)
    spec = load_spec([f"output_root={model_root}", *SMALL, "train.micro_batch_size=4"])  # 8 micro-batches
    kept, per_mb = TorchPolicyWorker(spec, model_dir, 0, 1), TorchPolicyWorker(spec, model_dir, 0, 1)
    batch = rollout_batch(kept, env)
    kept.autocast = per_mb.autocast = True
    monkeypatch.setattr(per_mb, "_weight_casts_kept", nullcontext)  # today's: the forward's own region only
    den = [float(batch.response_mask.sum())]
    with _BF16Casts() as ca:
        oa = kept.update([batch], den)
    with _BF16Casts() as cb:
        ob = per_mb.update([batch], den)
    linears = sum(isinstance(m, torch.nn.Linear) for m in kept.model.modules())
    assert cb.n - ca.n >= 7 * linears  # each linear's weight cast once instead of 8 times
    assert abs(oa["loss"] - ob["loss"]) < 1e-6 and abs(oa["grad_norm"] - ob["grad_norm"]) < 1e-5
    for (k, x), y in zip(kept.model.state_dict().items(), per_mb.model.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6), k


def test_fused_kernels_stay_off_on_cpu_and_true_there_is_refused():
    from grpo_launcher.policy import fused
    from grpo_launcher.spec.errors import ConfigError

    assert not fused.wanted(None, "qwen2", torch.device("cpu"))  # null: off on CPU
    assert not fused.wanted(None, "nemotron_h", torch.device("cuda"))  # no Liger mapping for the family
    with pytest.raises(ConfigError) as info:
        load_spec(["train.fused_kernels=true"])  # the default run: CPU
    (v,) = [v for v in info.value.violations if "train.fused_kernels" in v.keys]
    assert "GPUs" in v.message
