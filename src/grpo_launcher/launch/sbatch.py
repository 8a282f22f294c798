"""Render the sbatch script for a run: Ray head on the first node, workers on the rest, then the driver.

The script is the `#SBATCH` header, a values block (every config value `shlex.quote`d or an int) and the
static bash program `launch/job.sh` (no value is pasted into it; `shellcheck` reads it as it is). `#SBATCH`
lines and comments refuse line breaks (a newline would end the comment and start a command); the
`slurm_fields` and `shell_values` rules additionally reject such values before anything is rendered.
A `%` in the run dir is written `%%` wherever Slurm expands filename patterns (sbatch/srun --output).
`--export` names only what the job needs (BASE_EXPORT, GRPO_*) plus cluster.env_passthrough: nothing else of
the submitting shell reaches the job. What the script does:
  1. node list via `mapfile` (never `nodes=("$x")`), checked against SLURM_JOB_NUM_NODES; one `srun`
     over all nodes reports each node's host and IPv4 (nodes sharing a host need cluster.node_port_stride);
  2. jobs sharing hosts (cluster.job_port_stride > 0) claim a free Ray port slot (flock + mkdir with the job
     id, stale claims reclaimed, every port probed on every node): two jobs never get one block;
  3. `ray start --head --block` on node 0 (explicit --node-ip-address), wait until its GCS port answers;
     then `ray start --address --block` on the others — each a background `srun --overlap` step with the
     port block (node i shifted by i × node_port_stride) and its own short temp dir; every node carries
     the custom resource `grpo_node_<i>`; Ray's Prometheus metrics listener is off (it binds 0.0.0.0);
  4. `ray_wait` until every node (every GPU) joined — or fail naming the missing nodes; a node step
     that dies meanwhile ends the job at once, naming its node;
  5. the driver on the head (`srun --overlap -w HEAD`), reading the resolved spec saved in the run dir;
  6. fail fast: the first step to end ends the job, naming its node. Waiting is race-free: "pid no longer
     runs" is polled and `wait PID` collects its status (no `wait -n` over pids bash may have reaped);
  7. after the driver: where every actor ran (`logs/placement-<job>.json`), then Ray is stopped (the
     driver first, so that it checkpoints while Ray still runs);
  8. SIGUSR1 (`--signal=B:USR1@N` before --time, or `scancel --signal=USR1 --batch`): forwarded to the
     driver, which checkpoints at the end of its step and exits 3 → `scontrol requeue` → the next start
     resumes from that checkpoint (a driver killed by the signal before its handler was installed is
     requeued too: it resumes from its previous checkpoint). SIGTERM: Slurm is asked what is happening —
     a requeue (`scontrol requeue`, preemption, node failure) → status REQUEUED; else CANCELLED (a SIGTERM
     sent to the script alone, `scancel --batch --signal=TERM`, lets the driver checkpoint, then cancels).
Ray runs with token auth (a fresh token per start, in a 0600 file of the run dir); cluster.env_passthrough
names variables the job inherits from the submitting shell — names only, never values, in the script.
Status transitions go to `<run_dir>/status.json` (launch/status.py); `launch.py status|logs|cancel` read it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from pathlib import Path

from ..exit_codes import ExitCode
from ..plan import Plan
from ..spec.schema import RunSpec

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

BODY = Path(__file__).with_name("job.sh")  # the static bash program (shellcheck reads it as it is)
# Always exported to the job (when set in the submitting shell), besides cluster.env_passthrough and GRPO_*:
# what Python, Slurm and the tools need to run, nothing else (no tokens, no cloud credentials by default).
BASE_EXPORT = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM",
               "SLURM_CONF", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME", "HF_HOME",
               "TRANSFORMERS_CACHE", "XDG_CACHE_HOME",
               "GYM_HOME")  # env=nemo_gym: where NeMo Gym's own venv is (gym/install.py), when not <repo>/.gym


def one_line(text: str, what: str) -> str:
    """Refuse line breaks in anything placed on an `#SBATCH` line or in a comment."""
    if any(ch in text for ch in "\n\r\0"):
        raise ValueError(f"{what}: line breaks are not allowed in {text!r}")
    return text


def slurm_pattern_escape(path: str) -> str:
    """sbatch/srun expand %-patterns (%j, %N, %x, ...) in --output: a literal % is written %%. A backslash
    would switch off every pattern of the name (%j too), so it is refused (rules: slurm_fields)."""
    if "\\" in path:
        raise ValueError(f"output_root: a backslash in {path!r} would disable Slurm's %j in the log file name")
    return path.replace("%", "%%")


def export_names(spec: RunSpec, environ: dict | None = None) -> list[str]:
    """sbatch --export: the variables the job needs (BASE_EXPORT, GRPO_*), plus cluster.env_passthrough;
    names only (sbatch copies the values from the submitting shell; NONE when nothing is set)."""
    if environ is None:
        # the environment sbatch itself runs with (SLURM_CONF of the local cluster); imported here: see rundir.py
        from .status import slurm_env

        environ = slurm_env()
    env = environ
    names = [n for n in BASE_EXPORT if n in env]
    names += sorted(n for n in env if n.startswith("GRPO_") and ENV_NAME.fullmatch(n))
    names += [n for n in env_names(spec.cluster.env_passthrough) if n not in names]
    return names or ["NONE"]


def env_names(names: list[str]) -> list[str]:
    """cluster.env_passthrough: variable NAMES only (the script reads `${!name}`; a value never appears)."""
    for name in names:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"cluster.env_passthrough: {name!r} is not an environment variable name")
    return names


def sbatch_header(spec: RunSpec, plan: Plan) -> list[str]:
    c = spec.cluster
    lines = [
        f"--job-name={c.job_name or spec.name}",
        f"--nodes={plan.nodes}",
        "--ntasks-per-node=1",
        f"--time={c.time}",
        f"--output={slurm_pattern_escape(str(plan.run_dir))}/logs/slurm-%j.out",
        "--open-mode=append",
        f"--export={','.join(export_names(spec))}",
    ]
    if plan.use_gpus:
        lines.append(f"--gpus-per-node={c.gpus_per_node}")
    else:
        lines.append(f"--cpus-per-task={ray_cpus(spec)}")
    for key in ("partition", "account", "qos"):
        if getattr(c, key):
            lines.append(f"--{key}={getattr(c, key)}")
    if c.exclusive:
        lines.append("--exclusive")
    if c.requeue:
        lines += ["--requeue", f"--signal=B:USR1@{c.signal_before_s}"]
    return [f"#SBATCH {shlex.quote(one_line(line, 'sbatch option'))}" for line in lines]


def ray_cpus(spec: RunSpec) -> int:
    c = spec.cluster
    return max(1, math.ceil(c.cpu_workers_per_node * c.cpus_per_worker)) if c.gpus_per_node == 0 else 8 * c.gpus_per_node


def python_of(spec: RunSpec) -> str:
    """The compute nodes' interpreter: cluster.python, else the one running the launcher (its venv)."""
    return spec.cluster.python or sys.executable


def container_flags(spec: RunSpec, plan: Plan) -> list[str]:
    """pyxis flags for every step (empty without an image). The output root is mounted at the same path
    so that the spec, logs and checkpoints are where the job expects them; env vars pass by NAME."""
    c = spec.cluster
    if not c.container_image:
        return []
    root = str(plan.run_dir.parent)
    mounts = [*c.container_mounts, f"{root}:{root}"]
    flags = [f"--container-image={c.container_image}", "--no-container-mount-home",
             f"--container-mounts={','.join(mounts)}", f"--container-workdir={root}"]
    if c.env_passthrough:
        flags.append(f"--container-env={','.join(env_names(c.env_passthrough))}")
    return flags


JOB_PORT_SLOTS = 16  # with cluster.job_port_stride > 0: the first free block of 16 from (job id % 16) on


def render(spec: RunSpec, plan: Plan) -> str:
    """#SBATCH header + comments + the values block (every value shlex-quoted) + the static body (job.sh)."""
    c, p = spec.cluster, plan.ports
    q = shlex.quote
    ints = {
        "NODE_PORT_STRIDE": c.node_port_stride, "JOB_PORT_STRIDE": c.job_port_stride, "JOB_PORT_SLOTS": JOB_PORT_SLOTS,
        "JOIN_TIMEOUT": c.ray_join_timeout_s, "REQUEUE_ENABLED": 1 if c.requeue else 0,
        "CHECKPOINTS": 1 if spec.checkpoint.enabled else 0, "PLAN_NODES": plan.nodes,
        "TOTAL_GPUS": plan.world_size if plan.use_gpus else 0, "RAY_CPUS": ray_cpus(spec), "RAY_GPUS": c.gpus_per_node,
        "OBJECT_STORE": int(c.object_store_memory_mb) * 2**20,
        "REQUEUE_CODE": ExitCode.REQUEUE, "USR1_KILLED": ExitCode.USR1_KILLED,  # exit_codes.py: the one list
        "HUNG_CODE": ExitCode.HUNG,
        "PORT_GCS": p["gcs"], "PORT_CLIENT": p["client"], "PORT_DASHBOARD": p["dashboard"],
        "PORT_NM": p["node_manager"], "PORT_OM": p["object_manager"], "PORT_RTE": p["runtime_env_agent"],
        "PORT_METRICS": p["metrics_export"], "PORT_DAG": p["dashboard_agent_grpc"],
        "PORT_DAH": p["dashboard_agent_http"], "PORT_MINW": p["min_worker"], "PORT_MAXW": p["max_worker"],
    }
    stride = int(c.node_port_stride)
    lines = [
        "#!/bin/bash",
        *sbatch_header(spec, plan),
        f"# grpo-launcher run {one_line(spec.name, 'run name')} — resolved spec: "
        f"{one_line(str(plan.run_dir / 'spec.yaml'), 'run dir')}",
        f"# Ray ports (node 0; node i adds i x {stride}): GCS {p['gcs']}, client {p['client']}, dashboard "
        f"{p['dashboard']},",
        f"# node manager {p['node_manager']}, object manager {p['object_manager']}, runtime env agent "
        f"{p['runtime_env_agent']}, metrics {p['metrics_export']},",
        f"# dashboard agent grpc/http {p['dashboard_agent_grpc']}/{p['dashboard_agent_http']}, workers "
        f"{p['min_worker']}-{p['max_worker']}; jobs sharing hosts take a free slot of "
        f"{JOB_PORT_SLOTS} x {int(c.job_port_stride)}.",
        f"RUN_DIR={q(str(plan.run_dir))}",
        f"PY={q(python_of(spec))}",
        f"RAY_TMP={q(c.ray_temp_dir)}",
        *(f"{k}={int(v)}" for k, v in ints.items()),
        f"CONTAINER=({' '.join(q(f) for f in container_flags(spec, plan))})",
        f"PASS_ENV=({' '.join(q(n) for n in env_names(c.env_passthrough))})",
        f"export {' '.join(f'{k}={q(v)}' for k, v in RUN_ENV.items())}",
        "",
    ]
    return "\n".join(lines) + BODY.read_text()


def script_path(plan: Plan) -> Path:
    return plan.run_dir / "job.sbatch"


# Environment every run gets (no secrets: values here are printed in the script).
RUN_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
