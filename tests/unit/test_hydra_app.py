"""launch.py as a Hydra app, run as a user runs it (subprocesses): Hydra's flags, the user's own config dirs outside
the repo, hydra.run.dir refused with its reason, the subcommands, and model.path=DIR alone."""

from __future__ import annotations

import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest

from helpers import launch


def no_traceback(p: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in p.stdout + p.stderr


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A user's own configs, outside the package: a recipe, a model option, an env option, a primary config."""
    d = tmp_path_factory.mktemp("my-configs")
    (d / "recipe").mkdir()
    (d / "model").mkdir()
    (d / "env").mkdir()
    (d / "recipe" / "quick.yaml").write_text("# @package _global_\ndefaults:\n  - override /env: my_toy\n"
                                             "name: quick-run\ngrpo:\n  max_steps: 3\n")
    (d / "model").joinpath("my_tiny.yaml").write_text("name: my_tiny\nnum_layers: 2\n")
    (d / "env").joinpath("my_toy.yaml").write_text("name: toy\nnum_val_prompts: 16\n")
    (d / "experiment.yaml").write_text("defaults:\n  - config\n  - _self_\nname: from-my-primary\n")
    return d


def test_help_lists_groups_options_and_key_docs(user_dir):
    p = launch("--help", "--config-dir", str(user_dir))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "model     " in out and "tiny" in out and "my_tiny" in out and "quick" in out  # conf/ and the user's
    assert "grpo.max_val_samples: Optional[int] = None" in out and "the whole validation set" in out
    assert "--cfg job|hydra|all" in out and "status|logs|cancel" in out
    h = launch("--hydra-help")
    assert h.returncode == 0 and "--shell-completion" in h.stdout


def test_cfg_job_hydra_all_and_resolve():
    job = launch("--cfg", "job", "grpo.max_steps=7")
    assert job.returncode == 0 and "max_steps: 7" in job.stdout and "hydra:" not in job.stdout, job.stderr
    hyd = launch("--cfg", "hydra")
    assert hyd.returncode == 0 and "hydra:" in hyd.stdout and "searchpath" in hyd.stdout
    res = launch("--cfg", "all", "--resolve", "--package", "grpo")
    assert res.returncode == 0 and "max_steps: 150" in res.stdout, res.stderr


def test_cfg_with_a_bad_key_is_a_config_error():
    p = launch("--cfg", "job", "grpo.num_promts_per_step=3")
    assert p.returncode == 2 and p.stderr.startswith("config error") and "grpo.num_prompts_per_step" in p.stderr
    assert no_traceback(p)


def test_info_and_shell_completion():
    info = launch("--info", "searchpath")
    assert info.returncode == 0 and "file://" in info.stdout, info.stderr
    install = launch("--shell-completion", "install=bash")
    assert install.returncode == 0 and "complete" in install.stdout, install.stderr
    query = launch("--shell-completion", "query=bash", env={"COMP_LINE": "python launch.py rollout="})
    assert query.returncode == 0 and "rollout=vllm" in query.stdout, query.stdout + query.stderr


def test_user_config_dir_outside_the_repo(user_dir, tmp_path):
    p = launch("--config-dir", str(user_dir), "+recipe=quick", "model=my_tiny", "dry_run=true",
               f"output_root={tmp_path}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "run 'quick-run'" in p.stdout and str(tmp_path / "quick-run") in p.stdout
    sp = launch(f"hydra.searchpath=[file://{user_dir}]", "+recipe=quick", "dry_run=true")
    assert sp.returncode == 0 and "run 'quick-run'" in sp.stdout, sp.stderr
    cn = launch("--config-dir", str(user_dir), "-cn", "experiment", "dry_run=true")
    assert cn.returncode == 0 and "run 'from-my-primary'" in cn.stdout, cn.stderr
    sweep = launch("-m", "--config-dir", str(user_dir), "+recipe=quick", "grpo.seed=1,2", "dry_run=true",
                   f"output_root={tmp_path}")
    assert sweep.returncode == 0 and "run 'quick-run_grpo.seed=2'" in sweep.stdout, sweep.stderr[-2000:]
    nope = launch("--config-dir", str(user_dir), "+recipe=nope", "dry_run=true")
    assert nope.returncode == 2 and "recipe" in nope.stderr and "quick" in nope.stderr and no_traceback(nope)


def test_hydra_run_dir_is_refused_with_the_reason():
    p = launch("hydra.run.dir=/tmp/x", "dry_run=true")
    assert p.returncode == 2 and "hydra.run.dir" in p.stderr and "output_root" in p.stderr and no_traceback(p)


def test_subcommands_still_work(tmp_path):
    st = launch("status", "--root", str(tmp_path))
    assert st.returncode == 0 and "no runs" in st.stdout, st.stderr
    for cmd in ("logs", "cancel"):
        p = launch(cmd, "no-such-run", "--root", str(tmp_path))
        assert p.returncode == 1 and "no run 'no-such-run'" in p.stderr and no_traceback(p)


def test_model_path_dir_is_enough(tmp_path):
    from unit.test_spec import write_model_dir

    d = write_model_dir(tmp_path / "my-model")
    ok = launch(f"model.path={d}", "dry_run=true", "--cfg", "job")
    assert ok.returncode == 0, ok.stderr
    run = launch(f"model.path={d}", "dry_run=true", f"output_root={tmp_path}")
    assert run.returncode == 0 and "run 'tiny-grpo'" in run.stdout, run.stderr
    bad = launch(f"model.path={d}", "model.num_layers=9", "dry_run=true")
    assert bad.returncode == 2 and "model.num_layers" in bad.stderr and "num_hidden_layers=3" in bad.stderr


def test_config_dir_then_an_override_then_cfg(user_dir):
    """Hydra's parser takes overrides as one run of positionals: ours (hydra.searchpath) must not land after --cfg."""
    p = launch("--config-dir", str(user_dir), "model=my_tiny", "--cfg", "job")
    assert p.returncode == 0 and "name: my_tiny" in p.stdout, p.stderr[-2000:]


def test_a_typo_inside_a_user_yaml_is_named(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.yaml").write_text("name: bad\nnum_layerz: 3\n")
    p = launch("--config-dir", str(tmp_path), "model=bad", "dry_run=true")
    assert p.returncode == 2 and no_traceback(p)
    assert "model.num_layerz" in p.stderr and "did you mean 'model.num_layers'" in p.stderr, p.stderr


def test_every_bad_override_at_once():
    p = launch("grpo.max_steps=abc", "train.lr=abc", "loss.clip_hgh=0.2", "model=nope", "rollout.temperature=-1",
               "dry_run=true")
    assert p.returncode == 2 and no_traceback(p)
    for key in ("grpo.max_steps", "train.lr", "loss.clip_hgh", "  - model:", "rollout.temperature"):
        assert key in p.stderr, (key, p.stderr)


def test_a_dry_run_says_what_a_real_launch_would_refuse(tmp_path):
    no_gym = {"GYM_HOME": str(tmp_path / "no-gym")}  # the same answer whether or not `make gym` ran (or is running)
    p = launch("+recipe=nanov3", "cluster=slurm", "dry_run=true", env=no_gym)
    assert p.returncode == 0 and "#SBATCH" in p.stdout, p.stderr[-2000:]
    # + checkpoint_disk_room: the recipe keeps all 100 checkpoints of 59 GiB, more than this machine's disk holds
    problems = 7 if find_spec("mamba_ssm") else 8  # + megatron's Mamba mixer without mamba-ssm
    assert f"a real launch of this spec would be refused ({problems} problems)" in p.stdout
    assert "checkpoint_disk_room" in p.stdout
    assert "env=nemo_gym needs NeMo Gym" in p.stdout
    assert "nemotron_h on the megatron backend" in p.stdout and "train.sequence_packing" in p.stdout
    p = launch("model.path=/no/such/model", "dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0 and "would be refused (1 problem)" in p.stdout and "model.path" in p.stdout
    p = launch("dry_run=true", f"output_root={tmp_path}")
    assert p.returncode == 0 and "would be refused" not in p.stdout


@pytest.mark.parametrize("flag", ["--config-dir", "--config-path"])
def test_a_config_dir_that_is_not_there_is_a_config_error(tmp_path, flag):
    """A typo in the config dir: Hydra alone would warn and run the defaults, without the user's configs."""
    p = launch(flag, str(tmp_path / "my-confs"), "dry_run=true")
    assert p.returncode == 2 and p.stderr.startswith("config error") and flag in p.stderr, p.stderr
    assert no_traceback(p)
