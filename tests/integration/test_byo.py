"""Bring your own model, data, prompts and reward — through `launch.py`, as a user would.

Every fixture lives outside the package (tmp_path): a model dir written by transformers' save_pretrained, JSONL /
Parquet / saved `datasets` data, a reward file. The fast tests stop at pre-flight (exit 2, `config error`
naming the key and the file:line) or at a dry run; the `slow` ones train a couple of steps on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import ROOT, launch
from unit.test_byo import REWARDS, SMALL, data_args
from unit.test_byo import user  # noqa: F401  (fixtures)


# The README's "bring your own" model: a byte-level tokenizer with a ChatML template + a small Qwen2, no hub.
MAKE_MODEL = '''
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
vocab = {c: i for i, c in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                    additional_special_tokens=["<|im_start|>"])
tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
model = Qwen2ForCausalLM(Qwen2Config(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
'''
EVERY_STEP = ["checkpoint.save_period=1", "grpo.val_period=1"]  # validate and checkpoint each step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model directory the way a user makes one: transformers' save_pretrained (script outside the package)."""
    d = tmp_path_factory.mktemp("byo")
    (d / "make_model.py").write_text(MAKE_MODEL)
    subprocess.run([sys.executable, "make_model.py", "my-model"], cwd=d, check=True, capture_output=True, timeout=300)
    return d / "my-model"


# ------------------------------------------------------------------ training (slow)


@pytest.mark.slow
def test_bring_your_own_end_to_end(user, model_dir):
    """The README example: own model dir + JSONL + reward file + chat template → train, report, export, refuse
    a finished name, extend it, record what ran."""
    args = [*data_args(user, name="h13-byo"), f"model.path={model_dir}", "env.chat_template=true",
            "env.system_prompt=Reverse the digits.", "logging.train_data_log=true", *SMALL, *EVERY_STEP]
    r = launch(*args, "grpo.max_steps=2", cwd=user)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = user / "out" / "h13-byo"
    assert "finished at step 2" in r.stdout and "run dir" in r.stdout and "reward curve" in r.stdout
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what ran: spec, git commit + uncommitted diff, pip freeze, the user's reward file, the data's hashes
    git = json.loads((run_dir / "repro" / "git.json").read_text())
    assert len(git["commit"]) == 40 and (run_dir / "repro" / "uncommitted.diff").exists()
    assert "torch==" in (run_dir / "repro" / "pip-freeze.txt").read_text()
    assert (run_dir / "repro" / "user_code" / "rewards.py").read_text() == REWARDS
    assert "sha256" in json.dumps(json.loads((run_dir / "repro" / "data.json").read_text()))
    # the chat template and system prompt went into the model's input, and the train-data log says so
    prompting = json.loads((run_dir / "train_data" / "prompting.json").read_text())
    assert prompting["chat_template"] and prompting["system_prompt"] == "Reverse the digits."
    rec = json.loads((run_dir / "train_data" / "train_data_step_000002.jsonl").read_text().splitlines()[0])
    assert rec["content"].startswith("<|im_start|>system\nReverse the digits.<|im_end|>\n<|im_start|>user\n")
    # a local run is found by status/logs, its output is in RUN_DIR/logs/
    r = launch("status", "h13-byo", "--root", str(user / "out"), cwd=user)
    assert r.returncode == 0 and "COMPLETED" in r.stdout and "2/2" in r.stdout, r.stdout + r.stderr
    r = launch("logs", "h13-byo", "--root", str(user / "out"), cwd=user)
    assert r.returncode == 0 and "step 2/2" in r.stdout and "finished at step 2" in r.stdout, r.stdout + r.stderr
    assert (run_dir / "logs" / "driver-local.log").is_file()
    # export → a plain HF dir with the tokenizer
    r = launch("export", str(run_dir), cwd=user)
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.split("exported ", 1)[1].split()[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2
    # the same name again: finished, refused before anything is touched; a larger max_steps extends it
    spec_before = (run_dir / "spec.yaml").read_text()
    r = launch(*args, "grpo.max_steps=3", "env.system_prompt=" + "Reverse the digits please. " * 3, cwd=user)
    assert r.returncode == 2 and "(chat template on)" in r.stderr and "exceed env.max_prompt_tokens=64" in r.stderr
    r = launch(*args, "grpo.max_steps=2", cwd=user)
    assert r.returncode == 2 and "already finished (step 2)" in r.stderr and "checkpoint.resume=fresh" in r.stderr
    assert (run_dir / "spec.yaml").read_text() == spec_before
    r = launch(*args, "grpo.max_steps=3", cwd=user)
    assert r.returncode == 0 and "resuming from step_000002" in r.stdout and "finished at step 3" in r.stdout, \
        r.stdout[-2000:] + r.stderr[-2000:]
    assert len(json.loads((run_dir / "repro" / "launches.jsonl").read_text().splitlines()[-1])["commit"]) == 40


@pytest.mark.slow
@pytest.mark.extended
def test_reward_exception_names_function_and_row_and_keeps_checkpoint(user):
    """A reward function that raises on step 2: the error names it and the row (file:line), exit 1, no long
    traceback; step 1's checkpoint is kept and the MLflow run is FAILED (not left RUNNING)."""
    (user / "rewards.py").write_text(REWARDS + textwrap.dedent('''
        def flaky(prompt, completion, answer, id, **row):
            if id == "row-5":
                raise ValueError("cannot parse this one")
            return 0.0
    '''))
    r = launch(*data_args(user, name="h13-flaky", **{"env.reward_fn": "rewards.py:flaky",
                                                            "env.shuffle": "false"}), *SMALL, "grpo.max_steps=3",
               "checkpoint.save_period=10", "grpo.val_period=10", cwd=user)  # no checkpoint yet when step 2 fails
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "reward function rewards.py:flaky raised ValueError: cannot parse this one" in r.stderr
    assert f"{user / 'train.jsonl'}:6" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.split("error:", 1)[1].splitlines()) < 12, r.stderr
    assert (user / "out" / "h13-flaky" / "checkpoints" / "step_000001" / "meta.json").is_file()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{user / 'out' / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    assert run.info.status == "FAILED"


USER_SCRIPT = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from grpo_launcher.envs import ENVS, MathEnv


class AlwaysRight(MathEnv):  # the issue's workaround: subclass, register, call main — must not be ignored
    def score(self, prompt, completion):
        return 1.0


ENVS["always_right"] = AlwaysRight
from launch import main

sys.exit(main(sys.argv[2:]))
'''

ENV_FILE = '''
import random
from grpo_launcher.envs.base import Prompt


class Parity:
    """A user Env: "is N even?" — prompts generated, scored here (multi-sample logic could live in score)."""

    def __init__(self, spec, seed=0):
        self.seed = seed

    def _p(self, n):
        return Prompt(text=f"{n}?", answer="1" if n % 2 == 0 else "0", agent_ref="user/parity")

    def train_prompts(self, step, round_, n):
        rng = random.Random(f"{self.seed}-{step}-{round_}")
        return [self._p(rng.randrange(100)) for _ in range(n)]

    def val_prompts(self):
        return [self._p(n) for n in range(100, 108)]

    def score(self, prompt, completion):
        return 0.25  # a constant: the run's reward proves this class did the scoring

    def warmup_examples(self, n):
        return []
'''


@pytest.mark.slow
@pytest.mark.extended
def test_registered_subclass_and_user_env_class_score_in_the_worker(user):
    (user / "script.py").write_text(USER_SCRIPT)
    base = [f"output_root={user / 'out'}", *SMALL, *EVERY_STEP, "grpo.max_steps=1", "logging.mlflow=false"]
    r = subprocess.run([sys.executable, "script.py", str(ROOT), "env=math", "env.name=always_right", "name=h13-sub",
                        f"env.train_path={ROOT / 'data/math_train.jsonl'}", f"env.val_path={ROOT / 'data/math_val.jsonl'}",
                        *base], cwd=user, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    first = json.loads((user / "out" / "h13-sub" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["train/reward_mean"] == 1.0  # AlwaysRight.score ran in the env worker, not MathEnv's
    (user / "my_envs.py").write_text(ENV_FILE)
    r = launch("env.name=my_envs.py:Parity", "name=h13-cls", *base, cwd=user)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    first = json.loads((user / "out" / "h13-cls" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["train/reward_mean"] == 0.25 and first["val/reward_mean"] == 0.25
