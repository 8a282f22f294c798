"""The start-up line (train/startup.py): the driver's phases, each actor's own account of its start-up in brackets,
and what the driver imports before its workers start (nothing of transformers' auto classes)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

from grpo_launcher.train.startup import StartupClock, actor_startup, describe, process_start
from helpers import ROOT


def test_line_names_the_phases_and_an_actors_own_in_brackets():
    clock = StartupClock(t0=time.time() - 3.0)
    clock.mark("ray")
    clock.mark("policy ready", "from 1.0, imports 0.5")
    line = clock.report()
    assert line.startswith("grpo-launcher: start-up 3.0 s to the end of step 1 (ray 3.0, policy ready 0.0 ")
    assert line.endswith("[from 1.0, imports 0.5])")


def test_actor_report_turns_its_marks_into_phases():
    """`startup_marks` hold each phase's end: the first phase runs from the actor's process start."""
    start = process_start()
    actor = SimpleNamespace(startup_marks=[("imports", start + 2.0), ("load", start + 2.5), ("engine", start + 4.0)])
    report = actor_startup(actor)
    assert report["process"] == start and report["ready"] >= report["process"]
    assert [(n, round(s, 6)) for n, s in report["parts"]] == [("imports", 2.0), ("load", 0.5), ("engine", 1.5)]
    assert describe(report, start - 1.0) == "from 1.0, imports 2.0, load 0.5, engine 1.5"


def test_actor_without_marks_reports_its_engine_time_or_its_whole_init():
    """The vLLM engine keeps `startup_s` (its __init__): imports before it; any other actor: one `init` figure."""
    engine = actor_startup(SimpleNamespace(startup_s=0.0))
    assert [n for n, _ in engine["parts"]] == ["imports", "engine"]
    assert abs(engine["parts"][0][1] - (engine["ready"] - engine["process"])) < 1e-6
    (init,) = actor_startup(SimpleNamespace())["parts"]
    assert init[0] == "init" and init[1] > 0


AUTO = ("transformers.models.auto.auto_factory", "transformers.models.auto.modeling_auto",
        "transformers.models.auto.tokenization_auto", "transformers.generation", "sklearn")


def test_driver_starts_policy_workers_and_fetches_tokenizer_imports_without_auto_classes():
    """The driver imports the policy's class to start its workers, and (prefetched while it waits for them) what
    unpickling rank 0's tokenizer needs: transformers' base and tokenizers backend, never its auto classes (~4 s
    and ~300 MiB in the driver, before the workers could even start)."""
    code = ("import sys; import grpo_launcher.train.driver as d; from grpo_launcher.policy import policy_class; "
            "from grpo_launcher.spec.schema import TrainBackend; policy_class(TrainBackend.torch); "
            "d.prefetch_tokenizer_imports().join(); "
            "print('transformers.tokenization_utils_tokenizers' in sys.modules, "
            f"sorted(m for m in {AUTO!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True []", out.stdout + out.stderr
