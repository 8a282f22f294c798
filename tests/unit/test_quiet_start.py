"""A quiet start (h15b): the env worker imports no torch, our own code raises no warning, the per-step line shows
what a user reads, and MLflow's experiment chart view opens with the reward and validation charts first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

from grpo_launcher.spec.schema import LoggingSpec, RunSpec
from grpo_launcher.tracking.mlflow_tracker import CHART_VIEW_ID, CHART_VIEW_TAG, HEADLINE_METRICS, Tracker
from helpers import ROOT


def test_env_worker_module_imports_no_torch():
    """The env worker (a Ray actor of train/workers.EnvWorker) loads only its module and the env: no torch
    (~150 MiB PSS and a second or more of CPU at start-up on every run)."""
    code = ("import sys, grpo_launcher.train.workers, grpo_launcher.envs.toy, grpo_launcher.envs.math; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_tiny_warm_start_raises_no_warning():
    """models/tiny.py reads the loss as a number without the 'requires_grad ... to a scalar' UserWarning."""
    from grpo_launcher.envs.toy import ReverseDigitsEnv
    from grpo_launcher.models.tiny import build_model, build_tokenizer, warm_start

    spec = RunSpec()
    tok = build_tokenizer()
    model = build_model(spec.model, tok, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = warm_start(model, tok, ReverseDigitsEnv(spec.env).warmup_examples(64), seed=0, steps=20)
    assert loss > 0


def test_step_line_shows_what_a_user_reads(capsys):
    from grpo_launcher.train.loop_state import Progress

    import time

    progress = Progress(5, 0)
    progress.t0 = time.monotonic() - 10.2  # 10 s into the run, 1 of 5 steps done: 40 s to go
    progress.update(1, {"train/reward_mean": 0.5, "train/loss": 1e-9, "train/kl": 0.01,
                        "train/clip_fraction": 0.1, "train/tokens_per_s": 2000.0, "time/step_s": 0.3,
                        "val/reward_mean": 0.25})
    line = capsys.readouterr().out.strip()
    assert line == ("step 1/5 reward=0.5 val=0.25 kl=0.01 clip=0.1 tok/s=2e+03 s=0.3 elapsed 0:00:10 eta 0:00:41"), line
    resumed = Progress(5, 3)  # a resumed run: the mean is over this process's steps
    resumed.t0 = time.monotonic() - 4.2
    resumed.update(4, {})
    assert capsys.readouterr().out.strip() == "step 4/5 elapsed 0:00:04 eta 0:00:04"



def test_step_line_says_why_a_step_took_no_update(capsys):
    """train/optimizer_steps 0: the line ends with the reason (equal rewards after the dynamic-sampling rounds, or
    every sample masked); a step that took an update says nothing more."""
    from grpo_launcher.train.loop_state import Progress

    progress = Progress(5, 0, groups=8)
    no_step = {"train/optimizer_steps": 0.0, "train/dynamic_sampling_rounds": 3.0, "train/reward_mean": 0.0}
    progress.update(1, {**no_step, "train/equal_reward_groups": 8.0})
    assert capsys.readouterr().out.strip().endswith("(all 8 groups had equal rewards after 3 rounds: no update)")
    progress.update(2, {**no_step, "train/equal_reward_groups": 0.0})
    assert capsys.readouterr().out.strip().endswith("(no sample carries loss (all masked): no update)")
    progress.update(3, {**no_step, "train/optimizer_steps": 1.0, "train/equal_reward_groups": 8.0})
    assert "no update" not in capsys.readouterr().out

def test_experiment_chart_view_puts_reward_and_validation_first(tmp_path):
    """The experiment carries MLflow's saved-view tag: its state's first section holds the reward and validation
    charts (the UI adds every other metric after them); a view the user changed (same id) is kept."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(RunSpec(name="r", logging=LoggingSpec(experiment="h15b-charts")), uri, tmp_path / "r")
    tags = t.client.get_experiment(t.experiment_id).tags
    view = json.loads(tags[CHART_VIEW_TAG])
    assert isinstance(view["name"], str) and isinstance(view["createdAt"], int) and isinstance(view["state"], str)
    state = json.loads(view["state"])
    (section,) = state["compareRunSections"]
    assert state["isAccordionReordered"] and section["isReordered"]
    charts = [c["metricKey"] for c in state["compareRunCharts"] if c["metricSectionId"] == section["uuid"]]
    assert charts[:2] == ["train/reward_mean", "val/reward_mean"] and tuple(charts) == HEADLINE_METRICS
    t.close()
    t.client.set_experiment_tag(t.experiment_id, CHART_VIEW_TAG, "edited")
    t2 = Tracker(RunSpec(name="r2", logging=LoggingSpec(experiment="h15b-charts")), uri, tmp_path / "r2")
    assert t2.client.get_experiment(t.experiment_id).tags[CHART_VIEW_TAG] == "edited"
    t2.close()
    from grpo_launcher.tracking.report import chart_link

    assert chart_link(uri, t.experiment_id).endswith(
        f"#/experiments/{t.experiment_id}/runs?viewStateShareKey={CHART_VIEW_ID}&compareRunsMode=CHART")


def test_driver_tokenizer_from_the_worker_needs_no_auto_classes(tmp_path):
    """The driver's tokenizer comes pickled from policy rank 0 (policy/hybrid.py load_tokenizer): unpickled in a
    fresh process it encodes as AutoTokenizer does, without importing transformers' auto classes (~300 MiB and
    seconds of CPU in the driver)."""
    from transformers import AutoTokenizer

    from grpo_launcher.models.tiny import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tok.pkl").write_bytes(__import__("pickle").dumps(tok))
    code = ("import pickle, sys; t = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(t('reverse: 123 ->')['input_ids'], t.pad_token_id, t.eos_token_id, "
            "'transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tok.pkl")], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    want = f"{tok('reverse: 123 ->')['input_ids']} {tok.pad_token_id} {tok.eos_token_id} False"
    assert out.stdout.strip() == want


def test_triton_autotune_choices_are_kept_on_disk_unless_the_user_says_otherwise():
    """mamba-ssm's Mamba-2 kernels autotune ~200 configs on first call (~300 s of nemotron_h's first update on an
    H100): the driver and its workers ask Triton to keep the winners on disk; a user's TRITON_CACHE_AUTOTUNING wins."""
    code = ("import os; from grpo_launcher.train.startup import quiet_libraries; quiet_libraries(); "
            "from triton import knobs; print(os.environ['TRITON_CACHE_AUTOTUNING'], knobs.autotuning.cache)")
    for given, expected in ((None, "1 True"), ("0", "0 False")):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_AUTOTUNING"}
        env.update({"TRITON_CACHE_AUTOTUNING": given} if given else {})
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=300)
        assert out.stdout.strip() == expected, out.stdout + out.stderr
