"""Nothing lost, nothing corrupted (issue 43): `export` never empties --out, verifies the checkpoint and copies only
its regular files; a copied run dir never writes into the original's MLflow run; `rerun` of an incomplete spec.yaml
is refused; checkpoint.enabled=false writes no checkpoint and the disk a run needs is said and checked; a derived run
name stays short; tests never read the checkout's outputs/. Real files, a real sqlite MLflow store, in-process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from grpo_launcher.checkpoint import CheckpointManager
from grpo_launcher.launch import rundir
from grpo_launcher.models.tiny import build_model, build_tokenizer
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.train.setup import resume_or_start

from helpers import ROOT, TESTS


def make_run(root: Path, name: str = "ex", steps: tuple[int, ...] = (1,), *extra: str) -> Path:
    """A run dir as a finished run leaves it: spec.yaml, and a verified checkpoint per step (an untrained tiny model
    saved with save_pretrained as policy/, its optimizer state as optim.pt)."""
    spec = load_spec([f"output_root={root}", f"name={name}", "logging.mlflow=false", *extra])
    plan = make_plan(spec)
    rundir.prepare(spec, plan)
    tok = build_tokenizer()
    model = build_model(spec.model, tok, seed=0)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp / "policy")
        tok.save_pretrained(tmp / "policy")
        torch.save({"opt": {}, "sched": {}}, tmp / "optim.pt")

    mgr = CheckpointManager(plan.checkpoint_dir, spec)
    for step in steps:
        mgr.save(step, write, {"mlflow_run_id": None}, {})
    return plan.run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs"))


def export_args(run: Path, out: Path, *more: str) -> tuple[str, ...]:
    return ("export", str(run), "--out", str(out), *more)


# ------------------------------------------------------------------ export


def test_export_refuses_a_non_empty_out_and_keeps_its_files(launch_here, run_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("three years of work")
    r = launch_here(tmp_path, *export_args(run_dir, out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("config error") and "  - --out" in r.stderr and "not empty" in r.stderr, r.stderr
    assert "fix: name a new or empty directory for --out" in r.stderr  # was: "pick a run dir and a step ..."
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert (out / "thesis.tex").read_text() == "three years of work"
    assert not list(tmp_path.glob(".tmp-*"))  # nothing written beside it either


def test_export_replaces_an_earlier_export_of_the_same_run_only(launch_here, run_dir, tmp_path):
    out = tmp_path / "model"
    assert launch_here(tmp_path, *export_args(run_dir, out)).returncode == 0
    first = json.loads((out / "grpo_export.json").read_text())
    assert first["run_dir"] == str(run_dir) and first["checkpoint"] == "step_000001"
    r = launch_here(tmp_path, *export_args(run_dir, out))  # the same run again: replaced
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    other = make_run(tmp_path / "other-root", "other")
    r = launch_here(tmp_path, *export_args(other, out))  # another run's export there: refused, kept
    assert r.returncode == 2 and "  - --out" in r.stderr, r.stderr
    assert json.loads((out / "grpo_export.json").read_text())["run_dir"] == str(run_dir)


def test_export_into_an_empty_out(launch_here, run_dir, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    r = launch_here(tmp_path, *export_args(run_dir, out))
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files and "optim.pt" not in files
    assert all(p.is_file() and not p.is_symlink() for p in out.iterdir())


def test_export_refuses_a_checkpoint_whose_weights_fail_the_manifest(launch_here, tmp_path):
    run = make_run(tmp_path / "root")
    weights = run / "checkpoints" / "step_000001" / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the last tensor: same size, other bytes
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    r = launch_here(tmp_path, *export_args(run, out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "policy/model.safetensors does not match its sha256" in r.stderr and "  - --step" in r.stderr, r.stderr
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("what", ["file", "dir"])
def test_export_refuses_a_symlink_planted_in_the_checkpoint(launch_here, tmp_path, what):
    run = make_run(tmp_path / "root")
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "id_rsa").write_text("PRIVATE KEY")
    link = run / "checkpoints" / "step_000001" / "policy" / "tokenizer_extra.json"
    link.symlink_to(secret / "id_rsa" if what == "file" else secret)
    out = tmp_path / "out"
    r = launch_here(tmp_path, *export_args(run, out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "policy/tokenizer_extra.json" in r.stderr, r.stderr
    assert not out.exists()
    copies = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and p.read_bytes() == b"PRIVATE KEY"]
    assert copies == [secret / "id_rsa"]  # never copied anywhere


def test_export_copies_no_symlink_even_when_the_manifest_lists_it(tmp_path):
    """A manifest written with the symlink in it (a planted link re-manifested): the copy still refuses it."""
    from grpo_launcher.checkpoint.manager import write_manifest
    from grpo_launcher.export import ExportError, export

    run = make_run(tmp_path / "root")
    ckpt = run / "checkpoints" / "step_000001"
    (tmp_path / "secret").write_text("PRIVATE KEY")
    (ckpt / "policy" / "notes.txt").symlink_to(tmp_path / "secret")
    write_manifest(ckpt)
    with pytest.raises(ExportError, match="notes.txt is a symlink"):
        export(run, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ a copied run dir and its MLflow run


def train_steps(spec, plan, steps: range, optimizer: bool = False) -> str:
    """What a launch and the driver do per step, without Ray: log, metrics.jsonl, checkpoint (`optimizer`: with an
    optimizer state file: a resume continues the optimizer), then finish."""
    rundir.prepare(spec, plan)
    state = resume_or_start(spec, plan)
    assert state is not None
    for step in steps:
        metrics = {"train/reward_mean": float(step), "time/step_s": 0.5}
        state.log(step, metrics)
        with open(plan.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        state.save_checkpoint(step, lambda d: ((d / "weights.bin").write_bytes(b"w"),
                                               optimizer and torch.save({"step": torch.tensor(step)}, d / "optim.pt")),
                              metrics)
    state.finish("FINISHED")
    return state.tracker.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite MLflow store for this file's runs (each new store costs seconds of schema migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def history(client: MlflowClient, run_id: str) -> list[int]:
    return [m.step for m in sorted(client.get_metric_history(run_id, "train/reward_mean"), key=lambda m: m.step)]


def test_a_copied_run_dir_starts_its_own_mlflow_run_and_leaves_the_original_untouched(tmp_path, capsys, store):
    uri = store  # one store for both, as a team server would be

    def spec_plan(root: Path, max_steps: int):
        spec = load_spec([f"output_root={root}", "name=orig", f"logging.tracking_uri={uri}",
                          f"grpo.max_steps={max_steps}"])
        return spec, make_plan(spec)

    original = train_steps(*spec_plan(tmp_path / "a", 2), range(1, 3))
    client = MlflowClient(tracking_uri=uri)
    before = client.get_run(original).info
    shutil.copytree(tmp_path / "a" / "orig", tmp_path / "b" / "orig")  # cp -r to another output_root, same name
    capsys.readouterr()

    copy = train_steps(*spec_plan(tmp_path / "b", 4), range(3, 5))
    out = capsys.readouterr().out
    assert copy != original
    assert f"the checkpoint's MLflow run {original} belongs to run 'orig' in {tmp_path / 'a' / 'orig'}" in out, out
    assert f"new MLflow run {copy}" in out
    after = client.get_run(original).info
    assert history(client, original) == [1, 2]  # the original's step axis: its own steps only
    assert (after.status, after.end_time) == ("FINISHED", before.end_time)
    assert history(client, copy) == [1, 2, 3, 4]  # the copy's run: its steps so far (metrics.jsonl), then its own
    assert client.get_run(copy).data.tags["grpo.run_dir"] == str(tmp_path / "b" / "orig")

    again = train_steps(*spec_plan(tmp_path / "a", 3), range(3, 4))  # the original resumed in place: its own run
    assert again == original and history(client, original) == [1, 2, 3]


@pytest.mark.parametrize("failure", ["killed", "start-up failure"])
def test_a_copy_that_fails_before_its_first_checkpoint_reopens_its_own_mlflow_run(tmp_path, store, failure):
    """A copy's checkpoints name the original's MLflow run until it saves one of its own: a copy killed (or failing
    at start-up) before then left its new run RUNNING (or FAILED) and each later launch started yet another."""
    def spec_plan(root: Path, max_steps: int):
        spec = load_spec([f"output_root={root}", "name=cp", f"logging.tracking_uri={store}",
                          f"grpo.max_steps={max_steps}"])
        return spec, make_plan(spec)

    original = train_steps(*spec_plan(tmp_path / "a", 2), range(1, 3))
    shutil.copytree(tmp_path / "a" / "cp", tmp_path / "b" / "cp")
    spec, plan = spec_plan(tmp_path / "b", 4)
    rundir.prepare(spec, plan)
    first = resume_or_start(spec, plan)  # the copy's first launch: its own new run, steps 1..2 backfilled
    assert first is not None and first.tracker.run_id != original
    if failure == "start-up failure":
        first.abort()  # what the driver does when its start-up fails: the run FAILED
    # a kill leaves it as it is: RUNNING, its tracker never closed
    again = train_steps(spec, plan, range(3, 5))
    client = MlflowClient(tracking_uri=store)
    assert again == first.tracker.run_id  # reopened, not another new run
    mine = client.search_runs([client.get_experiment_by_name(spec.logging.experiment).experiment_id],
                              f"tags.`grpo.run_dir` = '{tmp_path / 'b' / 'cp'}'")
    assert [r.info.run_id for r in mine] == [again] and mine[0].info.status == "FINISHED"
    assert history(client, again) == [1, 2, 3, 4] and history(client, original) == [1, 2]


def test_a_resume_that_leaves_logged_steps_behind_starts_a_new_mlflow_run(tmp_path, capsys, store):
    """The newest checkpoint unusable (here: gone), the resume from an older one without optimizer state trains
    steps 4.. anew: metrics.jsonl was rewritten with the new values, but MLflow kept the abandoned trajectory's
    (its logged (key, step) pairs were never sent again). Now such a resume logs to a new run, steps 1..3 copied."""
    spec = load_spec([f"output_root={tmp_path}", "name=fb", f"logging.tracking_uri={store}", "grpo.max_steps=4",
                      "checkpoint.keep_top_k=3"])
    first = train_steps(spec, make_plan(spec), range(1, 5))
    shutil.rmtree(tmp_path / "fb" / "checkpoints" / "step_000004")
    capsys.readouterr()
    spec = load_spec([f"output_root={tmp_path}", "name=fb", f"logging.tracking_uri={store}", "grpo.max_steps=5",
                      "checkpoint.keep_top_k=3"])
    second = train_steps(spec, make_plan(spec), range(4, 6))
    out = capsys.readouterr().out
    assert second != first and f"MLflow run {first} holds steps 4..4 of the trajectory this resume leaves" in out, out
    client = MlflowClient(tracking_uri=store)
    assert history(client, first) == [1, 2, 3, 4]  # left as it was
    assert history(client, second) == [1, 2, 3, 4, 5]  # each step once: 1..3 from metrics.jsonl, then the new ones
    assert client.get_run(first).data.tags["grpo.continued_in"] == second


# ------------------------------------------------------------------ rerun of an incomplete spec.yaml


@pytest.mark.parametrize("text, said", [("", "is empty"), ("name: half\nmodel:\n  hidden_size: 64\n", "lacks sections"),
                                        ("- a list\n", "is not a mapping")])
def test_rerun_of_an_incomplete_spec_yaml_is_refused_naming_the_missing_sections(launch_here, tmp_path, text, said):
    run = tmp_path / "runs" / "half"
    run.mkdir(parents=True)
    (run / "spec.yaml").write_text(text)
    r = launch_here(tmp_path, "rerun", str(run), "dry_run=true")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("config error") and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    named = r.stderr.splitlines()[1]
    assert "output_root" in named and "rollout" in named and "deadlines" in named, r.stderr
    assert ("model" in named.split(":")[0]) == ("model:" not in text), named
    assert "rerunning" not in r.stdout and not (tmp_path / "outputs").exists()  # nothing composed, nothing launched


def test_rerun_of_a_complete_spec_yaml_still_runs(launch_here, tmp_path):
    run = make_run(tmp_path / "runs", "whole")
    r = launch_here(tmp_path, "rerun", str(run), "dry_run=true")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "whole-rerun1" in r.stdout


# ------------------------------------------------------------------ the derived run name


FINISHED = TESTS / "data" / "finished_run" / "tiny-grpo"  # a run of the default name at its end
SEVEN = ["train.lr=3e-6", "grpo.num_prompts_per_step=32", "rollout.max_new_tokens=32", "loss.clip_high=0.28",
         "train.weight_decay=0.01", "grpo.val_period=5", "checkpoint.save_period=5"]


def test_a_long_override_set_gets_a_short_readable_name_not_a_refusal(launch_here, tmp_path):
    """The issue's everyday case: model.path=DIR plus seven overrides, after the default name's run finished: the
    derived name used to pass 200 characters and safe_names refused the launch (exit 2, about a leading '.')."""
    from grpo_launcher.preflight.paths import SAFE_NAME

    root = tmp_path / "out"
    shutil.copytree(FINISHED, root / "tiny-grpo")
    model = tmp_path / "models" / "an-organisation" / "a-rather-long-model-directory-name-1.2B-instruct-v2"
    tok = build_tokenizer()
    build_model(load_spec([f"output_root={root}", "name=m"]).model, tok, seed=0).save_pretrained(model)
    tok.save_pretrained(model)
    names = []
    for lr in ("3e-6", "1e-6"):
        r = launch_here(tmp_path, f"output_root={root}", f"model.path={model}", *SEVEN[1:], f"train.lr={lr}",
                        "dry_run=true")
        assert r.returncode == 0, r.stdout + r.stderr
        (line,) = [x for x in r.stdout.splitlines() if "already finished" in x]
        names.append(line.split("this run is named '")[1].split("'")[0])
    for name in names:
        assert name.startswith("tiny-grpo_model.path=a-rather-long-model") and len(name) <= 80, name
        assert SAFE_NAME.fullmatch(name) and name[-9] == "-" and int(name[-8:], 16) >= 0, name
    assert names[0] != names[1]  # two override sets, two run dirs


def test_a_short_derived_name_is_unchanged_and_a_long_one_never_collides():
    from grpo_launcher.launch.names import MAX_DERIVED, derived_name

    assert derived_name("tiny-grpo", ["rollout=vllm"]) == "tiny-grpo_rollout=vllm"
    assert derived_name("tiny-grpo", ["loss.clip_high=0.2", "train.lr=0.0001"]) == \
        "tiny-grpo_loss.clip_high=0.2,train.lr=0.0001"
    long = [f"env.reward_fns=[a{i}.py:f]" for i in range(12)]
    a, b = derived_name("tiny-grpo", long), derived_name("tiny-grpo", [*long[:-1], "env.reward_fns=[b.py:f]"])
    assert len(a) <= MAX_DERIVED and len(b) <= MAX_DERIVED and a != b and a[:60] == b[:60]
    assert derived_name("r", ["model.path=/x/m"]) != derived_name("r", ["model.path=/y/m"])  # same last part


# ------------------------------------------------------------------ tests beside a checkout's outputs/


def test_tests_never_see_the_checkouts_outputs(tmp_path, monkeypatch, runs_outside_the_checkout):
    """`make demo` then `make test`: the checkout's ./outputs holds a finished tiny-grpo, which refuses the default
    spec (run_name_not_finished). The suite's specs go to conftest.py's output_root; helpers.tiny_model() composes
    aside, with or without it."""
    from grpo_launcher.spec.errors import ConfigError
    from helpers import tiny_model

    shutil.copytree(FINISHED, tmp_path / "outputs" / "tiny-grpo")  # a checkout after `make demo`
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GRPO_OUTPUT_ROOT")
    with pytest.raises(ConfigError) as refused:  # the condition is real
        load_spec([])
    assert [v.rule for v in refused.value.violations] == ["run_name_not_finished"]
    assert (tiny_model() / "config.json").is_file()  # the shared helper, without the fixture's variable
    monkeypatch.setenv("GRPO_OUTPUT_ROOT", str(runs_outside_the_checkout))  # what every test gets (conftest.py)
    assert Path(load_spec([]).output_root) == runs_outside_the_checkout
    assert sorted(p.name for p in (tmp_path / "outputs" / "tiny-grpo").rglob("*")) == ["checkpoints", "meta.json",
                                                                                       "step_000150"]


# ------------------------------------------------------------------ disk: checkpoints said, checked, or none


def test_the_estimate_matches_what_the_torch_worker_saves(tmp_path):
    """A real TorchPolicyWorker's checkpoint (after an optimizer step, so that AdamW holds its m and v) against
    preflight/disk.py's bytes: weights and optimizer state each within 2 %."""
    from grpo_launcher.policy.torch_policy import TorchPolicyWorker
    from grpo_launcher.preflight.disk import checkpoint_bytes

    spec = load_spec([f"output_root={tmp_path}", "logging.mlflow=false"])
    tok = build_tokenizer()
    build_model(spec.model, tok, seed=0).save_pretrained(tmp_path / "model")
    worker = TorchPolicyWorker(spec, str(tmp_path / "model"), 0, 1)
    for p in worker.model.parameters():
        p.grad = torch.ones_like(p)
    worker.opt.step()
    worker.save(str(tmp_path / "ckpt"))
    est = checkpoint_bytes(spec)
    weights = (tmp_path / "ckpt" / "policy" / "model.safetensors").stat().st_size
    optim = (tmp_path / "ckpt" / "optim.pt").stat().st_size
    assert abs(weights - est.weights) / weights < 0.02, (weights, est.weights)
    assert abs(optim - est.optimizer) / optim < 0.02, (optim, est.optimizer)


def big_keys(root: Path) -> list[str]:
    """A run that keeps every checkpoint it saves: a million tiny-model checkpoints, more than any disk holds."""
    return [f"output_root={root}", "grpo.max_steps=10000000", "checkpoint.save_period=10",
            "checkpoint.keep_top_k=10000000"]


def test_a_launch_whose_output_root_lacks_the_room_is_refused_naming_the_keys(launch_here, tmp_path):
    r = launch_here(tmp_path, *big_keys(tmp_path / "out"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "  - checkpoint.keep_top_k, checkpoint.save_period, output_root: the run's checkpoints need" in r.stderr
    assert "[rule: checkpoint_disk_room]" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written
    dry = launch_here(tmp_path, *big_keys(tmp_path / "out"), "dry_run=true")  # said, as a real launch's refusal
    assert dry.returncode == 0 and "checkpoint_disk_room" in dry.stdout, dry.stdout + dry.stderr
    off = launch_here(tmp_path, *big_keys(tmp_path / "out"), "checkpoint.enabled=false", "dry_run=true")
    assert "checkpoints on disk  : none (checkpoint.enabled=false" in off.stdout and "checkpoint_disk_room" not in \
        off.stdout, off.stdout


def test_the_dry_run_prints_one_checkpoint_and_the_peak(launch_here, tmp_path):
    r = launch_here(tmp_path, f"output_root={tmp_path / 'out'}", "checkpoint.keep_top_k=1", "grpo.max_steps=30",
                    "checkpoint.save_period=10", "dry_run=true")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("checkpoints on disk  : ")]
    assert "MiB each (fp32 weights + AdamW m, v (fp32)" in line, line
    assert re.search(r"= 2 × [\d.]+ MiB \(the latest \+ one being written, with optimizer state\) \+ 1 × [\d.]+ MiB "
                     r"\(weights only: the older kept ones\); checkpoint.keep_top_k=1, 3 saved at "
                     r"checkpoint.save_period=10; [\d.]+ GiB free at ", line), line


def test_the_peak_counts_optimizer_state_in_two_checkpoints_only(tmp_path):
    """What the manager keeps (checkpoint/manager.py strip_older): the latest and the one being written hold the
    optimizer state, the older kept ones their weights alone; one save: one full checkpoint."""
    from grpo_launcher.preflight.disk import checkpoint_bytes, peak_bytes

    spec = load_spec([f"output_root={tmp_path}", "checkpoint.keep_top_k=3", "grpo.max_steps=50",
                      "checkpoint.save_period=10"])
    cb = checkpoint_bytes(spec)
    assert cb.weights_only == cb.weights + cb.small_files < cb.total
    assert peak_bytes(spec) == 2 * cb.total + 3 * cb.weights_only  # 5 saves: keep_top_k=3 + the latest + one
    one = load_spec([f"output_root={tmp_path}", "grpo.max_steps=5", "checkpoint.save_period=10"])
    assert peak_bytes(one) == checkpoint_bytes(one).total


def test_checkpoint_enabled_false_writes_no_checkpoint_not_even_the_last(tmp_path, capsys, store):
    spec = load_spec([f"output_root={tmp_path}", "name=off", "checkpoint.enabled=false", "grpo.max_steps=2",
                      f"logging.tracking_uri={store}"])
    plan = make_plan(spec)
    run_id = train_steps(spec, plan, range(1, 3))  # the driver saves the last step whatever the period
    assert not (plan.run_dir / "checkpoints").exists()
    assert "checkpoint.enabled=false: no checkpoint of step 1" in capsys.readouterr().out
    client = MlflowClient(tracking_uri=spec.logging.tracking_uri)
    assert history(client, run_id) == [1, 2]  # the metrics still reach MLflow, step by step


def test_a_stopped_slurm_job_without_checkpoints_does_not_say_one_was_saved(tmp_path):
    from grpo_launcher.launch.sbatch import render

    for enabled, flag in (("true", "CHECKPOINTS=1"), ("false", "CHECKPOINTS=0")):
        spec = load_spec(["cluster=local_slurm", f"output_root={tmp_path}", f"checkpoint.enabled={enabled}"])
        assert flag in render(spec, make_plan(spec)).splitlines()
    body = (ROOT / "src/grpo_launcher/launch/job.sh").read_text()
    assert '[ "$CHECKPOINTS" -eq 1 ] || SAVED="no checkpoint (checkpoint.enabled=false)' in body
    assert "checkpoint saved;" not in body.replace('SAVED="checkpoint saved"', "")


# ------------------------------------------------------------------ export's dtype


def test_export_writes_bf16_unless_asked(launch_here, run_dir, tmp_path):
    from safetensors import safe_open

    saved = run_dir / "checkpoints" / "step_000001" / "policy" / "model.safetensors"

    def dtypes(path: Path) -> set:
        with safe_open(str(path), framework="pt") as f:
            return {f.get_tensor(k).dtype for k in f.keys()}

    assert launch_here(tmp_path, *export_args(run_dir, tmp_path / "bf16")).returncode == 0
    assert dtypes(tmp_path / "bf16" / "model.safetensors") == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(saved), framework="pt") as a, safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as b:
        assert all(torch.equal(a.get_tensor(k).to(torch.bfloat16), b.get_tensor(k)) for k in a.keys())
    assert launch_here(tmp_path, *export_args(run_dir, tmp_path / "as-saved", "--dtype", "saved")).returncode == 0
    assert (tmp_path / "as-saved" / "model.safetensors").read_bytes() == saved.read_bytes()  # the fp32 master weights


def test_a_run_dir_resumed_against_another_store_starts_a_new_run(tmp_path, capsys, store):
    """The run dir moved to a machine whose MLflow store never saw its run: a new run, said so (it used to stop the
    resume with MLflow's RESOURCE_DOES_NOT_EXIST)."""
    def spec_plan(uri: str, max_steps: int):
        spec = load_spec([f"output_root={tmp_path / 'runs'}", "name=moved", f"grpo.max_steps={max_steps}",
                          f"logging.tracking_uri={uri}"])
        return spec, make_plan(spec)

    here = f"sqlite:///{tmp_path / 'here.db'}"
    first = train_steps(*spec_plan(here, 1), range(1, 2))
    capsys.readouterr()
    second = train_steps(*spec_plan(store, 2), range(2, 3))
    assert second != first and f"the checkpoint's MLflow run {first} is not in the store" in capsys.readouterr().out
    assert history(MlflowClient(tracking_uri=store), second) == [1, 2]


def test_export_refuses_a_checkpoint_dir_that_is_a_symlink(launch_here, tmp_path):
    run = make_run(tmp_path / "root")
    elsewhere = make_run(tmp_path / "other", "other", (5,))  # a valid checkpoint, outside this run
    (run / "checkpoints" / "step_000005").symlink_to(elsewhere / "checkpoints" / "step_000005")
    r = launch_here(tmp_path, "export", str(run), "--step", "5", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "step_000005 is a symlink" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


def test_a_run_finished_without_its_last_checkpoints_is_not_trained_again(tmp_path):
    """checkpoint.enabled=false: a finished run wrote no checkpoint (or stopped writing them), so launching it again
    trained its steps again without a word (records moved aside, a new MLflow run). Its summary.json says it
    finished: refused, as a run finished with checkpoints is; a longer run from its last checkpoint still goes."""
    from grpo_launcher.finished import finished_problem
    from grpo_launcher.spec.compose import load_spec

    run = tmp_path / "nock"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "FINISHED", "step": 3}))
    spec = lambda *o: load_spec([f"output_root={tmp_path}", "name=nock", "dry_run=true", *o])  # noqa: E731
    problem = finished_problem(spec("grpo.max_steps=3", "checkpoint.enabled=false"))
    assert problem and "already finished (step 3)" in problem[0] and "train steps 1..3 again" in problem[0]
    assert finished_problem(spec("grpo.max_steps=3", "checkpoint.resume=fresh")) is None
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    assert "train steps 3..3 again" in finished_problem(spec("grpo.max_steps=3"))[0]
    assert finished_problem(spec("grpo.max_steps=5")) is None  # extended from step 2
    (run / "summary.json").write_text(json.dumps({"status": "KILLED", "step": 3}))
    assert finished_problem(spec("grpo.max_steps=3")) is None  # stopped: it resumes from step 2


def test_a_resume_without_the_runs_mlflow_store_variable_is_refused(tmp_path, launch_here, monkeypatch):
    """A run started with MLFLOW_TRACKING_URI=alt.db, resumed without it: its MLflow run moved to the output
    root's store without a word (a new run there, steps 1..N left in alt.db). Refused, naming the store; the same
    variable again resumes; logging.tracking_uri moves it on purpose."""
    alt = f"sqlite:///{tmp_path / 'alt.db'}"
    step = tmp_path / "mlf" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    # a meta.json that matches no spec: every launch here is refused (run_name_checkpoints_compatible), none trains
    (step / "meta.json").write_text(json.dumps({"step": 2, "spec": {"logging": {"tracking_uri": alt}}}))
    args = [f"output_root={tmp_path}", "name=mlf", "grpo.max_steps=4"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = launch_here(tmp_path, *args)
    assert run.returncode == 2 and "run_name_keeps_its_tracking_store" in run.stderr, run.stderr
    assert f"set MLFLOW_TRACKING_URI={alt} (as at its start)" in run.stderr
    rules = lambda r: re.findall(r"\[rule: (\w+)\]", r.stderr)  # noqa: E731
    monkeypatch.setenv("MLFLOW_TRACKING_URI", alt)
    assert "run_name_keeps_its_tracking_store" not in rules(launch_here(tmp_path, *args))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    moved = launch_here(tmp_path, *args, f"logging.tracking_uri=sqlite:///{tmp_path / 'new.db'}")
    assert "run_name_keeps_its_tracking_store" not in rules(moved)


def test_a_resume_past_steps_a_start_without_checkpoints_logged_starts_a_new_mlflow_run(tmp_path, capsys, store):
    """Steps 1-2 checkpointed; a start with checkpoint.enabled=false logs steps 3-4 (committed at once, no
    checkpoint); the next start resumes from step 2 and trains 3.. anew. At b11b41e MLflow kept the second start's
    values for steps 3-4 (each (key, step) pair it held was never sent again) while metrics.jsonl had the new ones."""
    def spec(*more: str):
        s = load_spec([f"output_root={tmp_path}", "name=nock", f"logging.tracking_uri={store}", *more])
        return s, make_plan(s)

    first = train_steps(*spec("grpo.max_steps=2"), range(1, 3), optimizer=True)  # its resume: the same optimizer
    s, plan = spec("grpo.max_steps=4", "checkpoint.enabled=false")
    state = resume_or_start(s, plan)
    assert state is not None and state.tracker.run_id == first
    for step in (3, 4):
        state.log(step, {"train/reward_mean": -1.0, "time/step_s": 0.5})  # committed: no checkpoint to wait for
    state.finish("FINISHED")
    capsys.readouterr()
    second = train_steps(*spec("grpo.max_steps=5", "train.lr=0.05"), range(3, 6))
    out = capsys.readouterr().out
    assert second != first and f"MLflow run {first} holds steps 3..4 of the trajectory this resume leaves" in out, out
    client = MlflowClient(tracking_uri=store)
    assert history(client, second) == [1, 2, 3, 4, 5]
    assert [m.value for m in sorted(client.get_metric_history(second, "train/reward_mean"), key=lambda m: m.step)
            ][2:] == [3.0, 4.0, 5.0]  # this start's values, not the abandoned -1.0
