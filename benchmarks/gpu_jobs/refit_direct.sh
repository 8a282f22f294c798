#!/usr/bin/env bash
# The CUDA IPC refit's direct load (rollout/vllm_compat.py DIRECT_REFIT) on one GPU node, through launch.py:
#   bash benchmarks/gpu_jobs/refit_direct.sh [torch|megatron|async ...]   # default: all three
# Each run: a 0.2B Qwen2 warm-started (peaked: an engine left on dummy weights would sample far from it),
# rollout=vllm, 12 steps; prints per run the engine-vs-policy logprob gap (max over steps), the refit's median
# and its parts (time/refit_*_ms). Results: benchmarks/results/refit_paths.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$PWD/src VLLM_USE_FLASHINFER_SAMPLER=0
MODEL=(model.num_layers=10 model.hidden_size=1024 model.num_attention_heads=16 model.num_kv_heads=4
  model.ffn_hidden_size=2816 model.warm_start_steps=150)
RUN=(rollout=vllm cluster.gpus_per_node=1 train.precision=bfloat16 logging.mlflow=false grpo.max_steps=12
  grpo.val_period=0 grpo.val_at_end=false checkpoint.enabled=false rollout.sleep_mode=true)
declare -A MODE=([torch]="train.backend=torch" [megatron]="train.backend=megatron"
  [async]="train.backend=torch rollout.async_engine=true")
for m in "${@:-torch megatron async}"; do
  for name in $m; do
    read -ra extra <<< "${MODE[$name]}"
    rm -rf "/tmp/refit/$name"
    timeout 540 python3 launch.py output_root=/tmp/refit "name=$name" "${MODEL[@]}" "${RUN[@]}" "${extra[@]}" \
      > "$OUT/refit_$name.log" 2>&1
    echo "$name: exit $?"
    python3 - "/tmp/refit/$name/metrics.jsonl" <<'PY'
import json, statistics as st, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
med = lambda k: st.median(r[k] for r in rows[1:] if k in r) if any(k in r for r in rows[1:]) else float("nan")
gap = max(r["train/gen_vs_policy_logprob_absdiff"] for r in rows)
parts = ", ".join(f"{p} {med(f'time/refit_{p}_ms'):.1f}" for p in ("engine", "start", "pack", "load", "finish"))
print(f"  {len(rows)} steps; logprob gap max {gap:.4f}; refit median {med('time/refit_ms'):.1f} ms ({parts}); "
      f"reward {rows[0]['train/reward_mean']:.3f} -> {rows[-1]['train/reward_mean']:.3f}")
PY
  done
done
