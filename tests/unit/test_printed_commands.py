"""The commands the launcher prints for the user to paste (resume, rerun, reproduce, export, `mlflow ui`) work when
pasted into a shell as printed: each is run through bash, and what bash hands the command is read back by the
launcher's own pre-flight (Hydra's override grammar, OmegaConf) or argparse/click, giving back exactly the values
the run had, spaces, non-ASCII, quotes, `$`, backslashes, `=`, commas and brackets included."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

HOSTILE = ["out sp/ünï cødé", "q'uo\"te $HOME $ x", "back\\slash\\", "k=v,w [a] {b} (c) :d", "300", "true", "#x~"]


@pytest.fixture
def no_mlflow_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def pasted(command: str, program: str) -> list[str]:
    """The words bash hands `program` when `command` (which starts with it) is pasted into it."""
    assert command.startswith(program + " "), command
    argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + command[len(program) + 1:]],
                          capture_output=True, text=True, check=True).stdout
    return argv.split("\0")[:-1]


def stopped_run(tmp_path: Path, monkeypatch, root: str, name: str = "tiny-grpo"):
    """A spec and plan under output_root `root` (made under tmp_path) whose run dir holds a checkpoint of step 2."""
    from grpo_launcher.launch.preflight import preflight
    from grpo_launcher.plan import make_plan

    monkeypatch.chdir(tmp_path)
    spec = preflight(["output_root=plain", "grpo.max_steps=5", "dry_run=true"]).spec
    spec = dataclasses.replace(spec, output_root=str(tmp_path / root), name=name)
    plan = make_plan(spec)
    (plan.checkpoint_dir / "step_000002").mkdir(parents=True)
    (plan.checkpoint_dir / "step_000002" / "meta.json").write_text('{"step": 2}\n')
    return spec, plan


@pytest.mark.parametrize("root", HOSTILE)
def test_the_printed_resume_command_pasted_into_bash_resumes_the_same_run(tmp_path, no_mlflow_env, root):
    from grpo_launcher.launch.preflight import preflight
    from grpo_launcher.tracking.report import resume_command

    spec, plan = stopped_run(tmp_path, no_mlflow_env, root, name="lr=1e-3,b+c@d")
    argv = pasted(resume_command(spec, plan, ["launch.py", "grpo.max_steps=5", "output_root=elsewhere"]), "python")
    assert argv[:2] == ["launch.py", "grpo.max_steps=5"], argv
    again = preflight([*argv[1:], "dry_run=true"])
    assert (again.spec.output_root, again.spec.name, again.spec.grpo.max_steps) == (spec.output_root, spec.name, 5)
    assert again.plan.run_dir == plan.run_dir


def test_the_rerun_fallback_pasted_into_bash_reads_the_run_dir_and_name(tmp_path, no_mlflow_env):
    """A command holding a credential resumes through the run's own spec.yaml: `launch.py rerun RUN_DIR name=NAME`."""
    from grpo_launcher.launch.preflight import preflight
    from grpo_launcher.spec.compose import spec_to_yaml
    from grpo_launcher.tracking.report import resume_command

    spec, plan = stopped_run(tmp_path, no_mlflow_env, HOSTILE[0], name="a=b,c")
    (plan.run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    argv = pasted(resume_command(spec, plan, ["launch.py", "rollout.http_api_key=SECRET123456"]), "python")
    assert argv[:3] == ["launch.py", "rerun", str(plan.run_dir)], argv
    again = preflight([*argv[3:], "dry_run=true"], saved=plan.run_dir / "spec.yaml")
    assert (again.spec.name, again.spec.output_root) == ("a=b,c", spec.output_root)


@pytest.mark.parametrize("root", HOSTILE[:3])
def test_the_end_of_run_rows_pasted_into_bash_name_the_run_dir(tmp_path, no_mlflow_env, capsys, root):
    """The export and reproduce rows of a finished run, and TensorBoard's, give back the run dir through bash."""
    from grpo_launcher.export import parse_args
    from grpo_launcher.tracking.report import finish_run

    spec, plan = stopped_run(tmp_path, no_mlflow_env, root)
    spec = dataclasses.replace(spec, logging=dataclasses.replace(spec.logging, tensorboard=True))
    (plan.run_dir / "repro").mkdir()
    finish_run(spec, plan, SimpleNamespace(step=5, tracker=None), 0)
    rows = dict(line.split(" : ", 1) for line in capsys.readouterr().out.splitlines()[1:])
    rows = {k.strip(): v for k, v in rows.items()}
    assert pasted(rows["reproduce"], "python") == ["launch.py", "rerun", str(plan.run_dir)]
    export = pasted(rows["export (HF dir)"], "python")
    assert export[:2] == ["launch.py", "export"] and parse_args(export[2:]).run_dir == plan.run_dir
    assert pasted(rows["TensorBoard"], "tensorboard") == ["--logdir", str(plan.run_dir / "tensorboard")]


def test_the_mlflow_ui_hint_pasted_into_bash_opens_the_runs_store(tmp_path):
    import click
    from mlflow.cli import cli

    from grpo_launcher.tracking.report import chart_link

    uri = f"sqlite:///{tmp_path}/out sp/ünï $x 'q'/mlflow.db"
    argv = pasted(chart_link(uri, "7").split(", then ")[0], "mlflow")  # MLflow's own command line reads it
    name, command, args = cli.resolve_command(click.Context(cli), argv)
    assert name == "ui" and command.make_context(name, args).params["backend_store_uri"] == uri


@pytest.mark.parametrize("value", [*HOSTILE, "", " lead", "d$e ${x} \\${y} \\\\${z}", 'q\\"', "a\\\\", "1_0", "nan"])
def test_an_override_reads_back_through_bash_and_hydra_as_the_value(value):
    """Composition alone (the pre-flight refuses '${' in a path, so the resolved config is read back here)."""
    from grpo_launcher.pasteable import override
    from grpo_launcher.spec.compose import compose

    (word,) = pasted("echo " + override("output_root", value), "echo")
    assert compose([word]).output_root == value


def test_a_plain_value_is_printed_as_typed():
    from grpo_launcher.pasteable import arg, override

    assert [override("name", "foo"), override("output_root", "/tmp/r-1/x.y")] == ["name=foo", "output_root=/tmp/r-1/x.y"]
    assert override("output_root", "/tmp/ü") == "'output_root=\"/tmp/ü\"'" and arg("/tmp/a b") == "'/tmp/a b'"
