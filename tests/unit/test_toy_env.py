"""env=toy's held-out set: distinct, disjoint from training prompts; a set too large for the task is a config error
(it hung the run)."""

from __future__ import annotations

from grpo_launcher.envs.toy import MAX_VAL_PROMPTS, ReverseDigitsEnv
from grpo_launcher.spec.compose import load_spec


def test_held_out_set_spans_the_task_and_stays_out_of_training():
    env = ReverseDigitsEnv(load_spec(["dry_run=true"]).env)
    val = [p.text for p in env.val_prompts()]
    assert len(val) == len(set(val)) == 64
    train = [p.text for step in range(1, 20) for p in env.train_prompts(step, 0, 64)]
    assert not set(train) & set(val)


def test_the_warm_start_never_sees_a_held_out_prompt():
    """The tiny model's supervised warm start drew its 4,096 pairs from the whole task: 23 of the 64 val prompts (seed 0)
    were among them, with their answers, so val/reward_mean read memorised pairs as learnt. Now it draws as training
    does: the same count, none held out."""
    for n_val in (64, MAX_VAL_PROMPTS):
        env = ReverseDigitsEnv(load_spec(["dry_run=true", f"env.num_val_prompts={n_val}"]).env)
        val = {p.text for p in env.val_prompts()}
        warm = env.warmup_examples(4096)
        assert len(warm) == 4096 and not {prompt for prompt, _ in warm} & val
        assert all(answer == prompt.removesuffix(">")[::-1] for prompt, answer in warm)


def test_a_held_out_set_past_half_the_task_is_refused(tmp_path, launch_here):
    ok = ReverseDigitsEnv(load_spec(["dry_run=true", f"env.num_val_prompts={MAX_VAL_PROMPTS}"]).env)
    assert len(ok.val_prompts()) == MAX_VAL_PROMPTS and len(ok.train_prompts(1, 0, 256)) == 256
    run = launch_here(tmp_path, "env.num_val_prompts=50000", "dry_run=true", f"output_root={tmp_path}")
    assert run.returncode == 2 and "env.num_val_prompts: must be ≤ 5000 for env=toy" in run.stderr, run.stderr
