"""hydra/launcher=submitit_slurm|submitit_local (hydra-submitit-launcher's convention): every point checked first,
each point one submitit job running the run on its node, its run dir output_root/name as for any run.

    no marker         : the refusals (multi-node or multi-task points, cluster=slurm inside a point, no -m), a dry run
    slurm             : the one real end-to-end run: a 2-point submitit_slurm sweep of the tiny CPU run finishes
    slurm+slow+ext.   : a point's job scancel'ed: the sweep ends (exit 1, the job named), it does not wait forever;
                        Ctrl-C stops the waiting (exit 130) and names the jobs, which go on
    slow+extended     : submitit_local, one point: the run ran in the job's own process
"""

from __future__ import annotations


import pytest

OURS = "python launch.py cluster=slurm cluster.nodes=N -m KEY=a,b"


# ------------------------------------------------------------------ refusals and the dry run (no job submitted)


@pytest.mark.parametrize("args, key", [
    (["hydra/launcher=submitit_slurm", "cluster=slurm", "cluster.nodes=2"], "cluster"),
    (["hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2"], "hydra.launcher.nodes"),
    (["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"], "hydra.launcher.tasks_per_node"),
])
def test_multi_node_points_are_refused_with_a_pointer_to_our_sweep(launch_here, tmp_path, args, key):
    r = launch_here(tmp_path, "-m", *args, "grpo.max_steps=1,2", "dry_run=true", "output_root=out")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("config error: sweep not launched, no point was started"), r.stderr
    assert r.stderr.count(f"  - {key}: ") == 2 and OURS in r.stderr and "[rule: submitit_single_node]" in r.stderr
    assert "Traceback" not in r.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["multirun"]  # Hydra's multirun.yaml, no run, no MLflow


def test_a_point_with_cluster_slurm_is_refused(launch_here, tmp_path):
    r = launch_here(tmp_path, "-m", "hydra/launcher=submitit_slurm", "cluster=slurm", "grpo.max_steps=1,2",
                    "dry_run=true", "output_root=out")
    assert r.returncode == 2 and "the run inside it would submit another" in r.stderr, r.stderr
    assert "drop cluster=slurm" in r.stderr and OURS in r.stderr


def test_gpus_are_the_jobs_not_this_machines(launch_here, tmp_path):
    """On a login node without GPUs: the job must ask Slurm for the run's GPUs (the node's are checked in the job)."""
    r = launch_here(tmp_path, "-m", "hydra/launcher=submitit_slurm", "cluster.gpus_per_node=1", "grpo.max_steps=1,2",
                    "output_root=out")
    assert r.returncode == 2 and r.stderr.count("  - hydra.launcher.gpus_per_node, cluster.gpus_per_node: ") == 2
    assert "fix: hydra.launcher.gpus_per_node=1" in r.stderr and "local_gpus_present" not in r.stderr, r.stderr


def test_without_m_the_launcher_is_refused(launch_here, tmp_path):
    r = launch_here(tmp_path, "hydra/launcher=submitit_local", "dry_run=true", "output_root=out")
    assert r.returncode == 2 and "without -m" in r.stderr and "[rule: hydra_launcher]" in r.stderr, r.stderr
    assert "python launch.py -m hydra/launcher=submitit_local KEY=a,b" in r.stderr


def test_dry_run_prints_every_plan_and_submits_nothing(launch_here, tmp_path):
    r = launch_here(tmp_path, "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug",
                    "grpo.max_steps=1,2", "dry_run=true", "output_root=out")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("dry run: nothing started") == 2 and "tiny-grpo_grpo.max_steps=2" in r.stdout
    assert not list((tmp_path / "out").glob("multirun/*/.submitit"))
