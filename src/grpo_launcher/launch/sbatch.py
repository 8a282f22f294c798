"""Render the sbatch script for a run: Ray head on the first node, workers on the rest, then the driver.

Every config value that reaches the shell is `shlex.quote`d, and `#SBATCH` lines and comments refuse
line breaks (a newline would end the comment and start a command); the `slurm_fields` and
`shell_values` rules additionally reject such values before anything is rendered. What the script does:
  1. node list via `mapfile` (never `nodes=("$x")`), checked against SLURM_JOB_NUM_NODES; one `srun`
     over all nodes reports each node's host and IPv4 (nodes sharing a host need cluster.node_port_stride);
  2. `ray start --head --block` on node 0 (explicit --node-ip-address), wait until its GCS port answers;
     then `ray start --address --block` on the others — each a background `srun --overlap` step with the
     fixed port block (node i shifted by i × node_port_stride) and its own short temp dir;
     every node carries the custom resource `grpo_node_<i>`;
  3. `ray_wait` until every node (every GPU) joined — or fail naming the missing nodes; a node step
     that dies meanwhile ends the job at once, naming its node;
  4. the driver on the head (`srun --overlap -w HEAD`), reading the resolved spec saved in the run dir;
  5. fail fast: the first step to end ends the job; a node step dying names its node;
  6. after the driver: where every actor ran (`logs/placement-<job>.json`), then Ray is stopped;
  7. SIGUSR1 (`--signal=B:USR1@N` before --time, or `scancel --signal=USR1 --batch`): forwarded to the
     driver, which checkpoints at the end of its step and exits 3 → `scontrol requeue` → the next start
     resumes from that checkpoint (a driver killed by the signal before its handler was installed is
     requeued too: it resumes from its previous checkpoint). SIGTERM (scancel) → status CANCELLED.
Ray runs with token auth (a fresh token per start, in a 0600 file of the run dir); cluster.env_passthrough
names variables the job inherits from the submitting shell — names only, never values, in the script.
Status transitions go to `<run_dir>/status.json` (launch/status.py); `launch.py status|logs|cancel` read it.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

from ..plan import Plan
from ..spec.schema import RunSpec

REQUEUE_EXIT_CODE = 3  # the driver's exit code for "checkpoint saved on signal, requeue me"
PLACEHOLDER = re.compile(r"@([A-Z0-9_]+)@")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
USR1_KILLED = 128 + 10  # the driver died of SIGUSR1 before installing its handler: resume from the last checkpoint

TEMPLATE = r"""#!/bin/bash
@SBATCH_LINES@
# grpo-launcher run @NAME_C@ — resolved spec: @SPEC_C@
# Ray ports (node 0; node i adds i x @STRIDE@): GCS @GCS@, client @CLIENT@, dashboard @DASHBOARD@,
# node manager @NM@, object manager @OM@, runtime env agent @RTE@, metrics @METRICS@,
# dashboard agent grpc/http @DAG@/@DAH@, workers @MINW@-@MAXW@.
set -uo pipefail
ulimit -n 65535 2>/dev/null || true

RUN_DIR=@RUN_DIR_Q@
PY=@PY_Q@
RAY_TMP=@RAY_TMP_Q@
NODE_PORT_STRIDE=@STRIDE@
JOIN_TIMEOUT=@JOIN_TIMEOUT@
REQUEUE_ENABLED=@REQUEUE_ENABLED@
CONTAINER=(@CONTAINER_FLAGS@)
PASS_ENV=(@PASS_ENV@)
# no 30 s node drain on SIGTERM (Ray >= 2.5x drains for Serve): the job stops Ray only when it is done with it
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 PYTHONUNBUFFERED=1 @EXTRA_ENV@
unset RAY_ADDRESS
LOG="$RUN_DIR/logs"
mkdir -p "$LOG"
echo "$SLURM_JOB_ID" >> "$RUN_DIR/job_ids"
# Ray token auth, one fresh token per start in a file only the owner reads: every node, helper and the
# driver find it through RAY_AUTH_TOKEN_PATH (the token itself is never printed)
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RUN_DIR/.ray_auth_token"
( umask 077; head -c 32 /dev/urandom | od -An -vtx1 | tr -d ' \n' > "$RAY_AUTH_TOKEN_PATH" )

say() { echo "grpo-launcher [$(date +%H:%M:%S)] $*"; }
# python helpers (status, ray_wait) run on the batch host, or in the container on it
if [ "${#CONTAINER[@]}" -gt 0 ]; then
  HELPER=(srun --overlap --nodes=1 --ntasks=1 -w "$SLURMD_NODENAME" "${CONTAINER[@]}" "$PY")
else
  HELPER=("$PY")
fi
status() { "${HELPER[@]}" -m grpo_launcher.launch.status "$RUN_DIR" "$@" --job-id "$SLURM_JOB_ID" || true; }

declare -A STEP_NODE=()   # srun pid of each node's Ray step -> node name
DRIVER=""
USR1_AT=""
REQUEUING=0
step_id() {  # step_id NAME: "<job>.<step>" of this job's step called NAME
  squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null | awk -v n="$1" '$2 == n {print $1; exit}'
}
stop_all() {  # stop the driver and Ray on every node; bounded (Slurm kills what is left when the script ends)
  local pids=("${!STEP_NODE[@]}") deadline=$((SECONDS + 20)) p alive step
  for p in "${pids[@]}"; do  # SIGTERM to `ray start --block` itself: it stops its node's Ray cleanly
    step=$(step_id "grpo-ray-${STEP_NODE[$p]}")
    if [ -n "$step" ]; then scancel --signal=TERM "$step" 2>/dev/null; else kill -TERM "$p" 2>/dev/null; fi
  done
  [ -n "$DRIVER" ] && { kill -TERM "$DRIVER" 2>/dev/null; pids+=("$DRIVER"); }
  [ "${#pids[@]}" -gt 0 ] || return 0
  while [ $SECONDS -lt $deadline ]; do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && return 0
    sleep 0.2
  done
  kill -TERM "${pids[@]}" 2>/dev/null  # srun: forced termination of what did not stop
}
fail() {  # fail EXIT_CODE MESSAGE
  echo "grpo-launcher [$(date +%H:%M:%S)] ERROR: $2" >&2
  trap - TERM USR1
  status FAILED --exit-code "$1" --message "$2"
  stop_all
  exit "$1"
}
requeue() {
  REQUEUING=1
  trap - TERM USR1
  if [ "$REQUEUE_ENABLED" -ne 1 ]; then
    status STOPPED --exit-code 0 --message "checkpoint saved; cluster.requeue=false: resubmit the same run to resume"
    say "checkpoint saved; not requeued (cluster.requeue=false): resubmit the same run to resume"
    stop_all; exit 0
  fi
  status REQUEUED --message "$1"
  say "$1; requeueing job $SLURM_JOB_ID (scontrol requeue)"
  stop_all
  scontrol requeue "$SLURM_JOB_ID" || fail 1 "scontrol requeue $SLURM_JOB_ID failed: resubmit the same run to resume"
  exit 0
}
on_usr1() {
  USR1_AT=$(date +%s)
  if [ -n "$DRIVER" ]; then
    say "SIGUSR1 (time limit near, or preemption): the driver checkpoints after its current step and exits"
    kill -USR1 "$DRIVER" 2>/dev/null
  else
    requeue "SIGUSR1 before the driver started (nothing to save)"
  fi
}
on_term() {
  [ "$REQUEUING" -eq 1 ] && return
  trap - TERM USR1
  say "SIGTERM: job cancelled (or preempted); stopping"
  status CANCELLED --exit-code 143 --message "SIGTERM (scancel or preemption)"
  stop_all
  exit 143
}
trap on_usr1 USR1
trap on_term TERM

wait_first() {  # wait_first PID: until PID or any node step ends; sets ENDED and RC
  while true; do
    unset ENDED
    wait -n -p ENDED "$1" "${!STEP_NODE[@]}"; RC=$?
    [ -z "${ENDED:-}" ] && [ "$RC" -gt 128 ] && continue  # a trapped signal interrupted wait
    return 0
  done
}
job_state() { scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*JobState=\([^ ]*\).*/\1/p'; }
node_died() {  # node_died PID RC: a node's Ray step ended while the job needs it
  local node=${STEP_NODE[$1]}
  unset "STEP_NODE[$1]"
  [ "$(job_state)" = CANCELLED ] && on_term  # scancel reached the steps before this shell's SIGTERM trap
  echo "----- last lines of $LOG/ray-$SLURM_JOB_ID-$node.log" >&2
  tail -n 15 "$LOG/ray-$SLURM_JOB_ID-$node.log" >&2 2>/dev/null
  fail 1 "the Ray step on node $node ended (exit $2); stopping the job (node log: $LOG/ray-$SLURM_JOB_ID-$node.log)"
}
dead_nodes() {  # names of nodes whose Ray step is no longer running
  local p out=()
  for p in "${!STEP_NODE[@]}"; do kill -0 "$p" 2>/dev/null || out+=("${STEP_NODE[$p]}"); done
  echo "${out[*]}"
}

status RUNNING --restarts "${SLURM_RESTART_COUNT:-0}" --event started
say "job $SLURM_JOB_ID start #${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST; python $PY"
for v in "${PASS_ENV[@]}"; do  # names only: values never reach the script or the logs
  [ -n "${!v+x}" ] || say "WARNING: environment variable $v (cluster.env_passthrough) is not set"
done

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${#NODES[@]}" -ne "$SLURM_JOB_NUM_NODES" ]; then
  fail 1 "expected $SLURM_JOB_NUM_NODES nodes, got ${#NODES[@]}: ${NODES[*]}"
fi
HEAD=${NODES[0]}
# one line per node: "<slurm node> <host> <addresses>"; the head's first IPv4 becomes the GCS address
mapfile -t NODE_INFO < <(srun --overlap --nodes="${#NODES[@]}" --ntasks-per-node=1 \
  bash -c 'echo "$SLURMD_NODENAME $(hostname) $(hostname -I 2>/dev/null)"' 2>/dev/null)
HEAD_IP=""; declare -A HOST_OF=()
for line in "${NODE_INFO[@]}"; do
  read -r n h addrs <<<"$line"
  HOST_OF[$n]=$h
  if [ "$n" = "$HEAD" ]; then
    for a in $addrs; do [[ $a =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] && { HEAD_IP=$a; break; }; done
  fi
done
[ -n "$HEAD_IP" ] || fail 1 "no IPv4 address found for the head node $HEAD (srun said: ${NODE_INFO[*]:-nothing})"
if [ "$NODE_PORT_STRIDE" -eq 0 ] && [ "${#NODES[@]}" -gt 1 ]; then
  hosts=$(printf '%s\n' "${HOST_OF[@]}" | sort | uniq -d)
  [ -z "$hosts" ] || fail 2 "nodes share a host ($hosts): their Ray ports would collide; set cluster.node_port_stride (e.g. 1000)"
fi
# jobs sharing hosts (cluster.job_port_stride > 0) shift their whole port block by job id
JOB_SHIFT=$(( (SLURM_JOB_ID % @JOB_SLOTS@) * @JOB_STRIDE@ ))
GCS_PORT=$(( @GCS@ + JOB_SHIFT ))
GCS_ADDRESS="$HEAD_IP:$GCS_PORT"
say "${#NODES[@]} node(s) [${NODES[*]}]; Ray head on $HEAD at $GCS_ADDRESS"

start_ray_node() {  # start_ray_node INDEX
  local i=$1 node=${NODES[$1]} s=$(( JOB_SHIFT + $1 * NODE_PORT_STRIDE ))
  local args=(start --block --num-cpus=@RAY_CPUS@ --num-gpus=@RAY_GPUS@ --object-store-memory=@OBJECT_STORE@
    --temp-dir="$RAY_TMP/$SLURM_JOB_ID-$i" --resources="{\"grpo_node_$i\": 1}"
    --node-manager-port=$(( @NM@ + s )) --object-manager-port=$(( @OM@ + s ))
    --runtime-env-agent-port=$(( @RTE@ + s )) --metrics-export-port=$(( @METRICS@ + s ))
    --dashboard-agent-grpc-port=$(( @DAG@ + s )) --dashboard-agent-listen-port=$(( @DAH@ + s ))
    --min-worker-port=$(( @MINW@ + s )) --max-worker-port=$(( @MAXW@ + s )))
  if [ "$i" -eq 0 ]; then
    args+=(--head --node-ip-address="$HEAD_IP" --port="$GCS_PORT" --ray-client-server-port=$(( @CLIENT@ + s ))
           --dashboard-port=$(( @DASHBOARD@ + s )) --include-dashboard=false)
  else
    args+=(--address="$GCS_ADDRESS")
  fi
  srun --overlap --nodes=1 --ntasks=1 -w "$node" --job-name="grpo-ray-$node" "${CONTAINER[@]}" --open-mode=append \
    --output="$LOG/ray-$SLURM_JOB_ID-$node.log" "$PY" -m ray.scripts.scripts "${args[@]}" &
  STEP_NODE[$!]=$node
}

start_ray_node 0
deadline=$((SECONDS + JOIN_TIMEOUT))
until (exec 3<>"/dev/tcp/$HEAD_IP/$GCS_PORT") 2>/dev/null; do  # the head's GCS answers: workers may dial it
  for p in "${!STEP_NODE[@]}"; do kill -0 "$p" 2>/dev/null || { wait "$p"; node_died "$p" $?; }; done
  [ $SECONDS -lt $deadline ] || fail 1 "the Ray head on $HEAD did not open port $GCS_PORT within ${JOIN_TIMEOUT}s; see $LOG/ray-$SLURM_JOB_ID-$HEAD.log"
  sleep 0.2
done
for (( i = 1; i < ${#NODES[@]}; i++ )); do start_ray_node "$i"; done
export RAY_ADDRESS="$GCS_ADDRESS"  # for ray_wait and the driver (workers.ray_session joins it)

"${HELPER[@]}" -m grpo_launcher.launch.ray_wait --nodes @NODES@ --gpus @TOTAL_GPUS@ --timeout "$JOIN_TIMEOUT" \
  --node-names "${NODES[@]}" &
WAITER=$!
wait_first "$WAITER"
[ "$ENDED" = "$WAITER" ] || node_died "$ENDED" "$RC"
[ "$RC" -eq 0 ] || fail 1 "Ray did not come up on all nodes; see $LOG/ray-$SLURM_JOB_ID-*.log"
status RUNNING --event ray_ready
[ -n "$USR1_AT" ] && requeue "SIGUSR1 during Ray start-up (nothing to save)"

srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" --job-name=grpo-driver "${CONTAINER[@]}" --open-mode=append \
  --output="$LOG/driver-$SLURM_JOB_ID.log" "$PY" -u -m grpo_launcher.train.driver "$RUN_DIR/spec.yaml" &
DRIVER=$!
say "driver started on $HEAD (log: $LOG/driver-$SLURM_JOB_ID.log)"
wait_first "$DRIVER"
if [ "$ENDED" != "$DRIVER" ]; then
  node_died "$ENDED" "$RC"
fi
rc=$RC; DRIVER=""
[ "$rc" -ne 0 ] && [ "$(job_state)" = CANCELLED ] && on_term
dead=$(dead_nodes)
[ -z "$dead" ] || fail 1 "the driver ended (exit $rc) and the Ray step on node(s) $dead is gone; stopping the job"
say "driver exited $rc"
timeout 120 "${HELPER[@]}" -m grpo_launcher.launch.ray_wait --placement "$LOG/placement-$SLURM_JOB_ID.json" \
  --node-names "${NODES[@]}" || say "WARNING: could not record where the actors ran"
if [ "$rc" -eq @REQUEUE_CODE@ ] || { [ -n "$USR1_AT" ] && [ "$rc" -eq @USR1_KILLED@ ]; }; then
  requeue "checkpoint saved on signal (driver exit $rc)"
fi
trap - TERM USR1
stop_all
if [ "$rc" -eq 0 ]; then
  status COMPLETED --exit-code 0
  rm -rf "$RAY_TMP/$SLURM_JOB_ID-"*  # Ray's session dirs of this job (kept when it fails)
  say "run completed"
else
  status FAILED --exit-code "$rc" --message "the driver exited $rc (log: $LOG/driver-$SLURM_JOB_ID.log)"
  say "ERROR: the driver exited $rc; see $LOG/driver-$SLURM_JOB_ID.log"
fi
exit "$rc"
"""


def one_line(text: str, what: str) -> str:
    """Refuse line breaks in anything placed on an `#SBATCH` line or in a comment."""
    if any(ch in text for ch in "\n\r\0"):
        raise ValueError(f"{what}: line breaks are not allowed in {text!r}")
    return text


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
        f"--output={plan.run_dir}/logs/slurm-%j.out",
        "--open-mode=append",
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


JOB_PORT_SLOTS = 16  # with cluster.job_port_stride > 0, job J uses port block (J % 16)


def render(spec: RunSpec, plan: Plan) -> str:
    c, p = spec.cluster, plan.ports
    q = shlex.quote
    values = {
        "SBATCH_LINES": "\n".join(sbatch_header(spec, plan)),
        "NAME_C": one_line(spec.name, "run name"),
        "SPEC_C": one_line(str(plan.run_dir / "spec.yaml"), "run dir"),
        "RUN_DIR_Q": q(str(plan.run_dir)),
        "PY_Q": q(python_of(spec)),
        "RAY_TMP_Q": q(c.ray_temp_dir),
        "STRIDE": str(int(c.node_port_stride)),
        "JOB_STRIDE": str(int(c.job_port_stride)),
        "JOB_SLOTS": str(JOB_PORT_SLOTS),
        "JOIN_TIMEOUT": str(int(c.ray_join_timeout_s)),
        "REQUEUE_ENABLED": "1" if c.requeue else "0",
        "CONTAINER_FLAGS": " ".join(q(f) for f in container_flags(spec, plan)),
        "PASS_ENV": " ".join(q(n) for n in env_names(c.env_passthrough)),
        "EXTRA_ENV": " ".join(f"{k}={q(v)}" for k, v in RUN_ENV.items()),
        "GCS": p["gcs"], "CLIENT": p["client"], "DASHBOARD": p["dashboard"],
        "NM": p["node_manager"], "OM": p["object_manager"], "RTE": p["runtime_env_agent"],
        "METRICS": p["metrics_export"], "DAG": p["dashboard_agent_grpc"], "DAH": p["dashboard_agent_http"],
        "MINW": p["min_worker"], "MAXW": p["max_worker"],
        "RAY_CPUS": ray_cpus(spec),
        "RAY_GPUS": int(c.gpus_per_node),
        "OBJECT_STORE": int(c.object_store_memory_mb) * 2**20,
        "NODES": int(plan.nodes),
        "TOTAL_GPUS": plan.world_size if plan.use_gpus else 0,
        "REQUEUE_CODE": REQUEUE_EXIT_CODE,
        "USR1_KILLED": USR1_KILLED,
    }
    # one pass: text inserted from a value is never scanned for placeholders again
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), TEMPLATE)


def script_path(plan: Plan) -> Path:
    return plan.run_dir / "job.sbatch"


# Environment every run gets (no secrets: values here are printed in the script).
RUN_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
