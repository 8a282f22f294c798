"""Render the sbatch script for a run: Ray head on the first node, workers on the rest, then the driver.

Every config value that reaches the shell goes through `shlex.quote`; `#SBATCH` words are additionally
restricted by the `slurm_fields` rule. What the script does, in order:
  1. node list via `mapfile` (never `nodes=("$x")`), checked against SLURM_JOB_NUM_NODES;
  2. head IP from the head node itself (first IPv4 of `hostname -I`);
  3. `ray start --head --block` on node 0 and `ray start --address --block` on the others, each a
     background `srun` step with the fixed port block and a short temp dir;
  4. wait until every node (and every GPU) joined, or fail with the names of the missing nodes;
  5. the driver on the head (`srun --overlap`), reading the resolved spec saved in the run dir;
  6. fail fast: the first step to end ends the job; a node step dying names its node;
  7. SIGUSR1 before --time: forwarded to the driver, which checkpoints and exits 3 → requeue.
"""

from __future__ import annotations

import math
import shlex

from ..plan import Plan
from ..spec.schema import RunSpec

REQUEUE_EXIT_CODE = 3  # the driver's exit code for "checkpoint saved on signal, requeue me"

TEMPLATE = r"""#!/bin/bash
{sbatch_lines}
# Rendered by grpo-launcher for run {name_q}. Spec: {spec_path_q}
set -uo pipefail
ulimit -n 65535 2>/dev/null || true

RUN_DIR={run_dir_q}
PY={python_q}
RAY_TMP={temp_dir_q}
NODE_PORT_STRIDE={port_stride}
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONUNBUFFERED=1 {extra_env}
mkdir -p "$RUN_DIR/logs"
echo "$SLURM_JOB_ID" >> "$RUN_DIR/job_ids"
"$PY" -m grpo_launcher.launch.status "$RUN_DIR" RUNNING --job-id "$SLURM_JOB_ID"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#NODES[@]}}" -ne "$SLURM_JOB_NUM_NODES" ]; then
  echo "grpo-launcher: expected $SLURM_JOB_NUM_NODES nodes, got: ${{NODES[*]}}" >&2; exit 1
fi
HEAD=${{NODES[0]}}
HEAD_IP=$(srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" hostname -I | tr ' ' '\n' | grep -m1 -E '^[0-9]+\.')
RAY_ADDRESS="$HEAD_IP:{gcs_port}"
export RAY_ADDRESS
echo "grpo-launcher: ${{#NODES[@]}} node(s) [${{NODES[*]}}], Ray head $HEAD at $RAY_ADDRESS"

ray_ports() {{  # ray_ports NODE_INDEX: the fixed port block, shifted per node only where nodes share a host
  local s=$(( $1 * NODE_PORT_STRIDE ))
  echo --node-manager-port=$(( {node_manager_port} + s )) --object-manager-port=$(( {object_manager_port} + s )) \
    --runtime-env-agent-port=$(( {runtime_env_agent_port} + s )) --metrics-export-port=$(( {metrics_export_port} + s )) \
    --dashboard-agent-grpc-port=$(( {dashboard_agent_grpc_port} + s )) --dashboard-agent-listen-port=$(( {dashboard_agent_http_port} + s )) \
    --min-worker-port=$(( {min_worker_port} + s )) --max-worker-port=$(( {max_worker_port} + s ))
}}
declare -A STEP_NODE
for i in "${{!NODES[@]}}"; do
  node=${{NODES[$i]}}
  args=(--num-cpus={ray_cpus} --num-gpus={ray_gpus} --temp-dir="$RAY_TMP/$SLURM_JOB_ID-$i"
        --object-store-memory={object_store_bytes} --resources="{{\"grpo_node_$i\":1}}" --block $(ray_ports "$i"))
  if [ "$i" -eq 0 ]; then
    args+=(--head --node-ip-address="$HEAD_IP" --port={gcs_port} --ray-client-server-port={client_port}
           --dashboard-port={dashboard_port} --include-dashboard=false)
  else
    args+=(--address="$RAY_ADDRESS")
  fi
  srun --overlap --nodes=1 --ntasks=1 -w "$node" {container_flags} \
    --output="$RUN_DIR/logs/ray-$SLURM_JOB_ID-$node.log" ray start "${{args[@]}}" &
  STEP_NODE[$!]=$node
  [ "$i" -eq 0 ] && sleep 0.5  # let the head bind its GCS port before workers dial it (ray_wait checks)
done

if ! "$PY" -m grpo_launcher.launch.ray_wait --nodes {nodes} --gpus {total_gpus} --timeout {join_timeout}; then
  echo "grpo-launcher: Ray did not come up on all nodes; see $RUN_DIR/logs/ray-$SLURM_JOB_ID-*.log" >&2
  kill "${{!STEP_NODE[@]}}" 2>/dev/null; exit 1
fi

srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" {container_flags} \
  --output="$RUN_DIR/logs/driver-$SLURM_JOB_ID.log" "$PY" -u -m grpo_launcher.train.driver "$RUN_DIR/spec.yaml" &
DRIVER=$!
trap 'echo "grpo-launcher: SIGUSR1 (time limit near): asking the driver to checkpoint"; kill -USR1 $DRIVER' USR1

rc=0
while true; do
  wait -n -p ENDED "$DRIVER" "${{!STEP_NODE[@]}}"; rc=$?
  [ "$rc" -gt 128 ] && [ -z "${{ENDED:-}}" ] && continue  # a trapped signal interrupted wait: keep waiting
  break
done
if [ "${{ENDED:-}}" != "$DRIVER" ]; then
  echo "grpo-launcher: the Ray step on node ${{STEP_NODE[$ENDED]:-?}} died (exit $rc); stopping the job" >&2
  kill "$DRIVER" 2>/dev/null; rc=1
fi
kill "${{!STEP_NODE[@]}}" 2>/dev/null
wait
if [ "$rc" -eq {requeue_code} ]; then
  "$PY" -m grpo_launcher.launch.status "$RUN_DIR" REQUEUED --job-id "$SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
"$PY" -m grpo_launcher.launch.status "$RUN_DIR" $([ "$rc" -eq 0 ] && echo COMPLETED || echo FAILED) --job-id "$SLURM_JOB_ID" --exit-code "$rc"
exit "$rc"
"""


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
    return [f"#SBATCH {shlex.quote(line)}" for line in lines]


def ray_cpus(spec: RunSpec) -> int:
    c = spec.cluster
    return max(1, math.ceil(c.cpu_workers_per_node * c.cpus_per_worker)) if c.gpus_per_node == 0 else 8 * c.gpus_per_node


def container_flags(spec: RunSpec) -> str:
    c = spec.cluster
    if not c.container_image:
        return ""
    flags = [f"--container-image={c.container_image}", "--no-container-mount-home"]
    if c.container_mounts:
        flags.append(f"--container-mounts={','.join(c.container_mounts)}")
    if c.env_passthrough:
        flags.append(f"--container-env={','.join(c.env_passthrough)}")
    return " ".join(shlex.quote(f) for f in flags)


def render(spec: RunSpec, plan: Plan) -> str:
    p = plan.ports
    return TEMPLATE.format(
        sbatch_lines="\n".join(sbatch_header(spec, plan)),
        name_q=shlex.quote(spec.name),
        spec_path_q=shlex.quote(str(plan.run_dir / "spec.yaml")),
        run_dir_q=shlex.quote(str(plan.run_dir)),
        python_q=shlex.quote(spec.cluster.python),
        temp_dir_q=shlex.quote(spec.cluster.ray_temp_dir),
        port_stride=spec.cluster.node_port_stride,
        extra_env=" ".join(f"{k}={shlex.quote(v)}" for k, v in RUN_ENV.items()),
        gcs_port=p["gcs"],
        client_port=p["client"],
        dashboard_port=p["dashboard"],
        node_manager_port=p["node_manager"],
        object_manager_port=p["object_manager"],
        runtime_env_agent_port=p["runtime_env_agent"],
        metrics_export_port=p["metrics_export"],
        dashboard_agent_grpc_port=p["dashboard_agent_grpc"],
        dashboard_agent_http_port=p["dashboard_agent_http"],
        min_worker_port=p["min_worker"],
        max_worker_port=p["max_worker"],
        ray_cpus=ray_cpus(spec),
        ray_gpus=spec.cluster.gpus_per_node,
        object_store_bytes=spec.cluster.object_store_memory_mb * 2**20,
        nodes=plan.nodes,
        total_gpus=plan.world_size if plan.use_gpus else 0,
        join_timeout=spec.cluster.ray_join_timeout_s,
        container_flags=container_flags(spec),
        requeue_code=REQUEUE_EXIT_CODE,
    )


# Environment every run gets (no secrets: values here are printed in the script).
RUN_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
