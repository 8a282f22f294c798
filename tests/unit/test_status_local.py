"""`launch.py status RUN` of a cluster=local run: what it has, nothing of a Slurm job's it does not have."""

from __future__ import annotations

import json

from grpo_launcher.launch.local_status import recorded
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec


def test_status_of_a_local_run_shows_no_slurm_fields(launch_here, tmp_path):
    """Was 'job local  (start #0; job ids )' (a resumed run too: no start is counted for a local run), 'slurm log
    None', and a step said to come from the driver log's step lines (it is metrics.jsonl's last step)."""
    spec = load_spec([f"output_root={tmp_path}", "name=loc", "logging.mlflow=false", "grpo.max_steps=4"])
    plan = make_plan(spec)
    for _ in range(2):  # a run and its resume, recorded as a local launch records them
        with recorded(spec, plan) as rec:
            rec["rc"] = 0
    (plan.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    r = launch_here(tmp_path, "status", "loc", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = {line[:11].strip(): line[11:] for line in r.stdout.splitlines()}
    assert rows["job"] == "local" and rows["step"] == "4/4  (the last step in metrics.jsonl)", r.stdout
    assert "slurm log" not in rows and "None" not in r.stdout and "start #" not in r.stdout, r.stdout
    assert rows["driver log"] == str(plan.run_dir / "logs" / "driver-local.log")


def test_a_resume_that_finishes_drops_the_failed_launchs_message(tmp_path):
    """A launch that failed (status.json FAILED with its error), then a resume that finished: status.json said
    COMPLETED with the failed launch's message (found by the hostile fault tester: a UnicodeDecodeError kept)."""
    spec = load_spec([f"output_root={tmp_path}", "name=res", "logging.mlflow=false", "grpo.max_steps=4"])
    plan = make_plan(spec)
    try:
        with recorded(spec, plan):
            raise ValueError("the first launch broke")
    except ValueError:
        pass
    assert json.loads((plan.run_dir / "status.json").read_text())["message"].startswith("ValueError")
    with recorded(spec, plan) as rec:
        rec["rc"] = 0
    st = json.loads((plan.run_dir / "status.json").read_text())
    assert st["state"] == "COMPLETED" and "message" not in st and st["exit_code"] == 0, st


def test_a_full_disk_under_the_driver_log_adds_no_traceback(capsys):
    """The disk filled to 0 bytes between checkpoints: the run's one disk-full message was followed by chained
    tracebacks, each an ENOSPC of the driver log's copy (the tee's flush, then the log's close). /dev/full is a
    real ENOSPC on every write."""
    import io

    from grpo_launcher.launch.local_status import Tee, closing_quietly

    terminal = io.StringIO()
    with closing_quietly(open("/dev/full", "a", encoding="utf-8")) as log:
        tee = Tee(terminal, log)
        print("grpo-launcher: no space left on device under RUN_DIR", file=tee, flush=True)
        tee.flush()
    assert terminal.getvalue() == "grpo-launcher: no space left on device under RUN_DIR\n"


def test_a_copied_run_dir_is_reported_as_a_copy_and_cancel_leaves_the_original_alone(launch_here, tmp_path):
    """`cp -r outputs/a outputs/b` while `a` ran: `status` listed both as 'a' RUNNING, and `cancel b` sent SIGTERM
    to a's driver (status.json's pid travels with the copy). A stand-in process holds the pid here."""
    import shutil
    import subprocess
    import sys

    spec = load_spec([f"output_root={tmp_path}", "name=a", "logging.mlflow=false", "grpo.max_steps=4"])
    plan = make_plan(spec)
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with recorded(spec, plan) as rec:
            st = json.loads((plan.run_dir / "status.json").read_text())
            st["pid"] = driver.pid  # the original run's driver, still running
            (plan.run_dir / "status.json").write_text(json.dumps(st))
            (plan.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
            shutil.copytree(plan.run_dir, tmp_path / "b")
            listed = launch_here(tmp_path, "status", "--root", str(tmp_path))
            cancel = launch_here(tmp_path, "cancel", "b", "--root", str(tmp_path), "--timeout", "5")
            one = launch_here(tmp_path, "status", "b", "--root", str(tmp_path))
            assert driver.poll() is None, "cancel of the copy stopped the original's driver"
            rec["rc"] = 0
    finally:
        driver.kill()
        driver.wait()
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert names == ["a", "b"] and "b" in listed.stdout.splitlines()[1] and "STOPPED" in listed.stdout, listed.stdout
    assert cancel.returncode == 0 and "a copy of" in cancel.stdout, cancel.stdout + cancel.stderr
    rows = {line[:11].strip(): line[11:] for line in one.stdout.splitlines()}
    assert rows["run"] == "b" and rows["state"].startswith("STOPPED") and "a copy of" in rows["state"], one.stdout
    assert rows["step"].startswith("2/4") and "job" not in rows, one.stdout
