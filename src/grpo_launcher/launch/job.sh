# shellcheck shell=bash
# The body of every grpo-launcher sbatch script (launch/sbatch.py prepends the #SBATCH header and the
# values block: RUN_DIR PY RAY_TMP NODE_PORT_STRIDE JOB_PORT_STRIDE JOB_PORT_SLOTS JOIN_TIMEOUT REQUEUE_ENABLED
# CHECKPOINTS CONTAINER PASS_ENV PLAN_NODES TOTAL_GPUS RAY_CPUS RAY_GPUS OBJECT_STORE PORT_* REQUEUE_CODE USR1_KILLED HUNG_CODE;
# the exit codes are exit_codes.ExitCode's).
# Static text: `shellcheck -x src/grpo_launcher/launch/job.sh` reads it as it is; no value is ever pasted in.
# shellcheck disable=SC2154,SC2317  # the values block defines the settings; functions run from traps
set -uo pipefail
ulimit -n 65535 2>/dev/null || true

# sbatch --export passed only what the job needs; the steps inherit THIS script's environment
export SLURM_EXPORT_ENV=ALL
# no 30 s node drain on SIGTERM (Ray >= 2.5x drains for Serve); no Prometheus metrics listener (it binds
# every interface, without auth): the run's metrics go to MLflow
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 PYTHONUNBUFFERED=1
export RAY_enable_metrics_collection=0
unset RAY_ADDRESS
umask 077  # run files (logs, status, token) readable by the owner only
LOG="$RUN_DIR/logs"
LOG_PAT="${LOG//%/%%}"  # srun --output expands %-patterns: a literal % in the path is written %%
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
SLOT_DIR=""
step_id() {  # step_id NAME: "<job>.<step>" of this job's step called NAME
  squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null | awk -v n="$1" '$2 == n {print $1; exit}'
}
wait_gone() {  # wait_gone SECONDS PID...: until none of the PIDs runs (condition polled), at most SECONDS
  local deadline=$((SECONDS + $1)) p alive; shift
  while [ $SECONDS -lt $deadline ]; do
    alive=0; for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && return 0
    sleep 0.2
  done
  return 1
}
stop_gym() {  # env=nemo_gym: the driver runs NeMo Gym's servers on the head node and stops them by PID; should
  # it not have (killed, hung), Gym's own process group (`gym env start`, its servers, its Ray) is stopped here
  # by the PID it recorded ("PID HOST" in RUN_DIR/gym/gym.pid), on that host only, after checking it is Gym's
  local f="$RUN_DIR/gym/gym.pid" pid host
  [ -f "$f" ] || return 0
  read -r pid host < "$f" 2>/dev/null
  [[ ${pid:-} =~ ^[0-9]+$ ]] || return 0
  if [ "${host:-}" = "$(hostname)" ] && kill -0 "$pid" 2>/dev/null \
     && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q 'gym env start'; then
    say "stopping NeMo Gym (pid $pid), which the driver left running"
    kill -TERM -- "-$pid" 2>/dev/null
    wait_gone 30 "$pid" || kill -KILL -- "-$pid" 2>/dev/null
    rm -f "$f"
  fi
}
stop_all() {  # the driver first (it checkpoints at the end of its step while Ray still runs), then Ray on every node
  local pids=("${!STEP_NODE[@]}") p step
  if [ -n "$DRIVER" ]; then
    kill -TERM "$DRIVER" 2>/dev/null
    wait_gone 60 "$DRIVER" || say "WARNING: the driver did not stop within 60 s"
  fi
  stop_gym
  for p in "${pids[@]}"; do  # SIGTERM to `ray start --block` itself: it stops its node's Ray cleanly
    step=$(step_id "grpo-ray-${STEP_NODE[$p]}")
    if [ -n "$step" ]; then scancel --signal=TERM "$step" 2>/dev/null; else kill -TERM "$p" 2>/dev/null; fi
  done
  [ "${#pids[@]}" -gt 0 ] || return 0
  wait_gone 20 "${pids[@]}" || kill -TERM "${pids[@]}" 2>/dev/null  # srun: forced termination of what did not stop
}
release_slot() { [ -n "$SLOT_DIR" ] && rm -rf "$SLOT_DIR"; SLOT_DIR=""; }
trap release_slot EXIT
fail() {  # fail EXIT_CODE MESSAGE
  echo "grpo-launcher [$(date +%H:%M:%S)] ERROR: $2" >&2
  trap - TERM USR1
  status FAILED --exit-code "$1" --message "$2"
  stop_all
  exit "$1"
}
SAVED="checkpoint saved"  # checkpoint.enabled=false: nothing is written, a resubmission starts again at step 0
[ "$CHECKPOINTS" -eq 1 ] || SAVED="no checkpoint (checkpoint.enabled=false): it starts again at step 0"
requeue() {
  REQUEUING=1
  trap - TERM USR1
  if [ "$REQUEUE_ENABLED" -ne 1 ]; then
    status STOPPED --exit-code 0 --message "$SAVED; cluster.requeue=false: resubmit the same run to resume"
    say "$SAVED; not requeued (cluster.requeue=false): resubmit the same run to resume"
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
job_state() { scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*JobState=\([^ ]*\).*/\1/p'; }
job_fate() {  # what Slurm is doing to this job: "requeued", "cancelled", or its JobState
  local info st restarts
  info=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null)
  st=$(sed -n 's/.*JobState=\([^ ]*\).*/\1/p' <<<"$info")
  restarts=$(sed -n 's/.*Restarts=\([0-9]*\).*/\1/p' <<<"$info")
  # a requeue (scontrol requeue, preemption, node failure) counts the next start before this one has ended
  if [ "${restarts:-0}" -gt "${SLURM_RESTART_COUNT:-0}" ]; then echo requeued; return; fi
  case "$st" in
    PENDING|REQUEUED|REQUEUE_FED|REQUEUE_HOLD|PREEMPTED) echo requeued;;
    CANCELLED) echo cancelled;;
    *) echo "$st";;
  esac
}
on_term() {  # scancel, scontrol requeue, preemption, or `scancel --batch --signal=TERM` (this script only)
  [ "$REQUEUING" -eq 1 ] && return
  trap - TERM USR1
  local st
  st=$(job_fate)
  if [ "$st" = requeued ]; then
    say "SIGTERM: Slurm requeues the job; stopping (the next start resumes from the newest valid checkpoint)"
    status REQUEUED --exit-code 143 --message "SIGTERM: requeued by Slurm (scontrol requeue, preemption or node failure)"
    stop_all
    exit 143
  fi
  say "SIGTERM: job cancelled; stopping"
  status CANCELLED --exit-code 143 --message "SIGTERM (scancel; Slurm: ${st:-unknown})"
  stop_all
  # a SIGTERM sent to this script alone (scancel --batch --signal=TERM): the driver has saved; end the job
  # as cancelled in Slurm too, so that Slurm and status.json agree
  [ "$st" = cancelled ] || scancel "$SLURM_JOB_ID" 2>/dev/null
  exit 143
}
trap on_usr1 USR1
trap on_term TERM

# Waiting without races: no `wait -n` over a pid list (a pid bash has already reaped makes it fail at once
# with "no such job"): the condition "this pid no longer runs" is polled, then `wait PID` collects the status
# bash saved for it. A trapped signal interrupts the interruptible `wait` on the short sleep at once.
ended() {  # ended PID: the pid no longer runs; sets RC to its exit status
  kill -0 "$1" 2>/dev/null && return 1
  wait "$1" 2>/dev/null; RC=$?
  return 0
}
nap() { sleep 0.25 & wait $! 2>/dev/null; }
wait_first() {  # wait_first PID: until PID or any node step ends; sets ENDED and RC
  local p
  while true; do
    if ended "$1"; then ENDED=$1; return 0; fi
    for p in "${!STEP_NODE[@]}"; do
      if ended "$p"; then ENDED=$p; return 0; fi
    done
    nap
  done
}
node_died() {  # node_died PID RC: a node's Ray step ended while the job needs it
  local node=${STEP_NODE[$1]:-?}
  unset "STEP_NODE[$1]"
  case "$(job_fate)" in requeued|cancelled) on_term;; esac  # Slurm's signal reached the step first
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
# shellcheck disable=SC2016  # expanded on each node, not here
mapfile -t NODE_INFO < <(srun --overlap --nodes="${#NODES[@]}" --ntasks-per-node=1 \
  bash -c 'echo "$SLURMD_NODENAME $(hostname) $(hostname -I 2>/dev/null)"' 2>/dev/null)
HEAD_IP=""; declare -A HOST_OF=() IP_OF=()
for line in "${NODE_INFO[@]}"; do
  read -r n h addrs <<<"$line"
  HOST_OF[$n]=$h
  for a in $addrs; do [[ $a =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] && { IP_OF[$n]=$a; break; }; done
done
HEAD_IP=${IP_OF[$HEAD]:-}
[ -n "$HEAD_IP" ] || fail 1 "no IPv4 address found for the head node $HEAD (srun said: ${NODE_INFO[*]:-nothing})"
if [ "$NODE_PORT_STRIDE" -eq 0 ] && [ "${#NODES[@]}" -gt 1 ]; then
  hosts=$(printf '%s\n' "${HOST_OF[@]}" | sort | uniq -d)
  [ -z "$hosts" ] || fail 2 "nodes share a host ($hosts): their Ray ports would collide; set cluster.node_port_stride (e.g. 1000)"
fi

# Jobs sharing hosts (cluster.job_port_stride > 0) each take a port slot: claimed atomically (mkdir under
# flock, recorded with the job id) in $RAY_TMP/port-slots on this host, stale claims (job no longer running)
# reclaimed, and every port of the slot's block probed on every node; the first free slot from
# (job id % slots) on is taken, so two jobs never share a block, whatever their ids.
block_busy() {  # block_busy SHIFT: "node:port" of the first port of this job's block that answers, if any
  local i n ip s port
  for (( i = 0; i < ${#NODES[@]}; i++ )); do
    n=${NODES[$i]}; ip=${IP_OF[$n]:-127.0.0.1}; s=$(( $1 + i * NODE_PORT_STRIDE ))
    for port in $(( PORT_GCS + s )) $(( PORT_CLIENT + s )) $(( PORT_DASHBOARD + s )) $(( PORT_NM + s )) \
                $(( PORT_OM + s )) $(( PORT_RTE + s )) $(( PORT_METRICS + s )) $(( PORT_DAG + s )) \
                $(( PORT_DAH + s )) $(seq $(( PORT_MINW + s )) $(( PORT_MAXW + s ))); do
      if (exec 3<>"/dev/tcp/$ip/$port") 2>/dev/null; then echo "$n:$port"; return 0; fi
    done
  done
  return 1
}
claim_slot() {  # sets JOB_SHIFT; 0 without a job stride
  JOB_SHIFT=0
  [ "$JOB_PORT_STRIDE" -gt 0 ] || return 0
  local root="$RAY_TMP/port-slots" k slot dir owner busy
  mkdir -p "$root" || fail 1 "cannot create $root for the Ray port slots"
  exec 9>"$root/.lock"
  flock -w 120 9 || fail 1 "could not lock $root/.lock within 120 s"
  for (( k = 0; k < JOB_PORT_SLOTS; k++ )); do
    slot=$(( (SLURM_JOB_ID + k) % JOB_PORT_SLOTS )); dir="$root/slot-$slot"
    if [ -d "$dir" ]; then
      owner=$(cat "$dir/job" 2>/dev/null)
      if [ "$owner" != "$SLURM_JOB_ID" ] && [ -n "$(squeue -h -j "$owner" -t R,CG,CF,S -o %i 2>/dev/null)" ]; then
        continue  # a running job holds it
      fi
      rm -rf "$dir"  # stale (its job ended without releasing it), or ours from before a requeue
    fi
    if busy=$(block_busy $(( slot * JOB_PORT_STRIDE ))); then
      say "port slot $slot: $busy is in use by something else; trying the next slot"
      continue
    fi
    mkdir "$dir" && echo "$SLURM_JOB_ID" > "$dir/job" && SLOT_DIR=$dir
    JOB_SHIFT=$(( slot * JOB_PORT_STRIDE ))
    flock -u 9; exec 9>&-
    say "Ray port slot $slot (ports shifted by $JOB_SHIFT)"
    return 0
  done
  flock -u 9; exec 9>&-
  fail 1 "no free Ray port slot among $JOB_PORT_SLOTS on ${NODES[*]} (see $root)"
}
claim_slot
GCS_PORT=$(( PORT_GCS + JOB_SHIFT ))
GCS_ADDRESS="$HEAD_IP:$GCS_PORT"
say "${#NODES[@]} node(s) [${NODES[*]}]; Ray head on $HEAD at $GCS_ADDRESS"

start_ray_node() {  # start_ray_node INDEX
  local i=$1 node=${NODES[$1]} s=$(( JOB_SHIFT + $1 * NODE_PORT_STRIDE ))
  local args=(start --block --num-cpus="$RAY_CPUS" --num-gpus="$RAY_GPUS" --object-store-memory="$OBJECT_STORE"
    --temp-dir="$RAY_TMP/$SLURM_JOB_ID-$i" --resources="{\"grpo_node_$i\": 1}"
    --node-manager-port=$(( PORT_NM + s )) --object-manager-port=$(( PORT_OM + s ))
    --runtime-env-agent-port=$(( PORT_RTE + s )) --metrics-export-port=$(( PORT_METRICS + s ))
    --dashboard-agent-grpc-port=$(( PORT_DAG + s )) --dashboard-agent-listen-port=$(( PORT_DAH + s ))
    --min-worker-port=$(( PORT_MINW + s )) --max-worker-port=$(( PORT_MAXW + s )))
  if [ "$i" -eq 0 ]; then
    args+=(--head --node-ip-address="$HEAD_IP" --port="$GCS_PORT" --ray-client-server-port=$(( PORT_CLIENT + s ))
           --dashboard-port=$(( PORT_DASHBOARD + s )) --include-dashboard=false)
  else
    args+=(--address="$GCS_ADDRESS")
  fi
  srun --overlap --nodes=1 --ntasks=1 -w "$node" --job-name="grpo-ray-$node" "${CONTAINER[@]}" --open-mode=append \
    --output="$LOG_PAT/ray-$SLURM_JOB_ID-$node.log" "$PY" -m ray.scripts.scripts "${args[@]}" &
  STEP_NODE[$!]=$node
}

start_ray_node 0
deadline=$((SECONDS + JOIN_TIMEOUT))
until (exec 3<>"/dev/tcp/$HEAD_IP/$GCS_PORT") 2>/dev/null; do  # the head's GCS answers: workers may dial it
  for p in "${!STEP_NODE[@]}"; do ended "$p" && node_died "$p" "$RC"; done
  [ $SECONDS -lt $deadline ] || fail 1 "the Ray head on $HEAD did not open port $GCS_PORT within ${JOIN_TIMEOUT}s; see $LOG/ray-$SLURM_JOB_ID-$HEAD.log"
  nap
done
for (( i = 1; i < ${#NODES[@]}; i++ )); do start_ray_node "$i"; done
export RAY_ADDRESS="$GCS_ADDRESS"  # for ray_wait and the driver (workers.ray_session joins it)

"${HELPER[@]}" -m grpo_launcher.launch.ray_wait --nodes "$PLAN_NODES" --gpus "$TOTAL_GPUS" --timeout "$JOIN_TIMEOUT" \
  --node-names "${NODES[@]}" &
WAITER=$!
wait_first "$WAITER"
[ "$ENDED" = "$WAITER" ] || node_died "$ENDED" "$RC"
[ "$RC" -eq 0 ] || fail 1 "Ray did not come up on all nodes; see $LOG/ray-$SLURM_JOB_ID-*.log"
status RUNNING --event ray_ready
[ -n "$USR1_AT" ] && requeue "SIGUSR1 during Ray start-up (nothing to save)"

srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" --job-name=grpo-driver "${CONTAINER[@]}" --open-mode=append \
  --output="$LOG_PAT/driver-$SLURM_JOB_ID.log" "$PY" -u -m grpo_launcher.train.driver "$RUN_DIR/spec.yaml" &
DRIVER=$!
say "driver started on $HEAD (log: $LOG/driver-$SLURM_JOB_ID.log)"
wait_first "$DRIVER"
if [ "$ENDED" != "$DRIVER" ]; then
  node_died "$ENDED" "$RC"
fi
rc=$RC; DRIVER=""
if [ "$rc" -ne 0 ]; then
  case "$(job_fate)" in requeued|cancelled) on_term;; esac
fi
dead=$(dead_nodes)
[ -z "$dead" ] || fail 1 "the driver ended (exit $rc) and the Ray step on node(s) $dead is gone; stopping the job"
say "driver exited $rc"
timeout 120 "${HELPER[@]}" -m grpo_launcher.launch.ray_wait --placement "$LOG/placement-$SLURM_JOB_ID.json" \
  --node-names "${NODES[@]}" || say "WARNING: could not record where the actors ran"
if [ "$rc" -eq "$REQUEUE_CODE" ] || { [ -n "$USR1_AT" ] && [ "$rc" -eq "$USR1_KILLED" ]; }; then
  requeue "$SAVED on signal (driver exit $rc)"
fi
trap - TERM USR1
stop_all
if [ "$rc" -eq 0 ]; then
  status COMPLETED --exit-code 0
  rm -rf "$RAY_TMP/$SLURM_JOB_ID-"*  # Ray's session dirs of this job (kept when it fails)
  say "run completed"
elif [ "$rc" -eq "$HUNG_CODE" ]; then  # a driver wait passed its deadline: failed as a node failure is (no requeue)
  status HUNG --exit-code "$rc"  # the message: the driver's summary (RUN_DIR/phase.json, read by launch/status.py)
  say "ERROR: the driver's wait passed its deadline (exit $rc: hung); see $LOG/driver-$SLURM_JOB_ID.log"
else
  status FAILED --exit-code "$rc" --message "the driver exited $rc (log: $LOG/driver-$SLURM_JOB_ID.log)"
  say "ERROR: the driver exited $rc; see $LOG/driver-$SLURM_JOB_ID.log"
fi
exit "$rc"
