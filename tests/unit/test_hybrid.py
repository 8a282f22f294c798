"""The hybrid HF engine (rollout=hf inside the policy worker) and the on-policy logprob path, on the CPU."""

from __future__ import annotations

import torch

from grpo_launcher.envs import make_env
from grpo_launcher.policy.torch_policy import TorchPolicyWorker
from grpo_launcher.rollout.hf import HFEngine
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.batch import collate
from helpers import tiny_model

SMALL = ["grpo.num_prompts_per_step=4", "train.global_batch_size=32", "train.micro_batch_size=8",
         "train.logprob_batch_size=32", "logging.mlflow=false"]


def setup(root):
    spec = load_spec([f"output_root={root}", *SMALL])
    env = make_env(spec)
    return spec, env, str(tiny_model(*SMALL))


def rollout_batch(worker, env):
    tok = worker.engine.tokenizer
    prompts = [tok(p.text)["input_ids"] for p in env.train_prompts(1, 0, 4)]
    gens = worker.generate(prompts, 8, seed=3)
    adv = torch.linspace(-1, 1, len(gens))
    return collate(gens, adv, torch.ones(len(gens)), tok.pad_token_id)


def test_cpu_engine_is_the_policy_and_samples_its_distribution(model_root):
    spec, env, model_dir = setup(model_root)
    w = TorchPolicyWorker(spec, model_dir, 0, 1)
    assert w.engine.shared and w.engine.model is w.model and w.refit_engine() == 0.0
    batch = rollout_batch(w, env)
    prev, _ = w.logprobs(batch)
    mask = batch.response_mask.bool()
    assert (prev - batch.generation_logprobs)[mask].abs().max() < 1e-4


def test_a_separate_engine_is_refit_in_place(model_root):
    """What a GPU run does (a copy in the run's precision): after an update the engine holds the new weights."""
    spec, env, model_dir = setup(model_root)
    w = TorchPolicyWorker(spec, model_dir, 0, 1)
    w.engine = HFEngine(spec, model_dir, torch.device("cpu"))  # not shared: the GPU layout
    assert not w.engine.shared
    batch = rollout_batch(w, env)
    before = {k: v.clone() for k, v in w.engine.model.state_dict().items()}
    w.update([batch], [float(batch.response_mask.sum())])
    w.refit_engine()
    engine = w.engine.model.state_dict()
    changed = 0
    for k, v in w.hf_weights().items():
        assert torch.equal(engine[k], v), k
        changed += not torch.equal(before[k], v)
    assert changed > 0  # the update moved weights, and the refit carried them


def test_on_policy_update_equals_the_separate_logprob_pass(model_root):
    """prev_logprobs from the update's own forward (plan.logprobs_from_update) = the separate pass."""
    spec, env, model_dir = setup(model_root)
    a, b = TorchPolicyWorker(spec, model_dir, 0, 1), TorchPolicyWorker(spec, model_dir, 0, 1)
    batch = rollout_batch(a, env)
    den = [float(batch.response_mask.sum())]
    prev, _ = b.logprobs(batch)
    out_a = a.update([batch], den)  # no prev_logprobs: on-policy path
    out_b = b.update([batch.with_(prev_logprobs=prev)], den)
    mask = batch.response_mask.bool()
    assert (out_a["prev_logprobs"] - prev)[mask].abs().max() < 1e-5
    assert abs(out_a["loss"] - out_b["loss"]) < 1e-6 and abs(out_a["grad_norm"] - out_b["grad_norm"]) < 1e-5
    for (k, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-6), k


def test_a_minibatch_without_loss_takes_no_optimizer_step(model_root):
    """Every sample masked (overlong filtering / dynamic sampling): no AdamW step (it would still move the
    weights through momentum and decay), the skip is counted, the on-policy logprobs still come back."""
    spec, env, model_dir = setup(model_root)
    w = TorchPolicyWorker(spec, model_dir, 0, 1)
    batch = rollout_batch(w, env).with_(sample_mask=torch.zeros(32))
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    out = w.update([batch], [0.0])
    assert out["skipped_optimizer_steps"] == 1.0 and out["prev_logprobs"].shape == batch.response_ids.shape
    assert all(torch.equal(before[k], v) for k, v in w.model.state_dict().items())


def test_sampler_with_prompts_of_different_lengths_matches_the_policy(model_root):
    """Left-padded prefill, each prompt's cache shared by its samples: the logprobs the sampler returns are
    the policy's logprobs of the same tokens (a full forward over the right-padded prompt + response)."""
    spec, env, model_dir = setup(model_root)
    w = TorchPolicyWorker(spec, model_dir, 0, 1)
    tok = w.engine.tokenizer
    texts = [p.text for p in env.train_prompts(1, 0, 3)]
    prompts = [tok(t)["input_ids"] for t in (texts[0][:3], texts[1], texts[2] + texts[0])]
    assert len({len(p) for p in prompts}) == 3
    gens = w.generate(prompts, 5, seed=11)
    assert [g.prompt_ids for g in gens] == [p for p in prompts for _ in range(5)]
    batch = collate(gens, torch.zeros(len(gens)), torch.ones(len(gens)), tok.pad_token_id)
    prev, _ = w.logprobs(batch)
    mask = batch.response_mask.bool()
    assert (prev - batch.generation_logprobs)[mask].abs().max() < 1e-4
    again = w.generate(prompts, 5, seed=11)
    assert [g.response_ids for g in again] == [g.response_ids for g in gens]  # the seed fixes the samples


def test_sampler_draws_from_softmax_of_logits_over_temperature(model_root):
    """First tokens of 20,000 samples of one prompt at T=0.7: their frequencies are softmax(logits / 0.7)."""
    from grpo_launcher.rollout.hf import sample

    spec, env, model_dir = setup(model_root)
    w = TorchPolicyWorker(spec, model_dir, 0, 1)
    tok = w.engine.tokenizer
    prompt = tok(env.train_prompts(1, 0, 1)[0].text)["input_ids"]
    with torch.no_grad():
        logits = w.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    want = (logits / 0.7).softmax(-1)  # [V]
    torch.manual_seed(0)
    tokens, logprobs = sample(w.model.eval(), [prompt], 20_000, 0.7, 1, tok.pad_token_id, [tok.eos_token_id])
    got = torch.bincount(tokens[:, 0], minlength=len(want)).float() / len(tokens)
    assert 0.5 * (got - want).abs().sum() < 0.03  # total variation; the sampling noise is ~0.01
    assert torch.allclose(logprobs[:, 0], want.log()[tokens[:, 0]], atol=1e-5)
