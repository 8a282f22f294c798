"""`launch.py eval` and `launch.py generate` (issue 31): a checkpoint scored and sampled through the run's own
workers, no training. The refusals run launch.py's main in this process; one slow test trains 2 steps for real,
then evaluates and samples its checkpoints through launch.py.

Issue 42, item 7: `generate MODEL_DIR --prompt '1234>'` with a model whose chat template makes the prompt longer
than the default budget (env.max_prompt_tokens=8) samples (the budget follows the prompts given) instead of a
PromptTooLong traceback; an eval on another val set is written beside the run's own, named after it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from grpo_launcher.launch import eval as ev
from helpers import tiny_model


def test_eval_of_nothing_is_a_config_error(launch_here, tmp_path):
    r = launch_here(tmp_path, "eval", "no-such-run")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("config error") and "'no-such-run' is neither a run dir" in r.stderr
    assert "Traceback" not in r.stderr


def test_generate_needs_a_prompt(launch_here, tmp_path):
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        launch_here(tmp_path, "generate", "somewhere")
    assert exc.value.code == 2


@pytest.mark.parametrize("args, key", [
    (["--step", "3"], "--step"),  # a model dir has no checkpoints
    (["grpo.max_val_sample=3"], "grpo.max_val_sample"),
    (["grpo.val_batch_size"], "grpo.val_batch_size"),  # no '='
    (["cluster=slurm"], "cluster.kind"),  # eval runs here
])
def test_eval_of_a_model_dir_refuses_bad_arguments_naming_them(launch_here, tmp_path, args, key):
    model = tiny_model()
    r = launch_here(tmp_path, "eval", str(model), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("config error") and f"  - {key}" in r.stderr, r.stderr
    assert not (tmp_path / "outputs").exists()  # nothing started


def test_max_steps_zero_points_to_eval(launch_here, tmp_path):
    r = launch_here(tmp_path, "grpo.max_steps=0", "dry_run=true")
    assert r.returncode == 2
    assert "grpo.max_steps" in r.stderr and "launch.py eval" in r.stderr, r.stderr


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The tiny model with a chat template (as an instruct checkpoint has): '1234>' becomes 24 tokens."""
    model = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return model


def test_generate_fits_the_prompt_budget_to_the_prompts_given(chat_model, capsys):
    ns = ev.parse([str(chat_model), "--prompt", "1234>", "--prompt", "56>"], "generate")
    t = ev.fit_prompt_budget(ev.target(ns), ns.prompt, ns.overrides)
    assert t.spec.env.max_prompt_tokens == 24  # <|im_start|>user\n1234><|im_end|>\n<|im_start|>assistant\n
    assert t.spec.train.max_total_sequence_length >= 24 + t.spec.rollout.max_new_tokens
    assert "env.max_prompt_tokens=24: the longest prompt given" in capsys.readouterr().out


def test_generate_over_a_budget_set_by_hand_is_a_config_error(launch_here, tmp_path, chat_model):
    r = launch_here(tmp_path, "generate", str(chat_model), "--prompt", "1234>", "env.max_prompt_tokens=8")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("config error") and "  - env.max_prompt_tokens, --prompt: " in r.stderr, r.stderr
    assert "'1234>' is 24 tokens as the model gets it" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "outputs").exists()  # nothing started


def test_eval_on_another_val_set_is_named_after_it(tmp_path):
    """RUN_DIR/eval/step_000002.json is the run's own val set's; env.val_path=mine.jsonl → step_000002.mine.json."""
    from grpo_launcher.spec.compose import load_spec, spec_to_yaml

    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000002" / "meta.json").write_text("{}")  # complete() lists it
    (run_dir / "spec.yaml").write_text(spec_to_yaml(load_spec([f"output_root={tmp_path}", "name=r"])))
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "1234>", "answer": "4321"}\n')

    def out(*overrides: str) -> Path:
        return ev.default_out(ev.target(ev.parse([str(run_dir), *overrides], "eval")))

    assert out() == run_dir / "eval" / "step_000002.json"
    assert out("grpo.max_val_samples=128") == run_dir / "eval" / "step_000002.json"  # the same val set
    other = ("env.name=dataset", f"env.val_path={mine}", f"env.train_path={mine}")
    assert out(*other) == run_dir / "eval" / "step_000002.mine.json"


def test_a_path_given_to_eval_is_the_callers_own(tmp_path, monkeypatch):
    """The eval works from the run's launch directory (the spec's relative paths are its); `env.val_path=data/v.jsonl`
    given from another directory read the launch directory's file of that name (the project's 64-sample val set, not
    the caller's 8), silently. A path given here that exists from the caller's directory is taken from there."""
    from grpo_launcher.launch.repro import callers_path

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "v.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert callers_path("env.val_path=data/v.jsonl") == f"env.val_path={tmp_path / 'data' / 'v.jsonl'}"
    assert callers_path("+env.train_path=data/v.jsonl") == f"+env.train_path={tmp_path / 'data' / 'v.jsonl'}"
    assert callers_path("env.val_path=data/none.jsonl") == "env.val_path=data/none.jsonl"  # the launch dir's, if any
    assert callers_path("model.path=Qwen/Qwen2.5-0.5B") == "model.path=Qwen/Qwen2.5-0.5B"  # a hub id
    assert callers_path("rollout.temperature=0") == "rollout.temperature=0"
