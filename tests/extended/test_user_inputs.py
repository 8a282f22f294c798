"""What the user gave is what the run used (issue 30): data read as written, changed keys applied or refused on
resume, any causal LM's config.json, default run names that do not collide.

The fast tests run launch.py's main in this process (pre-flight and dry runs: nothing started); the `slow`
ones train a couple of steps through `python launch.py`.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import launch, share_models
from unit.test_user_inputs import REWARDS, dataset_args, reverse_jsonl, write_csv


# ----------------------------------------------------------------------------- 2. resume truth
# a small run: 4 prompts × 4 samples, one optimizer step, validation and a checkpoint every step
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "checkpoint.save_period=1", "grpo.val_period=1", "model.warm_start_steps=5"]


@pytest.mark.slow
@pytest.mark.extended
def test_resume_with_a_new_lr_trains_with_it(tmp_path):
    """`name=lrtest grpo.max_steps=2`, then `... grpo.max_steps=3 train.lr=1e-5 loss.clip_high=0.28`: step 3 trains
    at 1e-5 (the loaded optimizer state no longer brings 3e-4 back), and the change is recorded (file, MLflow)."""
    from mlflow.tracking import MlflowClient

    common = ["name=lrtest", f"output_root={tmp_path}", *SMALL]
    first = launch(*common, "grpo.max_steps=2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    second = launch(*common, "grpo.max_steps=3", "train.lr=1e-5", "loss.clip_high=0.28")
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "resuming from step_000002" in second.stdout and "applied from step 3" in second.stdout
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "lrtest" / "metrics.jsonl").read_text().splitlines())}
    assert rows[2]["train/lr"] == pytest.approx(3e-4) and rows[3]["train/lr"] == pytest.approx(1e-5), rows
    (rec,) = map(json.loads, (tmp_path / "lrtest" / "spec_changes.jsonl").read_text().splitlines())
    assert rec["from_step"] == 3 and set(rec["changes"]) == {"grpo.max_steps", "train.lr", "loss.clip_high"}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    assert run.data.params["train.lr"] == "0.0003" and run.data.params["train.lr/from_step_3"] == "1e-05"
    assert "grpo.spec_change/from_step_3" in run.data.tags


@pytest.mark.slow
@pytest.mark.extended
def test_reward_errors_zero_trains_on_with_per_function_metrics_and_rows_logged(tmp_path):
    """A reward function raises on one row: with env.reward_errors=zero the run goes on, counts it
    (train/reward_errors), keeps the first traceback in RUN_DIR/reward_errors.txt; each function has its own
    train/ and val/ mean; the train-data log has each row's id, answer, completion and per-function rewards."""
    share_models(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    train, val = reverse_jsonl(tmp_path / "train.jsonl", 16), reverse_jsonl(tmp_path / "val.jsonl", 4, "val")
    run = launch(*dataset_args(train, val, "env.reward_fns=[rewards.py:correct,rewards.py:flaky]",
                               "env.reward_errors=zero", "env.shuffle=false", "logging.train_data_log=true",
                               "grpo.max_steps=2", f"output_root={tmp_path}", "logging.mlflow=false", *SMALL[:6],
                               "grpo.val_period=1", "rollout.max_new_tokens=6"), cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    run_dir = tmp_path / "tiny-grpo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/reward_errors"] for r in rows] == [0.0, 4.0]  # row-5 is in step 2, 4 samples of it
    assert all(0 <= r["train/reward/correct_mean"] <= 1 and "val/reward/flaky_mean" in r for r in rows)
    assert rows[1]["train/reward/flaky_mean"] == pytest.approx(0.5 * 12 / 16)
    kept = (run_dir / "reward_errors.txt").read_text()
    assert "rewards.py:flaky raised ValueError: cannot parse this one" in kept and f"{train}:6" in kept
    assert "Traceback" in kept and "kept in" in run.stdout
    recs = [json.loads(line) for line in (run_dir / "train_data" / "train_data_step_000002.jsonl").read_text()
            .splitlines()]
    bad = [r for r in recs if r["row_id"] == f"{train}:6"]
    assert len(bad) == 4 and all(r["reward_parts"]["flaky"] == 0.0 for r in bad)
    r = recs[0]
    assert r["row_id"] == f"{train}:5" and r["answer"] == json.loads(train.read_text().splitlines()[4])["answer"]
    assert r["rewards"] == pytest.approx(r["reward_parts"]["correct"] + r["reward_parts"]["flaky"])
    assert r["content"].endswith(r["completion"]) or r["completion"] in r["content"]
    prompting = json.loads((run_dir / "prompting.json").read_text())  # no chat template: system prompt none
    assert prompting["first_prompt"]["val"] == "0000>" and prompting["first_prompt"]["train"] == "0000>"
    assert prompting["system_prompt_source"]["train"] == "16 prompts: none (env.system_prompt is null)"


# GPT-2 as save_pretrained writes it (n_inner: null) + a byte-level tokenizer without a chat template, no hub
MAKE_GPT2 = '''
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

vocab = {c: i for i, c in enumerate(["<|endoftext|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|endoftext|>")
model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0))
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
'''

AS_WRITTEN = '''
def digits(prompt, completion, answer, **row):
    """Every answer of the file has 4 digits, some with a leading zero: it must arrive as that string."""
    assert isinstance(answer, str) and len(answer) == 4, (answer, row)
    return float(completion.strip() == answer)
'''


@pytest.mark.slow
@pytest.mark.extended
def test_gpt2_trains_on_a_csv_read_as_written(tmp_path):
    """A GPT-2 made with save_pretrained (n_inner: null) trains 2 steps through launch.py on a CSV whose answers
    keep their leading zeros when they reach the reward function."""
    import sys

    model = tmp_path / "tiny-gpt2"
    made = subprocess.run([sys.executable, "-c", MAKE_GPT2, str(model)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    assert json.loads((model / "config.json").read_text())["n_inner"] is None
    rows = [f"{n:04d}"[::-1] + "," + f"{n:04d}" for n in (487, 12, 3310, 905, 4021, 78, 6600, 1234)]
    data = write_csv(tmp_path / "rev.csv", "prompt,answer\n" + "\n".join(rows) + "\n")
    (tmp_path / "rewards.py").write_text(AS_WRITTEN)
    run = launch(f"model.path={model}", "env=dataset", f"env.train_path={data}", f"env.val_path={data}",
                 "env.reward_fn=rewards.py:digits", "env.max_prompt_tokens=16", "rollout.max_new_tokens=6",
                 "train.max_total_sequence_length=32", "grpo.max_steps=2", f"output_root={tmp_path}",
                 "logging.mlflow=false", *SMALL[:6], cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert "ffn_hidden_size: 256" in (tmp_path / "tiny-grpo" / "spec.yaml").read_text()  # 4 × n_embd
