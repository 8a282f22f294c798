"""The config fuzzer's two slow cases (benchmarks/results/config_fuzz.md, seed 3): `env=math
train.max_total_sequence_length='1-00:00:00' env.reward_errors=-<300 digits> model.path=' '` took 12-14 s in
pre-flight, all of it in envs/preflight.py's tokenizer load: `model.path=' '` is no directory, yet
AutoTokenizer.from_pretrained(' ') was called, and importing transformers' auto-tokenizer module alone takes 5-12 s
before it fails. A model.path that is no directory is not read (the model rules name it); the case is a config error
naming both keys, and that module is never imported."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers import ROOT

CASE = ["env=math", "train.max_total_sequence_length='1-00:00:00'", "env.reward_errors=-" + "9" * 300,
        "model.path=' '"]
PROBE = """
import contextlib, io, sys
from grpo_launcher.launch.app import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
print(int(rc), "transformers.models.auto.tokenization_auto" in sys.modules)
print(err.getvalue())
"""


def run_case(tmp_path, *overrides: str) -> tuple[int, bool, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PROBE, *overrides, "dry_run=true", f"output_root={tmp_path}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    head, _, err = proc.stdout.partition("\n")
    rc, imported = head.split()
    return int(rc), imported == "True", err, time.monotonic() - t0


def test_the_fuzzers_slow_case_is_a_quick_config_error_naming_the_keys(tmp_path):
    rc, imported, err, took = run_case(tmp_path, *CASE)
    assert rc == 2, err
    assert "  - train.max_total_sequence_length: " in err and "  - env.reward_errors: " in err, err
    assert not imported, "a model.path that is no directory loaded transformers' AutoTokenizer"
    assert took < 60, f"{took:.0f} s"


def test_a_model_path_that_is_no_directory_loads_no_tokenizer(tmp_path):
    (tmp_path / "file").write_text("not a model")
    for path in ("' '", str(tmp_path / "missing"), str(tmp_path / "file")):
        rc, imported, err, _ = run_case(tmp_path, "env=math", f"model.path={path}")
        assert rc == 0, err  # a dry run: the real launch's model rules name it (dry run's note)
        assert not imported, path
