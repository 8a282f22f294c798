"""cluster=slurm for real: the rendered sbatch script, shell injection, and GRPO runs on the local
two-node Slurm cluster (scripts/local-slurm.sh: nodes n1, n2 on this host).

Tiers:
  - no marker: rendering and rule checks, and the rendered script run by bash against stub Slurm
    commands (a payload in any cluster.* string field must never execute);
  - slurm: real sbatch/srun on the local cluster (submit → status/logs/cancel; a worker node's Ray step
    dying ends the job fast naming the node; injection payloads submitted for real);
  - slurm + slow: the tiny GRPO run over Ray on both nodes, signalled with SIGUSR1 mid-run: it
    checkpoints, requeues itself and resumes; MLflow's step axis has every step exactly once.

Every job a test submits is scancel'ed at the end of the module (if still alive); the Ray session dirs
of those jobs are removed. Waits poll for conditions (no fixed sleeps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from grpo_launcher.launch.sbatch import render
from grpo_launcher.launch.status import read_status, slurm_env
from grpo_launcher.plan import make_plan

from helpers import ROOT, job_state, wait_until
from unit.test_slurm_run import PAYLOADS, PY, base_spec, free_port_block, marker, records, with_payload
from unit.test_slurm_run import root, stubs  # noqa: F401  (fixtures)

NODES = ("n1", "n2")
RAY_TMP = "/tmp/grpo-ray"  # conf/cluster/local_slurm.yaml
HAVE_SLURM = shutil.which("sbatch") is not None
needs_slurm = [pytest.mark.slurm,
               pytest.mark.skipif(not HAVE_SLURM, reason="Slurm not installed: bash scripts/local-slurm.sh install")]


def sh(args: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", slurm_env()), **kw)


def launch_py(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return sh([PY, str(ROOT / "launch.py"), *args], timeout=timeout, env=env or slurm_env(), cwd=ROOT)


class Lines:
    """Lines of a child's stdout, read on a thread, with timeouts."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.q, self.seen, self.ended = proc, queue.Queue(), [], False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def lines(self, timeout: float):
        """Yield lines until the child's output ends (then return) or the deadline passes (then stop)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is None:
                self.ended = True
                return
            self.seen.append(line)
            yield line

    def until(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        for line in self.lines(timeout):
            m = rx.search(line)
            if m:
                return m
        raise AssertionError(f"never saw /{pattern}/ within {timeout:.0f}s; last output:\n"
                             + "\n".join(self.seen[-40:]))

    def rest(self, timeout: float) -> str:
        for _ in self.lines(timeout):
            pass
        if self.ended:
            return "\n".join(self.seen)
        raise AssertionError("the launcher did not exit in time; last output:\n" + "\n".join(self.seen[-40:]))


# ------------------------------------------------------------------ the real local Slurm cluster


@pytest.fixture(scope="module")
def cluster():
    if not HAVE_SLURM:
        pytest.skip("Slurm not installed")
    proc = sh(["sinfo", "-N", "-h", "-o", "%N %t"], timeout=30)
    states = dict(line.split()[:2] for line in proc.stdout.splitlines() if line.strip())
    bad = {n: states.get(n, "missing") for n in NODES
           if states.get(n, "missing").rstrip("*~#!%$@^-") not in ("idle", "mix", "alloc")}
    if proc.returncode != 0 or bad:
        pytest.fail(f"local Slurm not up ({proc.stderr.strip()} {bad}); run `bash scripts/local-slurm.sh start`")


@pytest.fixture(scope="module")
def jobs():
    """Every job id a test submits; at the end: scancel what still runs, wait, remove its Ray dirs."""
    ids: list[str] = []
    yield ids
    for job in ids:
        if job_state(job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"):
            sh(["scancel", job])
    for job in ids:
        try:
            wait_until(lambda: job_state(job) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"), 90,
                       f"job {job} to end")
        except AssertionError:
            pass
        for d in Path(RAY_TMP).glob(f"{job}-*"):
            shutil.rmtree(d, ignore_errors=True)


def submit(root: Path, jobs: list, name: str, *overrides: str, env=None) -> tuple[str, str, float]:
    t0 = time.monotonic()
    p = launch_py("cluster=local_slurm", f"output_root={root}", f"name={name}", *overrides, env=env)
    took = time.monotonic() - t0
    m = re.search(r"submitted job (\d+)", p.stdout)
    assert p.returncode == 0 and m, p.stdout[-2000:] + p.stderr[-2000:]
    jobs.append(m.group(1))
    return m.group(1), p.stdout, took


@pytest.mark.slurm
def test_submit_returns_status_logs_cancel(cluster, jobs, root):
    job, out, took = submit(root, jobs, "cancel-me", "grpo.max_steps=500")
    run_dir = root / "cancel-me"
    assert took < 60, f"submission took {took:.0f}s: it must not wait for the job"
    for needle in (f"run dir    : {run_dir}", f"driver-{job}.log", f"slurm-{job}.out", "launch.py status cancel-me"):
        assert needle in out, out
    assert read_status(run_dir)["job_id"] == job
    again = launch_py("cluster=local_slurm", f"output_root={root}", "name=cancel-me")  # same run dir: refused
    assert again.returncode == 1 and f"already in use by Slurm job {job} (" in again.stderr, again.stderr
    wait_until(lambda: "ray_ready" in read_status(run_dir).get("events", {}), 180, "Ray up on both nodes")

    by_name = json.loads(launch_py("status", "cancel-me", "--root", str(root), "--json").stdout)
    by_job = json.loads(launch_py("status", job, "--json").stdout)  # job id: found through scontrol
    assert by_name["state"] == by_job["state"] == "RUNNING" and by_job["run_dir"] == str(run_dir)
    assert by_name["slurm"]["NodeList"] == "n[1-2]"
    text = launch_py("status", "cancel-me", "--root", str(root)).stdout
    assert re.search(r"^state\s+RUNNING", text, re.M) and re.search(rf"^job\s+{job}\b", text, re.M), text
    slurm_log = launch_py("logs", "--slurm", job).stdout
    assert "Ray head on n1" in slurm_log and "ray_wait: cluster ready" in slurm_log and "2/2 nodes" in slurm_log

    t0 = time.monotonic()
    p = launch_py("cancel", job)
    assert p.returncode == 0 and f"cancelled job {job}" in p.stdout, p.stdout + p.stderr
    assert time.monotonic() - t0 < 60
    assert job_state(job) == "CANCELLED"
    assert read_status(run_dir)["state"] == "CANCELLED"
    assert json.loads(launch_py("status", job, "--json").stdout)["state"] == "CANCELLED"
    assert sh(["squeue", "-h", "-j", job]).stdout.strip() == ""


def ray_start_pid(job: str, index: int) -> int | None:
    """The `ray start --block` process of node <index> of this job (its temp dir names it)."""
    needle = f"--temp-dir={RAY_TMP}/{job}-{index}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in cmd and b"ray.scripts.scripts" in cmd:
                return int(proc.name)
    return None


@pytest.mark.slurm
@pytest.mark.extended
def test_worker_node_step_dies_job_fails_fast_naming_it(cluster, jobs, root):
    job, _, _ = submit(root, jobs, "lose-n2", "grpo.max_steps=500")
    run_dir = root / "lose-n2"
    wait_until(lambda: "ray_ready" in read_status(run_dir).get("events", {}), 180, "Ray up on both nodes")
    pid = wait_until(lambda: ray_start_pid(job, 1), 120, "the n2 Ray step's process")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    # generous on a loaded machine; the race this guards against failed only after ray_join_timeout_s (180 s)
    st = wait_until(lambda: (s := read_status(run_dir))["state"] == "FAILED" and s, 170, "status FAILED")
    assert time.monotonic() - t0 < 170
    assert "node n2" in st["message"], st
    wait_until(lambda: job_state(job) == "FAILED", 180, "Slurm to end the job")
    text = launch_py("status", "lose-n2", "--root", str(root)).stdout
    assert "FAILED" in text and "node n2" in text
    assert "the Ray step on node n2 ended" in (run_dir / "logs" / f"slurm-{job}.out").read_text()


def mlflow_steps(root: Path, run_dir: Path, key: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(exps, filter_string=f"tags.`grpo.run_dir` = '{run_dir}'")
    return [m.step for m in client.get_metric_history(run.info.run_id, key)], run


def release_requeued(job: str) -> None:
    """Slurm holds a requeued job ~2 min (BeginTime), partly so that the new start's credential is not
    taken for the revoked one of the old start. Release it early, as an operator could: once the old
    allocation is fully released and the wall clock is past the second the requeue happened in."""
    def pending_on_begin_time():
        out = sh(["scontrol", "show", "job", job]).stdout
        return "JobState=PENDING" in out and "Reason=BeginTime" in out

    wait_until(pending_on_begin_time, 180, f"requeued job {job} to wait on its BeginTime")
    t_pending = time.time()
    wait_until(lambda: not re.search(r"^n[12] comp", sh(["sinfo", "-N", "-h", "-o", "%N %t"]).stdout, re.M), 120,
               "the old allocation to be released")
    wait_until(lambda: time.time() >= int(t_pending) + 2, 5, "the next wall-clock second", poll=0.1)
    sh(["scontrol", "update", f"JobId={job}", "StartTime=now"]).check_returncode()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.extended  # make test: test_submit_returns_status_logs_cancel (a real two-node job), test_submitit.py
def test_two_node_grpo_preempted_requeued_resumed(cluster, jobs, root):
    """cluster.wait=true: the launcher streams the job; SIGUSR1 mid-run → checkpoint, exit 3, requeue,
    resume; the run completes on both nodes with every step in MLflow exactly once."""
    steps = 8
    secret = f"s3cret-{uuid.uuid4().hex}"
    env = {**slurm_env(), "GRPO_TEST_SECRET": secret}
    cmd = [PY, "-u", str(ROOT / "launch.py"), "cluster=local_slurm", f"output_root={root}", "name=e2e",
           f"grpo.max_steps={steps}", "cluster.wait=true", "cluster.env_passthrough=[GRPO_TEST_SECRET]"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(proc)
    try:
        job = out.until(r"submitted job (\d+)", 60).group(1)
        jobs.append(job)
        out.until(r"^\[driver\] step 2/", 600)
        sh(["scancel", "--signal=USR1", "--batch", job]).check_returncode()
        out.until(r"requeueing job", 240)
        release_requeued(job)
        out.until(rf"job {job} start #1", 120)
        text = out.rest(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(30) == 0, text[-4000:]
    run_dir = root / "e2e"
    assert f"job {job} ended: COMPLETED" in text
    assert re.search(r"first training step [\d.]+s after the command", text)
    assert "ray_wait: cluster ready" in text and "2/2 nodes" in text

    driver_log = (run_dir / "logs" / f"driver-{job}.log").read_text()
    stopped = re.search(r"stopped after step (\d+) \(SIGUSR1\); checkpoint saved", driver_log)
    assert stopped, driver_log
    k = int(stopped.group(1))
    assert f"resuming from step_{k:06d} (step {k})" in driver_log
    logged, run = mlflow_steps(root, run_dir, "train/reward_mean")
    assert sorted(logged) == list(range(1, steps + 1)), f"steps lost or repeated: {sorted(logged)}"
    assert run.info.status == "FINISHED"
    st = read_status(run_dir)
    assert st["state"] == "COMPLETED" and st["restarts"] == 1 and st["job_ids"] == [job]

    placement = json.loads((run_dir / "logs" / f"placement-{job}.json").read_text())
    where = {(a["class"], a["slurm_node"]) for a in placement["actors"]}
    for cls in ("TorchPolicyWorker",):  # rollout=hf runs inside the policy workers (hybrid)
        assert {(cls, "n1"), (cls, "n2")} <= where, placement["summary"]

    logs = launch_py("logs", "e2e", "--root", str(root)).stdout
    assert f"step {steps}/{steps}" in logs and "resuming from" in logs
    status = json.loads(launch_py("status", "e2e", "--root", str(root), "--json").stdout)
    assert status["state"] == "COMPLETED" and status["step"] == f"{steps}/{steps}"
    # env passthrough: by name only — the value is nowhere in the run dir or the MLflow store
    for f in [*run_dir.rglob("*"), root / "mlflow.db"]:
        if f.is_file() and not f.is_symlink():
            assert secret.encode() not in f.read_bytes(), f


@pytest.mark.slurm
@pytest.mark.extended
def test_injection_payloads_submitted_for_real(cluster, jobs, tmp_path, stubs):
    """The rendered script of a spec carrying payloads (rules bypassed) goes through the real sbatch and
    srun. sbatch refuses bad partitions and times; everything else runs and executes no payload."""
    stubs_dir, stub_py = stubs
    (stubs_dir / "scontrol").unlink()  # the real ones, except srun: a wrapper drops pyxis flags
    for name in ("squeue", "scancel"):
        (stubs_dir / name).unlink()
    env = {**slurm_env(), "PATH": f"{stubs_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "calls.log"),
           "REAL_PY": PY, "REAL_SRUN": shutil.which("srun")}
    marks, submitted, images = [], {}, {}
    for style in ("semicolon", "dollar", "backtick"):
        fields = {f: marker(f) for f in ("account", "qos", "job_name", "container_image", "container_mounts",
                                         "ray_temp_dir", "partition", "time", "python")}
        marks += fields.values()
        p = {f: PAYLOADS[style].format(m=m) for f, m in fields.items()}
        spec = base_spec(root=tmp_path / style)
        spec = dataclasses.replace(spec, cluster=dataclasses.replace(  # sbatch --export: the stubs' variables by name
            spec.cluster, python=str(stub_py), ray_port=free_port_block(), job_port_stride=0,
            env_passthrough=["STUB_LOG", "REAL_PY", "REAL_SRUN"]))
        for f in ("account", "qos", "job_name", "container_image", "container_mounts", "ray_temp_dir"):
            spec = with_payload(spec, f, p[f])
        images[style] = p["container_image"]
        variants = {"fields": spec,
                    "python": dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, python=p["python"])),
                    "partition": with_payload(spec, "partition", p["partition"]),
                    "time": with_payload(spec, "time", p["time"])}
        for variant, vspec in variants.items():
            vspec = dataclasses.replace(vspec, name=f"inj-{style}-{variant}")
            plan = make_plan(vspec)
            (plan.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            (plan.run_dir / "spec.yaml").write_text("stub\n")
            path = plan.run_dir / f"job-{variant}.sbatch"
            path.write_text(render(vspec, plan))
            proc = sh(["sbatch", "--parsable", str(path)], env=env)
            if variant in ("partition", "time"):
                assert proc.returncode != 0, f"sbatch accepted a bad --{variant}"
                continue
            assert proc.returncode == 0, proc.stderr
            jobs.append(proc.stdout.strip())
            submitted[proc.stdout.strip()] = (style, variant, plan.run_dir)
    for job, (style, variant, run_dir) in submitted.items():
        state = wait_until(lambda: (s := job_state(job)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s,
                           240, f"injection job {job} ({style}/{variant}) to end")
        if variant == "fields":  # the stub driver exits 0: the whole script ran
            assert state == "COMPLETED", (run_dir / "logs" / f"slurm-{job}.out").read_text()[-3000:]
            assert read_status(run_dir)["state"] == "COMPLETED"
    srun_args = [a for r in records(tmp_path / "calls.log") if r[0] == "srun" for a in r[1:]]
    for style, image in images.items():  # the payload reached srun as one intact argument
        assert f"--container-image={image}" in srun_args, style
    assert not [str(m) for m in marks if m.exists()], "a payload executed"
    for m in marks:
        m.unlink(missing_ok=True)


@pytest.mark.slurm
@pytest.mark.extended
def test_time_limit_signal_requeues_and_resumes(cluster, jobs, tmp_path, stubs):
    """The real `--signal=B:USR1@N` before `--time`: Slurm signals the batch shell, the script forwards the
    signal through srun to the driver (a stub here, so that this takes a minute), the driver exits 3, the
    job requeues itself and its next start finishes. Nobody but Slurm sends the signal."""
    stubs_dir, stub_py = stubs
    for name in ("scontrol", "squeue", "scancel"):
        (stubs_dir / name).unlink()
    env = {**slurm_env(), "PATH": f"{stubs_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "calls.log"),
           "REAL_PY": PY, "REAL_SRUN": shutil.which("srun"), "STUB_DRIVER": "wait_usr1"}
    spec = base_spec("cluster.time=00:02:00", "cluster.signal_before_s=100", "name=time-limit", root=tmp_path)
    spec = dataclasses.replace(spec, cluster=dataclasses.replace(
        spec.cluster, python=str(stub_py), ray_port=free_port_block(), job_port_stride=0,
        env_passthrough=["STUB_LOG", "REAL_PY", "REAL_SRUN", "STUB_DRIVER"]))  # sbatch --export: by name
    plan = make_plan(spec)
    (plan.run_dir / "logs").mkdir(parents=True)
    (plan.run_dir / "spec.yaml").write_text("stub\n")
    script = render(spec, plan)
    assert "#SBATCH --time=00:02:00" in script and "#SBATCH --signal=B:USR1@100" in script
    (plan.run_dir / "job.sbatch").write_text(script)
    proc = sh(["sbatch", "--parsable", str(plan.run_dir / "job.sbatch")], env=env)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    jobs.append(job)
    release_requeued(job)  # Slurm's own USR1 (due 20 s in; its timer checks every ~30 s) → exit 3 → requeue
    state = wait_until(lambda: (s := job_state(job)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s,
                       150, "the requeued job to finish")
    slurm_log = (plan.run_dir / "logs" / f"slurm-{job}.out").read_text()
    driver_log = (plan.run_dir / "logs" / f"driver-{job}.log").read_text()
    assert state == "COMPLETED", slurm_log[-3000:]
    assert "SIGUSR1 (time limit near" in slurm_log and "requeueing job" in slurm_log
    assert f"job {job} start #1" in slurm_log
    assert "stub driver: SIGUSR1" in driver_log and "resumed from the checkpoint; done" in driver_log
    st = read_status(plan.run_dir)
    assert st["state"] == "COMPLETED" and st["restarts"] == 1
