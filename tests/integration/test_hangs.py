"""No silent hangs (issue 28): the deadline arithmetic, the hang report, the bounded stop, `status`'s phase line;
and real runs whose Ray worker is frozen with SIGSTOP (as a GPU stuck in a collective looks from outside).

Slow tier: the default tiny CPU run, then `kill -STOP` on the `ray::TorchPolicyWorker` (or `ray::EnvWorker`)
process this test's run started, found among the run's own child processes: the run ends within its deadline
with exit 4, the message and status HUNG, its last checkpoint intact; a SIGTERM during a frozen step ends the run
within deadlines.stop_grace_s. Every process started here is stopped by PID at the end (SIGCONT, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from grpo_launcher.exit_codes import ExitCode
from grpo_launcher.spec.schema import DeadlinesSpec
from grpo_launcher.deadlines import ActorInfo, Hung

from helpers import ROOT, wait_until
from unit.test_hangs import PY


@pytest.mark.slow
@pytest.mark.extended
def test_stack_is_taken_on_the_actors_node_by_a_pinned_task():
    import ray

    from grpo_launcher.deadlines import actor_info, stack_on_node

    @ray.remote(num_cpus=0)
    class Sleeper:
        def nap(self) -> None:
            time.sleep(3600)

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        a = Sleeper.remote()
        a.nap.remote()
        info = wait_until(lambda: (i := actor_info(a, "policy", 0)).pid and i, 120, "the actor's pid")
        assert info.node_id == ray.get_runtime_context().get_node_id()
        text = stack_on_node(info)
        assert text.startswith(f"(py-spy run on node {info.node}, the actor's)"), text
        assert "nap" in text or "py-spy" in text, text  # the sleeping method, or why py-spy could not read it
        ray.kill(a)
    finally:
        ray.shutdown()
    assert stack_on_node(ActorInfo("policy", 0, None, None)) == "(no pid known: no stack)"  # Ray down: here


@pytest.mark.slow
@pytest.mark.extended
def test_ipc_refit_failure_names_the_engine_not_policy_rank_0():
    """The CUDA IPC refit (policy rank 0 drives the engines) past its deadline, or failed: the engine that gives
    no health answer (SIGSTOP) is named, then the dead one (kill -9). Real actors; the refit itself needs CUDA."""
    from types import SimpleNamespace

    import ray

    from grpo_launcher.deadlines import HEALTH_GROUP, ActorDied, actor_info
    from grpo_launcher.train.engines import EnginePool

    @ray.remote(num_cpus=0, concurrency_groups={HEALTH_GROUP: 1})
    class Engine:
        def ping(self) -> bool:
            return True

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    frozen = None
    try:
        engines = [Engine.remote(), Engine.remote()]
        ray.get([e.ping.remote() for e in engines], timeout=120)
        me = SimpleNamespace(w=SimpleNamespace(probe=object(), rollout=engines),
                             spec=SimpleNamespace(deadlines=DeadlinesSpec(health_timeout_s=3)))
        policy_hung = Hung("refit", 9, 300.0, "x", owners=["policy rank 0"])
        assert EnginePool.engine_at_fault(me, policy_hung) is policy_hung  # every engine answers: the policy's fault
        frozen = psutil.Process(actor_info(engines[1], "rollout", 1).pid)
        frozen.send_signal(signal.SIGSTOP)
        named = EnginePool.engine_at_fault(me, policy_hung)
        assert isinstance(named, Hung) and named.owners == [engines[1]] and named.phase == "refit"
        assert "policy rank 0 waits on the engines' refit" in str(named)
        frozen.send_signal(signal.SIGCONT)
        ray.kill(engines[1])
        named = EnginePool.engine_at_fault(me, ActorDied("refit", 9, "policy rank 0", "x"))
        assert isinstance(named, ActorDied) and named.owner is engines[1], named
    finally:
        if frozen is not None and frozen.is_running():
            frozen.send_signal(signal.SIGCONT)
        ray.shutdown()


# ------------------------------------------------------------------ real runs, a frozen worker

MODEL_CACHE = Path(os.environ.get("GRPO_TEST_MODEL_CACHE", "/tmp/grpo-test-cache/models"))


def run_cmd(tmp_path: Path, name: str, *extra: str, mlflow: bool = False, steps: int = 2000) -> list[str]:
    """The default tiny CPU run (the tiny model built once per machine: a shared cache)."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    if not (tmp_path / ".models").exists():
        (tmp_path / ".models").symlink_to(MODEL_CACHE)
    return [PY, "-u", str(ROOT / "launch.py"), f"output_root={tmp_path}", f"name={name}", f"grpo.max_steps={steps}",
            f"logging.mlflow={str(mlflow).lower()}", "logging.experiment=h28-hangs", "checkpoint.save_period=5", "grpo.val_period=0", "checkpoint.metric=train/reward_mean",
            "logging.progress=true", *extra]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def worker_of(proc: subprocess.Popen, title: str) -> psutil.Process | None:
    """The run's own Ray worker whose process title starts with `title` (a descendant of the launch process)."""
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(title):
                return p
        except psutil.Error:
            continue
    return None


def stop_all(proc: subprocess.Popen, frozen: psutil.Process | None) -> None:
    """What this test started, by PID: the frozen worker (SIGCONT, SIGKILL), the run's process group."""
    if frozen is not None and frozen.is_running():
        frozen.send_signal(signal.SIGCONT)
        frozen.kill()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def started_and_frozen(tmp_path: Path, name: str, title: str, *extra: str, mlflow: bool = False,
                       sig: int = signal.SIGSTOP, at_step: int = 12, steps: int = 2000):
    """Launch, wait for step `at_step` (12: checkpoint step_000010 written), freeze the worker (or `sig` it);
    (proc, worker, log, t0)."""
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(run_cmd(tmp_path, name, *extra, mlflow=mlflow, steps=steps), stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    run_dir = tmp_path / name
    try:
        wait_until(lambda: steps_done(run_dir) >= at_step or proc.poll() is not None, 900, f"step {at_step}")
        assert proc.poll() is None, log.read_text()[-3000:]
        worker = wait_until(lambda: worker_of(proc, title), 60, f"the run's {title} process")
    except BaseException:
        stop_all(proc, None)
        raise
    worker.send_signal(sig)
    return proc, worker, log, time.monotonic()


def last_checkpoint_intact(run_dir: Path) -> str:
    from grpo_launcher.checkpoint import verify_checkpoint

    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts and verify_checkpoint(ckpts[-1]) is None, ckpts
    return ckpts[-1].name


ASYNC = ("grpo.async_grpo.enabled=true", "cluster.cpu_workers_per_node=2", "cluster.rollout_devices=1",
         "loss.importance_sampling_correction=true")


@pytest.mark.slow
@pytest.mark.parametrize("title,role,mlflow,extra", [
    ("ray::TorchPolicyWorker", "policy rank 0", False, ()),
    pytest.param("ray::EnvWorker", "env rank 0", True, (), marks=pytest.mark.extended),  # + the MLflow run's end
    pytest.param("ray::HFRolloutWorker", "rollout rank 0", False, ASYNC, marks=pytest.mark.extended),  # an engine
], ids=["policy", "env-worker", "async-engine"])
def test_frozen_worker_ends_the_run_within_its_deadline(tmp_path, title, role, mlflow, extra):
    name = f"h28-{role.split()[0]}"
    run_dir = tmp_path / name
    proc, worker, log, t0 = started_and_frozen(tmp_path, name, title, "deadlines.floor_s=5", *extra, mlflow=mlflow)
    try:
        status = subprocess.run([PY, str(ROOT / "launch.py"), "status", name, "--root", str(tmp_path)],
                                capture_output=True, text=True, timeout=120)
        rc = proc.wait(timeout=300)
        took = time.monotonic() - t0
        text = log.read_text()
        assert rc == ExitCode.HUNG, text[-4000:]
        m = re.search(r"HUNG: phase (\w+) of step (\d+): no answer after ([\d.]+) s", text)
        assert m, text[-4000:]
        assert float(m.group(3)) < 60 and took < 240, (m.group(0), took)
        assert f"waiting for: {role} (pid {worker.pid}, node " in text
        last = int(re.search(r"last completed step: (\d+); last checkpoint: (\S+)", text).group(1))
        assert last >= 12 and int(m.group(2)) in (last, last + 1)  # (last: hung in its checkpoint save)
        assert f"stack of {role} (pid {worker.pid}):" in text
        assert re.search(r"Thread|py-spy", text.split(f"stack of {role}")[1])
        assert "(py-spy run on node " in text.split(f"stack of {role}")[1]  # a task pinned to the actor's node
        st = json.loads((run_dir / "status.json").read_text())
        assert st["state"] == "HUNG" and st["exit_code"] == ExitCode.HUNG and st["message"].startswith("phase ")
        ckpt = last_checkpoint_intact(run_dir)
        assert f"last checkpoint: {run_dir / 'checkpoints' / ckpt}" in text
        assert re.search(r"phase\s+\w+ \(step \d+\)", status.stdout), status.stdout  # liveness in `status`
        if mlflow:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
            (run,) = client.search_runs([client.get_experiment_by_name("h28-hangs").experiment_id])
            assert run.info.status == "FAILED" and run.data.tags["grpo.hung"].startswith(f"phase {m.group(1)} ")
        print(f"{title}: frozen -> exit {rc} after {took:.1f} s ({m.group(0)}); status line: "
              f"{re.search(r'phase .*', status.stdout).group(0)}")
    finally:
        stop_all(proc, worker)


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_during_a_frozen_step_ends_within_the_stop_grace(tmp_path):
    name = "h28-sigterm"
    proc, worker, log, t0 = started_and_frozen(tmp_path, name, "ray::TorchPolicyWorker",
                                               "deadlines.floor_s=3600", "deadlines.stop_grace_s=5")
    try:
        proc.send_signal(signal.SIGTERM)  # the driver's pid only
        rc = proc.wait(timeout=300)
        took = time.monotonic() - t0
        text = log.read_text()
        assert rc == ExitCode.TERMINATED and took < 120, (rc, took, text[-3000:])
        assert "finishing the current step (at most deadlines.stop_grace_s=5 s)" in text
        assert "the step did not finish within deadlines.stop_grace_s=5 s; abandoning it" in text
        last_checkpoint_intact(tmp_path / name)
        st = json.loads((tmp_path / name / "status.json").read_text())
        assert st["state"] == "STOPPED" and st["exit_code"] == ExitCode.TERMINATED
        print(f"SIGTERM during a frozen step -> exit {rc} after {took:.1f} s")
    finally:
        stop_all(proc, worker)


@pytest.mark.slow
@pytest.mark.extended
def test_killed_policy_worker_ends_the_run_naming_it(tmp_path):
    name = "h28-kill9"
    proc, worker, log, t0 = started_and_frozen(tmp_path, name, "ray::TorchPolicyWorker", sig=signal.SIGKILL)
    try:
        rc = proc.wait(timeout=300)
        took = time.monotonic() - t0
        text = log.read_text()
        assert rc == ExitCode.FAILED and took < 120, (rc, took, text[-3000:])
        m = re.search(r"grpo-launcher: policy rank 0 \(pid (\d+), node \S+\) died in phase (\w+) of step (\d+)", text)
        assert m and int(m.group(1)) == worker.pid, text[-3000:]
        assert "last completed step: " in text
        last_checkpoint_intact(tmp_path / name)
        st = json.loads((tmp_path / name / "status.json").read_text())
        assert st["state"] == "FAILED"
        print(f"kill -9 of the policy worker -> exit {rc} after {took:.1f} s ({m.group(0)})")
    finally:
        stop_all(proc, None)


# ------------------------------------------------------------------ rollout=vllm: a lost engine is restarted

VLLM = ("rollout=vllm", "deadlines.health_period_s=2", "deadlines.health_timeout_s=5")


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.extended  # a vLLM engine's fault; make test: test_frozen_worker_ends_the_run_within_its_deadline[policy]
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill9", "sigstop"])
def test_lost_engine_is_restarted_and_no_step_is_lost_or_repeated(tmp_path, sig):
    """kill -9 (Ray sees the actor die) or SIGSTOP (the health probe gets no answer, kills it) of the vLLM engine's
    process mid-run: the engine is started again with the policy's weights, the step's requests retried, and the
    run finishes with steps 1..N logged once each (metrics.jsonl and MLflow's step axis)."""
    name, steps = f"h28-engine-{signal.Signals(sig).name.lower()}", 14
    proc, worker, log, t0 = started_and_frozen(tmp_path, name, "ray::VLLMRolloutWorker", *VLLM, mlflow=True,
                                               sig=sig, at_step=6, steps=steps)
    try:
        wait_until(lambda: "lost in phase" in log.read_text() or proc.poll() is not None, 300, "the restart line")
        restarted_s = time.monotonic() - t0  # found + started again + refit
        rc = proc.wait(timeout=600)
        text = log.read_text()
        assert rc == 0, text[-4000:]
        m = re.search(r"grpo-launcher: rollout engine 0 \(pid (\d+), node \S+\) lost in phase (\w+) of step (\d+): "
                      r"(.*); restarted \(1 of deadlines.engine_restarts=3\)", text)
        assert m and int(m.group(1)) == worker.pid, text[-4000:]
        if sig == signal.SIGSTOP:
            assert "no answer to a health probe within deadlines.health_timeout_s=5 s" in m.group(4)
        run_dir = tmp_path / name
        assert steps_logged(run_dir) == list(range(1, steps + 1))
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("h28-hangs").experiment_id])
        assert run.info.status == "FINISHED"
        for key in ("train/reward_mean", "rollout/engine_restarts"):
            assert [x.step for x in client.get_metric_history(run.info.run_id, key)] == list(range(1, steps + 1))
        restarts = {x.step: x.value for x in client.get_metric_history(run.info.run_id, "rollout/engine_restarts")}
        assert restarts[1] == 0 and restarts[steps] == 1
        print(f"{signal.Signals(sig).name} of the vLLM engine -> restarted {restarted_s:.1f} s later in phase "
              f"{m.group(2)} of step {m.group(3)} ({m.group(4)}); run finished, steps 1..{steps} once each")
    finally:
        stop_all(proc, worker)


@pytest.mark.slow
@pytest.mark.extended
def test_engine_lost_past_the_restart_cap_ends_the_run_naming_it(tmp_path):
    name = "h28-engine-cap"
    proc, worker, log, t0 = started_and_frozen(tmp_path, name, "ray::VLLMRolloutWorker", *VLLM,
                                               "deadlines.engine_restarts=0", sig=signal.SIGKILL, at_step=6)
    try:
        rc = proc.wait(timeout=300)
        took = time.monotonic() - t0
        text = log.read_text()
        assert rc == ExitCode.HUNG and took < 120, (rc, took, text[-3000:])
        assert re.search(r"HUNG: phase \w+ of step \d+: rollout engine lost \(.*\); deadlines.engine_restarts=0 "
                         r"restarts already made", text), text[-3000:]
        assert f"waiting for: rollout rank 0 (pid {worker.pid}, node " in text
        st = json.loads((tmp_path / name / "status.json").read_text())
        assert st["state"] == "HUNG" and st["exit_code"] == ExitCode.HUNG
        print(f"kill -9 of the vLLM engine, deadlines.engine_restarts=0 -> exit {rc} after {took:.1f} s")
    finally:
        stop_all(proc, None)


@pytest.mark.slow
@pytest.mark.gym
@pytest.mark.extended
def test_frozen_gym_server_ends_the_run_naming_it(tmp_path):
    """SIGSTOP of a Gym resources server mid-run: the probe finds it within period + timeout, the run ends with
    exit 4 naming the server (not every rollout failing at its HTTP timeout, step after step)."""
    from grpo_launcher.gym.install import find_install

    if find_install() is None:
        pytest.skip("NeMo Gym's venv is not installed: run `make gym`")
    from unit.test_nemo_gym import GYM

    name = "h28-gym"
    extra = (*GYM, "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "train.global_batch_size=16",
             "train.micro_batch_size=16", "train.logprob_batch_size=16", "deadlines.health_period_s=2",
             "deadlines.health_timeout_s=5")
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(run_cmd(tmp_path, name, *extra), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    server = None
    try:
        wait_until(lambda: steps_done(tmp_path / name) >= 2 or proc.poll() is not None, 1800, "step 2")
        assert proc.poll() is None, log.read_text()[-3000:]
        server = wait_until(lambda: next((p for p in psutil.Process(proc.pid).children(recursive=True)
                                          if "math_with_judge" in " ".join(p.cmdline())), None), 60, "a Gym server")
        server.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        rc = proc.wait(timeout=600)
        took = time.monotonic() - t0
        text = log.read_text()
        assert rc == ExitCode.HUNG, text[-4000:]
        m = re.search(r"HUNG: NeMo Gym server '([^']+)' \(pid (\d+), \S+\) gave no answer to a health probe within "
                      r"deadlines.health_timeout_s=5 s", text)
        assert m and took < 180, (took, text[-4000:])
        assert "last completed step: " in text and "stack of gym server rank 0" in text
        assert "Thread" in text.split("stack of gym server rank 0")[1], text[-3000:]  # taken while it was there
        st = json.loads((tmp_path / name / "status.json").read_text())
        assert st["state"] == "HUNG" and st["message"].startswith("NeMo Gym server")
        print(f"SIGSTOP of Gym server pid {server.pid} -> exit {rc} after {took:.1f} s ({m.group(0)})")
    finally:
        stop_all(proc, server)


@pytest.mark.slow
@pytest.mark.extended
def test_killed_engine_core_process_is_restarted(tmp_path):
    """rollout.async_engine=true: kill -9 of the engine's EngineCore child process (the actor lives on, its calls
    raise EngineDeadError): the engine's ping fails too, so it is restarted like a dead one; the run finishes."""
    name, steps = "h28-engine-core", 12
    proc, worker, log, t0 = started_and_frozen(tmp_path, name, "ray::VLLMRolloutWorker", *VLLM,
                                               "rollout.async_engine=true", sig=0, at_step=5, steps=steps)
    try:
        core = wait_until(lambda: next((p for p in worker.children(recursive=True)
                                        if "EngineCore" in " ".join(p.cmdline())), None), 60, "the EngineCore")
        core.kill()
        t0 = time.monotonic()
        rc = proc.wait(timeout=600)
        text = log.read_text()
        assert rc == 0, text[-4000:]
        m = re.search(r"rollout engine 0 \(pid (\d+), node \S+\) lost in phase (\w+) of step (\d+): (.*); restarted "
                      r"\(1 of deadlines.engine_restarts=3\)", text)
        assert m and int(m.group(1)) == worker.pid, text[-4000:]
        assert steps_logged(tmp_path / name) == list(range(1, steps + 1))
        print(f"kill -9 of the EngineCore (pid {core.pid}) -> engine restarted in phase {m.group(2)} of step "
              f"{m.group(3)} ({m.group(4)}); run finished {time.monotonic() - t0:.1f} s later, steps 1..{steps} once")
    finally:
        stop_all(proc, None)
