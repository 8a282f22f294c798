"""The run's measured whole-GPU peak next to the memory pre-flight's prediction (preflight/memory_estimate.py).

`nvidia-smi` samples the used memory of the driver node's GPUs every 200 ms for the whole run: every process on
the card (policy workers, vLLM engines, CUDA contexts, NCCL), as the prediction counts it. The run's summary.json
and its MLflow run record both figures; a gap over WARN_GAP is printed, since a prediction on the unsafe side is an
OOM one longer batch away. Only the driver's node is sampled (the prediction is per GPU of the most loaded rank).

Per step, memory/gpu_step_peak_gib is the peak since the last step. A peak that keeps rising from step to step is
printed once, because such a run eventually runs out of memory. The nanov3 recipe on an H200 rose by about 1 GiB a
step under vLLM's sleep mode (benchmarks/results/nemotron_gpu.md, 2026-12-06).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from typing import Optional

from . import metric_names as M

WARN_GAP = 0.10  # |predicted / measured - 1| above which the run says so
GROWTH_STEPS = 4  # step peaks that must each rise (after step 1, which holds start-up) ...
GROWTH_GIB = 1.0  # ... by this much in all, for the growth warning


QUERY = ["--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]


def _parse(line: str) -> tuple[int, int] | None:
    """'0, 1234' → (GPU 0, 1234 MiB); anything else (a blank, '[N/A]') → None."""
    parts = [p.strip() for p in line.split(",")]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() else None


class GpuPeak:
    def __init__(self, predicted_gib: Optional[float]) -> None:
        self.predicted_gib = predicted_gib
        self.baseline: dict[int, int] = {}  # MiB per GPU before the run touched it (other tenants, a stale context)
        self.peak: dict[int, int] = {}  # MiB per GPU above its baseline
        self.window: dict[int, int] = {}  # the same since the last step (step_done)
        self.step_peaks: list[float] = []  # GiB, from step 2 on
        self.growth_warned = False
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None

    @classmethod
    def start(cls, gpus_per_node: int, predicted_gib: Optional[float]) -> "GpuPeak":
        """The baseline is read now, before this process or a worker touches a GPU; then sampling runs in the
        background. A CPU run, or a node without nvidia-smi, samples nothing."""
        peak = cls(predicted_gib)
        smi = shutil.which("nvidia-smi")
        if gpus_per_node <= 0 or not smi:
            return peak
        try:
            out = subprocess.run([smi, *QUERY], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return peak
        peak.baseline = dict(p for p in map(_parse, out.splitlines()) if p)
        if not peak.baseline:
            return peak
        peak._proc = subprocess.Popen([smi, *QUERY, "-lms", "200"], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        peak._reader = threading.Thread(target=peak._read, name="gpu-peak", daemon=True)
        peak._reader.start()
        return peak

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            p = _parse(line)
            if p is not None and p[0] in self.baseline:
                used = p[1] - self.baseline[p[0]]
                self.peak[p[0]] = max(self.peak.get(p[0], 0), used)
                self.window[p[0]] = max(self.window.get(p[0], 0), used)

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        """memory/gpu_step_peak_gib into the step's metrics: the largest per-GPU peak since the last step (nothing
        when nothing was sampled). Warns once when the step peaks keep rising (growth_line)."""
        if not self.window:
            return
        window, self.window = self.window, {}
        gib = max(window.values()) / 1024
        metrics[M.MEMORY_GPU_STEP_PEAK_GIB] = round(gib, 3)
        if step > 1:  # step 1 holds the engines' start-up and the first compiles
            self.step_peaks.append(gib)
        line = growth_line(self.step_peaks, step)
        if line and not self.growth_warned:
            self.growth_warned = True
            print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def summary(self) -> dict[str, float]:
        """{} when nothing was sampled; else the largest per-GPU peak (GiB above that GPU's baseline), the
        prediction, and their gap in percent."""
        if not self.peak:
            return {}
        measured = max(self.peak.values()) / 1024
        out = {"gpu_peak_measured_gib": round(measured, 2)}
        if self.predicted_gib and measured > 0:
            out["gpu_peak_predicted_gib"] = round(self.predicted_gib, 2)
            out["gpu_peak_prediction_error_pct"] = round(100 * (self.predicted_gib / measured - 1), 1)
        return out

    def report(self) -> dict[str, float]:
        """Stops sampling; prints a warning when the prediction missed by more than WARN_GAP; the summary."""
        self.stop()
        s = self.summary()
        err = s.get("gpu_peak_prediction_error_pct")
        if err is not None and abs(err) > 100 * WARN_GAP:
            side = "UNDER (unsafe: a longer batch may run out of memory)" if err < 0 else "over"
            print(f"grpo-launcher: warning: the memory pre-flight predicted {s['gpu_peak_predicted_gib']:.1f} GiB per "
                  f"GPU, nvidia-smi measured a peak of {s['gpu_peak_measured_gib']:.1f} GiB: {err:+.1f} % {side}",
                  file=sys.stderr, flush=True)
        return s


def growth_line(peaks: list[float], step: int) -> str:
    """A warning when the last GROWTH_STEPS + 1 step peaks (GiB) rose step over step, by GROWTH_GIB or more in
    all; else ''."""
    last = peaks[-GROWTH_STEPS - 1:]
    if len(last) <= GROWTH_STEPS or any(b <= a for a, b in zip(last, last[1:])) or last[-1] - last[0] < GROWTH_GIB:
        return ""
    return (f"grpo-launcher: warning: GPU memory keeps growing: the step peak rose in each of the last {GROWTH_STEPS} "
            f"steps, {last[0]:.1f} -> {last[-1]:.1f} GiB at step {step} (memory/gpu_step_peak_gib; the policy's "
            f"own share: memory/policy_allocated_gib, a sleeping engine's: memory/engine_asleep_gib). A run that keeps "
            f"growing runs out of memory.")
