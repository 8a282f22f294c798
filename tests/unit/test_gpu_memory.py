"""tracking/gpu_memory.py: the run's measured whole-GPU peak next to the memory pre-flight's prediction.

CI has no GPU, so `fake_nvidia_smi` (named so) stands in for nvidia-smi: it prints what the real one prints for
`--query-gpu=index,memory.used --format=csv,noheader,nounits` (one line per GPU), once, or in a loop with `-lms`.
On a GPU node the same class samples the real one (benchmarks/results/memory.md).
"""

from __future__ import annotations

import os
import stat
import time

import pytest

from grpo_launcher.tracking.gpu_memory import GpuPeak

FAKE = """#!/usr/bin/env bash
# fake_nvidia_smi: GPU 0 starts at 500 MiB (another tenant), GPU 1 at 0; under -lms the run's memory rises
if [[ "$*" != *-lms* ]]; then echo "0, 500"; echo "1, 0"; exit 0; fi
for used in 600 20980 {peak} 9000; do echo "0, $used"; echo "1, 1024"; done
echo "0, [N/A]"
exec sleep 600
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    def install(peak_mib: int) -> None:
        path = tmp_path / "nvidia-smi"
        path.write_text(FAKE.format(peak=peak_mib))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return install


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_peak_is_measured_above_each_gpus_baseline_and_an_unsafe_prediction_is_warned(fake_nvidia_smi, capsys):
    fake_nvidia_smi(peak_mib=102_900)  # GPU 0: 102,400 MiB above its 500 MiB baseline = 100 GiB
    peak = GpuPeak.start(gpus_per_node=2, predicted_gib=90.0)
    wait_for(lambda: peak.peak.get(0, 0) >= 102_400)
    s = peak.report()  # stops the sampler (by its PID) and warns
    assert s == {"gpu_peak_measured_gib": 100.0, "gpu_peak_predicted_gib": 90.0, "gpu_peak_prediction_error_pct": -10.0}
    assert peak._proc is not None and peak._proc.poll() is not None  # nothing left running
    assert "warning" not in capsys.readouterr().err  # exactly 10 %: within WARN_GAP


def test_a_prediction_more_than_ten_percent_under_is_a_warning(fake_nvidia_smi, capsys):
    fake_nvidia_smi(peak_mib=102_900)
    peak = GpuPeak.start(gpus_per_node=1, predicted_gib=80.0)
    wait_for(lambda: peak.peak.get(0, 0) >= 102_400)
    s = peak.report()
    assert s["gpu_peak_prediction_error_pct"] == -20.0
    err = capsys.readouterr().err
    assert "predicted 80.0 GiB" in err and "measured a peak of 100.0 GiB" in err and "UNDER" in err


def test_cpu_runs_and_nodes_without_nvidia_smi_sample_nothing(tmp_path, monkeypatch):
    assert GpuPeak.start(gpus_per_node=0, predicted_gib=None).report() == {}
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    assert GpuPeak.start(gpus_per_node=1, predicted_gib=10.0).report() == {}


def test_the_run_records_its_measured_peak_beside_the_prediction_in_summary_json_and_mlflow(fake_nvidia_smi,
                                                                                             tmp_path, capsys):
    """Issue 43: each GPU run records the measured peak next to the prediction (summary.json and the MLflow run's
    tags) and warns past 10 %: the loop's end (LoopState.finish) with a real sqlite store."""
    import json

    from grpo_launcher.plan import make_plan
    from grpo_launcher.spec.compose import load_spec
    from grpo_launcher.tracking.mlflow_tracker import Tracker
    from grpo_launcher.train.loop_state import LoopState

    spec = load_spec([f"output_root={tmp_path}", "name=peak"])
    plan = make_plan(spec)
    plan.run_dir.mkdir(parents=True)
    tracker = Tracker(spec, f"sqlite:///{tmp_path / 'mlflow.db'}", plan.run_dir)
    fake_nvidia_smi(peak_mib=82_420)  # 80 GiB above GPU 0's 500 MiB baseline
    peak = GpuPeak.start(gpus_per_node=2, predicted_gib=70.0)
    wait_for(lambda: peak.peak.get(0, 0) >= 81_920)
    LoopState(spec, plan, None, tracker, gpu_peak=peak).finish("FINISHED")
    want = {"gpu_peak_measured_gib": 80.0, "gpu_peak_predicted_gib": 70.0, "gpu_peak_prediction_error_pct": -12.5}
    assert json.loads((plan.run_dir / "summary.json").read_text())["gpu_memory"] == want
    tags = tracker.client.get_run(tracker.run_id).data.tags
    assert {k: float(tags[f"grpo.{k}"]) for k in want} == want
    assert "predicted 70.0 GiB per GPU, nvidia-smi measured a peak of 80.0 GiB: -12.5 % UNDER" in capsys.readouterr().err


def test_each_step_logs_its_own_peak_and_a_peak_that_keeps_rising_is_warned_once(fake_nvidia_smi, capsys):
    """memory/gpu_step_peak_gib is the peak since the last step; the nanov3 recipe's rose ~1 GiB a step on an H200
    (95.4 -> 103.9 GiB over ten steps), which nothing said."""
    from grpo_launcher.tracking.gpu_memory import growth_line

    fake_nvidia_smi(peak_mib=102_900)
    peak = GpuPeak.start(gpus_per_node=1, predicted_gib=100.0)
    wait_for(lambda: peak.window.get(0, 0) >= 102_400)
    peak.report()  # the sampler stopped and read out: nothing comes in between the lines below
    m: dict[str, float] = {}
    peak.step_done(1, m)
    assert m == {"memory/gpu_step_peak_gib": 100.0} and peak.window == {}
    for step, gib in enumerate([95.4, 96.9, 99.3, 100.6, 102.1], start=2):  # steps 2..6 of that run, by hand
        peak.window = {0: int(gib * 1024)}
        peak.step_done(step, {})
    err = capsys.readouterr().err
    assert err.count("GPU memory keeps growing") == 1 and "95.4 -> 102.1 GiB at step 6" in err
    peak.window = {0: 110 * 1024}
    peak.step_done(7, {})
    assert "keeps growing" not in capsys.readouterr().err  # once
    assert growth_line([90.0, 90.2, 90.4, 90.6, 90.8], 6) == ""  # under GROWTH_GIB in all
    assert growth_line([90.0, 92.0, 94.0, 94.0, 96.0], 6) == ""  # a plateau: the allocator found its size
    assert growth_line([90.0, 91.0, 92.0, 93.0], 5) == ""  # too few steps to say
