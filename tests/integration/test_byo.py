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

REWARDS = '''
def correct(prompt, completion, answer, **row):
    """1 for the exact reversal; the row's other columns (here `id`) arrive as keyword arguments."""
    assert "id" in row, row
    return float(completion.strip() == answer)


def short(prompt, completion, **row):
    return 1.0 if len(completion.strip()) <= 4 else 0.0
'''

# a small training config: 4 prompts × 4 samples, one optimizer step, validation every step
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "rollout.max_new_tokens=6", "env.max_prompt_tokens=64", "train.max_total_sequence_length=72"]
EVERY_STEP = ["checkpoint.save_period=1", "grpo.val_period=1"]  # validate and checkpoint each step


def write_jsonl(path: Path, rows: list[dict], blank_first: bool = False) -> Path:
    path.write_text(("\n" if blank_first else "") + "".join(json.dumps(r) + "\n" for r in rows))
    return path


def reverse_rows(n: int, start: int = 0, prefix: str = "row") -> list[dict]:
    out = []
    for i in range(start, start + n):
        s = f"{(i * 7919) % 10000:04d}"
        out.append({"prompt": f"{s}>", "answer": s[::-1], "id": f"{prefix}-{i}"})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model directory the way a user makes one: transformers' save_pretrained (script outside the package)."""
    d = tmp_path_factory.mktemp("byo")
    (d / "make_model.py").write_text(MAKE_MODEL)
    subprocess.run([sys.executable, "make_model.py", "my-model"], cwd=d, check=True, capture_output=True, timeout=300)
    return d / "my-model"


@pytest.fixture
def user(tmp_path: Path) -> Path:
    """A user's working directory: train/val JSONL and a reward file, nothing inside the package."""
    write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    write_jsonl(tmp_path / "val.jsonl", reverse_rows(8, start=100, prefix="val"))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def data_args(d: Path, **extra: str) -> list[str]:
    args = {"env": "dataset", "env.train_path": str(d / "train.jsonl"), "env.val_path": str(d / "val.jsonl"),
            "env.reward_fn": "rewards.py:correct", "output_root": str(d / "out"), **extra}
    return [f"{k}={v}" for k, v in args.items()]


# ------------------------------------------------------------------ pre-flight (fast)


def test_broken_data_and_reward_all_named_at_once(user):
    """A missing key (file:line, blank lines counted), a bad reward file, mismatched weights: one config error."""
    rows = reverse_rows(4)
    del rows[1]["prompt"]
    write_jsonl(user / "train.jsonl", rows, blank_first=True)  # the row without 'prompt' is on line 3
    (user / "broken.py").write_text("def f(prompt, completion):\n    return 1.0 +\n")
    r = launch(*data_args(user, **{"env.reward_fn": "null", "env.reward_fns": "[broken.py:f,rewards.py:nope]",
                                         "env.reward_weights": "[1.0]"}), cwd=user)
    assert r.returncode == 2, r.stderr
    err = r.stderr
    assert "config error" in err and "Traceback" not in err
    assert "env.train_path" in err and "1 row without 'prompt' (env.prompt_key): line 3" in err, err
    assert f"{user / 'train.jsonl'}:3 has the keys ['answer', 'id']" in err, err
    assert "env.reward_weights" in err and "1 weight(s) for 2 reward functions" in err
    assert "env.reward_fns[0]" in err and "SyntaxError" in err and "line 2" in err, err
    assert "env.reward_fns[1]" in err and "defines no 'nope'" in err, err


@pytest.mark.parametrize("case,expect", [
    ("missing", "no file"),
    ("empty", "holds no rows"),
    ("malformed", "train.jsonl: 1 row with invalid JSON: line 3 (Expecting"),
    ("signature", "cannot be called as fn(prompt, completion, **row)"),
    ("no_function", "defines no 'nope'"),
    ("too_long", "exceed env.max_prompt_tokens=64"),
])
def test_preflight_names_file_line_or_key(launch_here, user, case, expect):
    extra = {}
    if case == "missing":
        extra["env.train_path"] = str(user / "nope.jsonl")
    elif case == "empty":
        (user / "train.jsonl").write_text("\n")
    elif case == "malformed":
        (user / "train.jsonl").write_text('{"prompt": "1>", "answer": "1", "id": 1}\n\n{"prompt": "2>",\n')
    elif case == "signature":
        (user / "strict.py").write_text("def score(prompt, completion, answer):\n    return 0.0\n")
        extra["env.reward_fn"] = "strict.py:score"  # the rows also have `id`: no **kwargs to take it
    elif case == "no_function":
        extra["env.reward_fn"] = "rewards.py:nope"
    elif case == "too_long":
        write_jsonl(user / "val.jsonl", reverse_rows(3) + [{"prompt": "9" * 80 + ">", "answer": "1", "id": "x"}])
    r = launch_here(user, *data_args(user, **extra), *SMALL)
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr
    if case == "too_long":
        assert f"{user / 'val.jsonl'}:4" in r.stderr and "the longest, 81 tokens" in r.stderr, r.stderr


def test_parquet_and_saved_datasets_dirs_dry_run(launch_here, user):
    """Parquet (train) and a `datasets` save_to_disk directory (val) load through `datasets`; columns mapped."""
    import datasets

    rows = [{"question": r["prompt"], "solution": r["answer"], "id": r["id"]} for r in reverse_rows(16)]
    datasets.Dataset.from_list(rows).to_parquet(str(user / "train.parquet"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows[:4])}).save_to_disk(str(user / "val_ds"))
    r = launch_here(user, *data_args(user, **{"env.train_path": str(user / "train.parquet"),
                                              "env.val_path": str(user / "val_ds"), "env.prompt_key": "question",
                                              "env.answer_key": "solution", "env.reward_fn": "rewards.py:short",
                                              "dry_run": "true"}), *SMALL)
    assert r.returncode == 0, r.stderr
    r = launch_here(user, *data_args(user, **{"env.train_path": str(user / "train.parquet"), "env.prompt_key": "q",
                                              "dry_run": "true"}), *SMALL)
    assert r.returncode == 2 and "no row has 'q' (env.prompt_key)" in r.stderr
    assert "the columns: question, solution, id" in r.stderr, r.stderr
    assert "val.jsonl:\n      no row has 'q'" in r.stderr, r.stderr  # every problem of both files at once


def test_user_env_class_and_reward_checked_at_preflight(launch_here, user):
    (user / "envs.py").write_text("class NotAnEnv:\n    pass\n")
    r = launch_here(user, "env.name=envs.py:NotAnEnv", f"output_root={user / 'out'}", "dry_run=true")
    assert r.returncode == 2 and "is not an Env class (no train_prompts, val_prompts, score method)" in r.stderr
    r = launch_here(user, "env.name=no_such_module:Env", f"output_root={user / 'out'}", "dry_run=true")
    assert r.returncode == 2 and "no module named 'no_such_module'" in r.stderr, r.stderr
    r = launch_here(user, "env.reward_fn=rewards.py:correct", f"output_root={user / 'out'}", "dry_run=true")
    assert r.returncode == 2 and "env=toy has its own scorer" in r.stderr


def test_rerun_relaunches_the_saved_spec(launch_here, user):
    """`launch.py rerun RUN_DIR` validates the run's resolved spec again under a fresh name."""
    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    spec = load_spec(data_args(user, name="h13-orig", **{"env.epochs": "2", "env.reward_fn": f"{user}/rewards.py:correct"})
                     + SMALL[:5] + ["grpo.max_steps=16"])
    run_dir = user / "out" / "h13-orig"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    r = launch_here(user, "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert "rerunning" in r.stdout and "'h13-orig-rerun1'" in r.stdout and "dry run" in r.stdout
    r = launch_here(user, "rerun", str(run_dir), "dry_run=true", "grpo.max_steps=10")  # env.epochs=2 → 16 steps
    assert r.returncode == 2 and "env.epochs" in r.stderr and "set grpo.max_steps=16" in r.stderr, r.stderr


def test_rerun_from_another_directory_works_from_the_launch_directory(launch_here, user, monkeypatch, tmp_path_factory):
    """A spec's relative paths (data, reward file) are the launch directory's: rerun works from there."""
    import json

    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    monkeypatch.chdir(user)
    spec = load_spec(["env=dataset", "env.train_path=train.jsonl", "env.val_path=val.jsonl",
                      "env.reward_fn=rewards.py:correct", "output_root=out", "name=h13-rel", *SMALL[:5]])
    run_dir = user / "out" / "h13-rel"
    (run_dir / "repro").mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    (run_dir / "repro" / "git.json").write_text(json.dumps({"cwd": str(user)}))
    r = launch_here(tmp_path_factory.mktemp("elsewhere"), "rerun", str(run_dir), "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert f"working from {user}" in r.stdout and "'h13-rel-rerun1'" in r.stdout, r.stdout


def test_dataset_order_epochs_and_resume_safety():
    """Every row once per epoch, a new order each epoch, the same prompts for the same step (resume-safe)."""
    from grpo_launcher.envs import make_env
    from grpo_launcher.spec.compose import load_spec

    spec = load_spec(["env=dataset", "grpo.num_prompts_per_step=16", "grpo.max_steps=64",
                      f"env.train_path={ROOT / 'data/reverse_train.jsonl'}", f"env.val_path={ROOT / 'data/reverse_val.jsonl'}"])
    env = make_env(spec)
    rows = len(env.table("train").rows)  # the sample file: 512 rows → 32 steps an epoch
    epoch1 = [p.source for s in range(1, 33) for p in env.train_prompts(s, 0, 16)]
    epoch2 = [p.source for s in range(33, 65) for p in env.train_prompts(s, 0, 16)]
    assert len(set(epoch1)) == len(set(epoch2)) == rows and epoch1 != epoch2
    assert [p.source for p in make_env(spec).train_prompts(40, 0, 16)] == epoch2[7 * 16:8 * 16]


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
