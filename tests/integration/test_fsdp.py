"""FSDP2 for train.backend=torch (policy/fsdp.py): the sharded step equals the plain module's, the full weights
come back for refit and checkpoints, and a checkpoint resumes at another DP size. The 2-rank update ≡ 1-rank update
on the same batch is tests/integration/test_grpo_loop.py::test_two_worker_dp_update_equals_one_worker (2 ranks now shard)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, policy_ranks


# ------------------------------------------------------------------ through launch.py (slow)

REWARD = '''
def varied(prompt, completion, **row):
    """A reward that differs between samples (an untrained model never reverses the digits): nonzero advantages."""
    return (sum(map(ord, completion)) % 7) / 6
'''
SMALL = ["train.backend=torch", "rollout=hf", "env=dataset", "env.reward_fn=rewards.py:varied",
         "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=8", "grpo.val_batch_size=8", "grpo.max_val_samples=8",
         "rollout.max_new_tokens=6", "env.max_prompt_tokens=64", "train.max_total_sequence_length=72",
         "checkpoint.save_period=2", "grpo.val_period=2", "logging.mlflow=false"]


def _user_dir(tmp_path):
    rows = [{"prompt": f"{(i * 7919) % 10000:04d}>", "answer": f"{(i * 7919) % 10000:04d}"[::-1]} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    (tmp_path / "rewards.py").write_text(REWARD)
    return [f"env.train_path={tmp_path / 'train.jsonl'}", f"env.val_path={tmp_path / 'val.jsonl'}",
            f"output_root={tmp_path / 'out'}", *SMALL]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nemotron_h_trains_on_two_fsdp_ranks_and_exports(tmp_path):
    """model.family=nemotron_h (Mamba-2 / MoE / attention, pure torch) through launch.py on 2 CPU ranks: FSDP2
    update (routers frozen, layers checkpointed, sequences packed with the Mamba layers run per sequence, as the
    recipe asks), the hybrid engines refit from the gathered weights, a checkpoint exported as one HF directory."""
    from transformers import AutoModelForCausalLM

    from helpers import launch
    from nemotron_tiny import tiny_nemotron_h

    model = tiny_nemotron_h()
    r = launch(f"model.path={model}", "cluster.cpu_workers_per_node=2", "grpo.max_steps=2", "name=nh",
               "train.moe.freeze_router=true", "train.activation_checkpointing=true", "train.sequence_packing=true",
               *_user_dir(tmp_path), cwd=tmp_path)
    assert r.returncode == 0 and "finished at step 2" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    m = _metrics(tmp_path / "out" / "nh")
    assert [x["step"] for x in m] == [1, 2] and all(x["train/grad_norm"] > 0 for x in m)
    # the engines generate (unpacked) with the refitted weights: their logprobs match the packed policy's each step
    assert all(x["train/gen_vs_policy_logprob_absdiff"] < 1e-4 for x in m)
    r = launch("export", str(tmp_path / "out" / "nh"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out" / "nh" / "export" / "step_000002"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["NemotronHForCausalLM"]
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    assert trained.keys() == start.keys()
    routers = [k for k in start if k.endswith("mixer.gate.weight")]
    bf16 = {k: v.to(torch.bfloat16).float() for k, v in start.items()}  # export writes bf16 (--dtype)
    assert len(routers) == 2 and all(torch.equal(trained[k], bf16[k]) for k in routers)  # freeze_router
    assert any(not torch.equal(trained[k], bf16[k]) for k in start)  # the two updates moved the other weights


@pytest.mark.slow
@pytest.mark.extended
def test_sharded_checkpoint_resumes_on_one_rank(tmp_path):
    """A checkpoint written by 2 FSDP2 ranks resumes on 1 (full, name-keyed files: any DP size reads them)."""
    from helpers import launch, tiny_model

    args = [f"model.path={tiny_model()}", "name=dp", *_user_dir(tmp_path)]
    r = launch(*args, "cluster.cpu_workers_per_node=2", "grpo.max_steps=2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = launch(*args, "cluster.cpu_workers_per_node=1", "grpo.max_steps=3", cwd=tmp_path)
    assert r.returncode == 0 and "resuming from step_000002" in r.stdout and "finished at step 3" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]
    assert [x["step"] for x in _metrics(tmp_path / "out" / "dp")][-1] == 3


@pytest.mark.slow
@pytest.mark.extended
def test_nemotron_h_two_rank_fsdp_update_equals_one_rank(tmp_path):
    """The hybrid family (Mamba-2 state, top-2 routing: each rank routes its rows to other experts) under FSDP2:
    the 2-rank update equals the unsharded 1-rank update on the same batch, as the dense one does in
    tests/integration/test_grpo_loop.py."""
    import ray
    from transformers import AutoTokenizer

    from grpo_launcher.policy.torch_policy import local_denominator
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.batch import Generation, collate, shard_rows
    from nemotron_tiny import tiny_nemotron_h

    model_dir = str(tiny_nemotron_h())
    spec = load_spec([f"model.path={model_dir}", "train.micro_batch_size=4", "train.global_batch_size=16",
                      "train.activation_checkpointing=true", f"output_root={tmp_path}"])
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 250, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(16)]
    gens = [Generation(torch.randint(3, 250, (4,), generator=g).tolist(), r, [-1.0] * len(r), truncated=False)
            for r in responses]
    batch = collate(gens, torch.randn(16, generator=g), torch.ones(16),
                    AutoTokenizer.from_pretrained(model_dir).pad_token_id)
    with policy_ranks(spec, model_dir) as (single, pair):
        prev, _ = ray.get(single.logprobs.remote(batch))
        batch = batch.with_(prev_logprobs=prev)
        halves = ray.get([w.logprobs.remote(batch.select(shard_rows(16, 2, r))) for r, w in enumerate(pair)])
        den = local_denominator("token_mean", batch.response_mask * batch.sample_mask[:, None])
        m1 = ray.get(single.update.remote([batch], [den]))
        m2 = ray.get([w.update.remote([batch.select(shard_rows(16, 2, r))], [den]) for r, w in enumerate(pair)])
        one, two = ray.get([single.state_dict.remote(), *[w.state_dict.remote() for w in pair]])[:2]
    mask = batch.response_mask.bool()
    sharded_prev = torch.cat([h[0] for h in halves])  # shard_rows: contiguous halves
    torch.testing.assert_close(sharded_prev[mask], prev[mask], rtol=1e-5, atol=1e-5)  # logprobs
    assert abs(m1["loss"] - (m2[0]["loss"] + m2[1]["loss"])) < 1e-5
    assert abs(m1["grad_norm"] - m2[0]["grad_norm"]) < 1e-4 * max(1.0, m1["grad_norm"]) and m1["grad_norm"] > 0
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("ranks", [1, 2])
def test_nemotron_h_tiny_learns_through_launch(tmp_path, ranks):
    """model=nemotron_h_tiny (Nano's layer pattern in miniature, built and warm-started here) learns the toy task
    through launch.py on the torch backend: one rank (the plain module) and two (FSDP2, built on the meta device);
    the routers' load is logged each step (train/moe/*)."""
    from helpers import launch, share_models

    share_models(tmp_path)
    r = launch("model=nemotron_h_tiny", f"cluster.cpu_workers_per_node={ranks}", "grpo.max_steps=60", "name=nh",
               f"output_root={tmp_path}", "logging.mlflow=false", cwd=tmp_path, timeout=1800)
    assert r.returncode == 0 and "finished at step 60" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    m = _metrics(tmp_path / "nh")
    rewards = [x["train/reward_mean"] for x in m]
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.3, rewards
    assert all(0 < x["train/moe/entropy"] <= 1 and 1 <= x["train/moe/max_load"] <= 4 for x in m)
    assert {"train/moe/layer_1/max_load", "train/moe/layer_3/entropy"} <= m[0].keys()  # per MoE layer (1 and 3)


@pytest.mark.slow
@pytest.mark.extended
def test_the_readmes_scaled_down_recipe_runs_as_written(tmp_path):
    """README's "recipe scaled down to this machine" block, parsed from the README and run as written (plus an
    output root): +recipe=nanov3 on model=nemotron_h_tiny with every setting this build honours, packing included."""
    import shlex

    from helpers import launch, share_models

    readme = (ROOT / "README.md").read_text()
    block = readme.split("The recipe scaled down to this machine", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    args = shlex.split(block.replace("\\\n", " "))
    assert args[:2] == ["python", "launch.py"] and "+recipe=nanov3" in args, args
    share_models(tmp_path)
    r = launch(*args[2:], f"output_root={tmp_path}", cwd=tmp_path, timeout=1800)
    assert r.returncode == 0 and "finished at step 10" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    spec = (tmp_path / "nanov3-grpo" / "spec.yaml").read_text()
    assert "sequence_packing: true" in spec and "activation_checkpointing: true" in spec
    assert all("train/moe/max_load" in x for x in _metrics(tmp_path / "nanov3-grpo"))
