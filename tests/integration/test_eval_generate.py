"""`launch.py eval` and `launch.py generate` (issue 31): a checkpoint scored and sampled through the run's own
workers, no training. The refusals run launch.py's main in this process; one slow test trains 2 steps for real,
then evaluates and samples its checkpoints through launch.py.

Issue 42, item 7: `generate MODEL_DIR --prompt '1234>'` with a model whose chat template makes the prompt longer
than the default budget (env.max_prompt_tokens=8) samples (the budget follows the prompts given) instead of a
PromptTooLong traceback; an eval on another val set is written beside the run's own, named after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import launch, share_models
from unit.test_eval_generate import chat_model  # noqa: F401  (fixtures)

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "train.logprob_batch_size=16", "grpo.val_batch_size=8",
         "rollout.max_new_tokens=6", "grpo.max_val_samples=8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-step run validating every step: (its run dir, its metrics.jsonl by step)."""
    root = share_models(tmp_path_factory.mktemp("evalroot"))
    r = launch(*SMALL, f"output_root={root}", "name=ev", "grpo.max_steps=2", "grpo.val_period=1",
               "checkpoint.save_period=1", "logging.mlflow=false", cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = root / "ev"
    return run_dir, {rec["step"]: rec for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_eval_and_generate_score_and_sample_a_trained_checkpoint(trained):
    """`eval` a 2-step run by name: the same val/reward_mean as the run's own step-2 validation (same weights, same
    engines, same seeds), no training; `generate` from its newest checkpoint."""
    run_dir, logged = trained
    r = launch("eval", "ev", "--root", str(run_dir.parent), cwd=run_dir.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((run_dir / "eval" / "step_000002.json").read_text())
    assert out["step"] == 2 and out["metrics"]["val/samples"] == 8
    assert out["metrics"]["val/reward_mean"] == pytest.approx(logged[2]["val/reward_mean"])
    assert f"val/reward_mean                 {logged[2]['val/reward_mean']:.4g}" in r.stdout
    assert not (run_dir / "checkpoints" / "step_000003").exists()  # no training

    r = launch("generate", str(run_dir), "--prompt", "1234>", "--prompt", "5678>", "-n", "2", cwd=run_dir.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    heads = [line for line in r.stdout.splitlines() if line.startswith("--- prompt")]
    assert heads == ["--- prompt 1 sample 1: '1234>'", "--- prompt 1 sample 2: '1234>'",
                     "--- prompt 2 sample 1: '5678>'", "--- prompt 2 sample 2: '5678>'"], r.stdout
    assert "checkpoint" in r.stdout and "step_000002" in r.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_eval_of_an_older_checkpoint_on_a_data_file_of_ones_own(trained, tmp_path):
    run_dir, _ = trained
    data = tmp_path / "mine.jsonl"  # the toy task's rows, answers all wrong but one
    data.write_text("".join(json.dumps({"prompt": f"{s}>", "answer": s[::-1] if i == 0 else "x"}) + "\n"
                            for i, s in enumerate(["1234", "5678", "9012", "3456"])))
    r = launch("eval", str(run_dir), "--step", "1", "env.name=dataset", f"env.val_path={data}",
               f"env.train_path={data}", "grpo.max_val_samples=null", "--out", str(tmp_path / "e.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "e.json").read_text())
    assert out["step"] == 1 and out["metrics"]["val/samples"] == 4 and out["metrics"]["val/reward_mean"] <= 0.25
    assert str(data) in out["data"]


@pytest.mark.slow
@pytest.mark.extended
def test_generate_from_a_model_dir_with_a_chat_template_as_the_readme_shows(chat_model, tmp_path):
    r = launch("generate", str(chat_model), "--prompt", "1234>", "-n", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    heads = [line for line in r.stdout.splitlines() if line.startswith("--- prompt")]
    assert heads == ["--- prompt 1 sample 1: '1234>'", "--- prompt 1 sample 2: '1234>'"], r.stdout
    assert "PromptTooLong" not in r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.extended
def test_eval_on_another_val_set_keeps_the_runs_own_result(trained, tmp_path):
    run_dir, _ = trained
    own = run_dir / "eval" / "step_000002.json"
    r = launch("eval", str(run_dir), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    before = own.read_text()
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}>", "answer": s[::-1]}) + "\n" for s in ["1234", "5678"]))
    r = launch("eval", str(run_dir), "env.name=dataset", f"env.val_path={data}", f"env.train_path={data}",
               "grpo.max_val_samples=null", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    mine = json.loads((run_dir / "eval" / "step_000002.mine.json").read_text())
    assert mine["metrics"]["val/samples"] == 2 and str(data) in mine["data"]
    assert own.read_text() == before


def _copy_of_the_runs_model(run_dir: Path, to: Path) -> Path:
    import shutil

    model = Path(json.loads((run_dir / "model.json").read_text())["model_dir"])
    shutil.copytree(model, to)
    return to


def test_eval_with_a_model_whose_tokenizer_is_not_the_runs_is_refused(trained, tmp_path):
    """`eval RUN model.path=OTHER` where OTHER's tokenizer differs from the one the run trained with: at b11b41e it
    scored the run's weights through OTHER's vocabulary, exit 0, val/reward_mean 0 against 0.23, no warning. Now a
    config error naming model.path and the files (pre-flight: no engine starts). The same model's copy with the
    run's tokenizer files is taken: test_eval_with_a_copy_of_the_runs_model_is_taken (make test-all)."""
    run_dir, _ = trained
    other = _copy_of_the_runs_model(run_dir, tmp_path / "other")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    r = launch("eval", str(run_dir), f"model.path={other}", cwd=tmp_path)
    assert r.returncode == 2 and "  - model.path: tokenizer_config.json in" in r.stderr, r.stdout[-2000:] + r.stderr
    assert "[rule: eval_same_tokenizer]" in r.stderr and not (run_dir / "eval" / "step_000002.other.json").exists()


@pytest.mark.slow
@pytest.mark.extended  # a second real eval; make test: the refusal above, test_eval_and_generate_score_and_sample_...
def test_eval_with_a_copy_of_the_runs_model_is_taken(trained, tmp_path):
    """The other side of the refusal above: a copy of the run's own model dir (the same tokenizer files) evaluates."""
    run_dir, _ = trained
    same = _copy_of_the_runs_model(run_dir, tmp_path / "same")
    r = launch("eval", str(run_dir), f"model.path={same}", "--out", str(tmp_path / "same.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
