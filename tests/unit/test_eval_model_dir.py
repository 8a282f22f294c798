"""`launch.py eval MODEL_DIR` writes where no run lives: OUTPUT_ROOT/.eval/<dir name>-<hash>/ (was OUTPUT_ROOT/eval/,
the run dir of a run named `eval`: its phase.json and prompting.json were overwritten, the metrics put among its
files; and two model dirs of one name shared a metrics file)."""

from __future__ import annotations

import json
import shutil

import pytest

from grpo_launcher.launch import eval as ev
from helpers import launch, share_models, tiny_model


@pytest.mark.extended  # 16 s: a second eval end to end (make test's eval runs in test_eval_generate.py)
def test_eval_of_a_model_dir_leaves_a_run_named_eval_alone(tmp_path):
    (tmp_path / "out").mkdir()
    out = share_models(tmp_path / "out")
    run = out / "eval"  # a run named `eval`: what a model dir's eval wrote into
    (run / "logs").mkdir(parents=True)
    for name in ("phase.json", "prompting.json", "status.json"):
        (run / name).write_text('{"mine": true}\n')
    model = tiny_model()
    p = launch("eval", str(model), "grpo.max_val_samples=8", "grpo.val_batch_size=8", f"output_root={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in run.iterdir()) == ["logs", "phase.json", "prompting.json", "status.json"]
    assert all(json.loads((run / n).read_text()) == {"mine": True} for n in ("phase.json", "prompting.json"))
    written = p.stdout.strip().splitlines()[-1].removeprefix("grpo-launcher: eval metrics written to ")
    assert written.startswith(f"{out}/.eval/{model.name}-") and written.endswith(f"/{model.name}.json"), written
    assert json.loads(open(written).read())["model_path"] == str(model)
    assert f"metrics to {written}" in p.stdout  # said before the eval runs too


def test_model_dirs_of_one_name_get_their_own_metrics_file(tmp_path):
    """/a/export and /b/export: one OUTPUT_ROOT/eval/export.json, the second eval overwrote the first's."""
    for d in ("a", "b"):
        shutil.copytree(tiny_model(), tmp_path / d / "export")

    def out(d: str):
        return ev.default_out(ev.target(ev.parse([str(tmp_path / d / "export"), f"output_root={tmp_path}"], "eval")))

    assert out("a") != out("b") and out("a").name == out("b").name == "export.json"
    assert {p.parent.parent for p in (out("a"), out("b"))} == {tmp_path / ".eval"}
