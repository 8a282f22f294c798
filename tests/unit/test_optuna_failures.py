"""An Optuna study in which no trial completes is a failed sweep: exit 1 and one line saying so."""

from __future__ import annotations

from helpers import launch


def test_a_study_whose_trials_all_fail_exits_non_zero(tmp_path):
    """Every sampled point breaks a rule (each a failed trial): the sweep exited 0 with a warning, so a script or CI
    read a study with no result as a finished search."""
    p = launch(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "train.global_batch_size=choice(100,99)",
        "logging.mlflow=false",
        f"output_root={tmp_path}",
    )
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    assert (
        last == "optuna sweep: no trial completed: all 2 trial(s) of study 'tiny-grpo' failed (their errors are above)"
    )
    assert "Traceback" not in p.stdout + p.stderr and not list(tmp_path.rglob("optuna_best.yaml"))
    again = launch(*p.args[2:])  # the same study, its trials all run: none left, still no result
    assert again.returncode == 1, again.stderr[-2000:]
    assert again.stderr.strip().splitlines()[-1].endswith("failed (in earlier sweeps; none was left to run)")
