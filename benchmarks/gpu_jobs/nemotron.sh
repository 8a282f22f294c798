#!/usr/bin/env bash
# The issue-40 measurements on one GPU node, as run there (benchmarks/results/nemotron_gpu.md):
#   bash benchmarks/gpu_jobs/nemotron.sh install PARTS_DIR     # the GPU kit (scripts/gpu-kit.sh) into /tmp/site
#   bash benchmarks/gpu_jobs/nemotron.sh STEP [STEP ...]       # steps: dry conv kernels pack block gate hf1b mhf1b vllm1b mvllm1b tiny mtiny recipe mrecipe mega mem
#   bash benchmarks/gpu_jobs/nemotron.sh bg STEP [STEP ...]    # the same, detached (setsid): outlives the call
#   bash benchmarks/gpu_jobs/nemotron.sh wait [SECONDS]        # until the detached steps end: their files to $OUT (one .tgz)
#   bash benchmarks/gpu_jobs/nemotron.sh stop                  # end the detached steps now (and Ray); `bg` the rest
# Each run step writes the run's metrics summary and nvidia-smi's whole-GPU peak to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
# each Triton autotune in the log (kernel, key, seconds): the first update's cost, by kernel
export TRITON_PRINT_AUTOTUNING=${TRITON_PRINT_AUTOTUNING:-1}
# the card's memory as nvidia-smi reports it (H200 140.4 GiB, H100 79.6), unless GPU_GIB says otherwise
GPU_GIB=${GPU_GIB:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 |
  awk '{printf "%.1f", $1 / 1024}')}
GPU=(cluster.gpus_per_node=1 train.precision=bfloat16 "cluster.gpu_memory_gib=${GPU_GIB:-140.4}" logging.mlflow=false)
# the 1.1B model's supervised warm start: long enough that some samples score, so the update has a learning signal
WARM=(model.warm_start_steps="${WARM_STEPS:-200}")
# the seed's recipe scaled to one GPU: its loss, sampling, async vLLM engine with its HTTP server, sleep mode, MoE
# settings kept; the layout (TP/PP/CP/EP/SP) to 1, the 49K-token budget to 1K, the toy env (no Gym in the kit)
RECIPE=(+recipe=nanov3 model=nemotron_h_1b cluster=local cluster.nodes=1 rollout.tensor_parallel_size=1 env=toy
  train.tensor_parallel_size=1 train.pipeline_parallel_size=1 train.context_parallel_size=1
  train.expert_parallel_size=1 train.sequence_parallel=false train.max_total_sequence_length=1024
  rollout.max_model_len=1024 rollout.max_new_tokens=16 env.max_prompt_tokens=64 grpo.num_prompts_per_step=32
  train.global_batch_size=512 grpo.max_steps=10 checkpoint.enabled=false)
read -ra EXTRA_ARGS <<< "${EXTRA:-}"  # overrides appended to every run step's launch.py (e.g. rollout.enforce_eager=true)
TESTS=$(dirname "$(find tests -name test_gpu.py | head -1)")

summary() {  # RUN_DIR: per-step means over steps 2.. of the phases, logprob gap, reward first/last
  python3 - "$1" <<'PY'
import json, sys, statistics as st
rows = {}
for line in open(sys.argv[1] + "/metrics.jsonl"):
    r = json.loads(line); rows[r["step"]] = r
rows = [rows[k] for k in sorted(rows)]
later = rows[1:] or rows
mean = lambda k: st.mean(r.get(k, float("nan")) for r in later)
print(f"steps {len(rows)}; step-1 {rows[0]['time/step_s']:.2f} s; later mean: step {mean('time/step_s'):.3f} s, "
      f"rollout {mean('time/rollout_s'):.3f}, update {mean('time/update_s'):.3f}, refit {mean('time/refit_ms'):.1f} ms; "
      f"logprob |d| max {max(r['train/gen_vs_policy_logprob_absdiff'] for r in rows):.4f}; "
      f"reward first-10 {st.mean(r['train/reward_mean'] for r in rows[:10]):.3f} "
      f"last-10 {st.mean(r['train/reward_mean'] for r in rows[-10:]):.3f}")
per_step = lambda k, f: " ".join(f % r[k] if k in r else "-" for r in rows)
print("per step: s", per_step("time/step_s", "%.2f"))
print("per step: logprob |d|", per_step("train/gen_vs_policy_logprob_absdiff", "%.4f"))
for k in ("memory/gpu_step_peak_gib", "memory/policy_allocated_gib", "memory/policy_reserved_gib",
          "memory/engine_asleep_gib"):
    print(f"per step: {k}", per_step(k, "%.2f"))
PY
}

run() {  # NAME ARGS...: launch.py with nvidia-smi sampling the whole GPU every 200 ms, RUN_TIMEOUT s at most
  local name=$1; shift
  rm -rf "/tmp/o/$name"  # /tmp/o/.models stays: the next run reuses the warm-started model
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/$name.smi" &
  local smi=$!
  # per process (policy worker, engine core, driver) once a second: which one a growing peak belongs to
  nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader,nounits -lms 1000 \
    > "$OUT/$name.apps" &
  local apps=$!
  /usr/bin/time -f "wall %e s" timeout "${RUN_TIMEOUT:-500}" python3 launch.py output_root=/tmp/o name="$name" "$@" \
    "${EXTRA_ARGS[@]}" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
  kill "$smi" "$apps"
  tail -1 "$OUT/$name.log"
  echo "$name: whole-GPU peak $(sort -n "$OUT/$name.smi" | tail -1) MiB"
  grep -m3 -E "Mamba-2 path|peak|memory per GPU" "$OUT/$name.log"
  [ -f "/tmp/o/$name/metrics.jsonl" ] && summary "/tmp/o/$name"
  cp "/tmp/o/$name/summary.json" "$OUT/$name.summary.json" 2>/dev/null
  rm -rf "/tmp/o/$name"
}

step() {
  case $1 in
    dry)
      for r in hf vllm; do
        python3 launch.py model=nemotron_h_1b rollout=$r "${GPU[@]}" dry_run=true > "$OUT/dry_1b_$r.txt" 2>&1
        echo "dry $r: exit $?"; grep -E "Mamba-2 path|peak|per GPU" "$OUT/dry_1b_$r.txt" | head -8
      done ;;
    conv)  # causal-conv1d built on the node for its GPU (scripts/gpu-kit.sh conv-sources carried as .gpu-kit/whl/conv;
           # the wheel comes back in $OUT/smNN: kept in .gpu-kit/whl/conv/smNN, a later node installs it, no build)
      CONV_KEEP=$OUT bash scripts/gpu-kit.sh build-conv .gpu-kit/whl/conv /tmp/site && bash scripts/gpu-kit.sh check /tmp/site ;;
    kernels) python3 -m pytest -q -s -m gpu "$TESTS/test_gpu.py" -k "nemotron_h and kernel_path" 2>&1 | tail -8 ;;
    pack) python3 -m pytest -q -s -m gpu "$TESTS/test_nemotron_packing.py" 2>&1 | tail -8 ;;
    block) python3 benchmarks/nemotron_memory.py --batch 32 --seq 16 64 300 2>&1 | tail -12 ;;
    mem) python3 benchmarks/memory_scale.py --out "$OUT/ms" --only "${MEM_ROWS:-1.5b-megatron}" 2>&1 | tail -15 ;;
    gate)  # vLLM without its MoE library: refused at pre-flight, naming it
      lib=$(ls /tmp/site/vllm/_moe_C*.so)
      mv "$lib" /tmp/moe.so
      python3 launch.py model=nemotron_h_tiny rollout=vllm "${GPU[@]}" dry_run=true > "$OUT/gate.txt" 2>&1
      echo "gate: exit $? (2 expected)"; grep -A3 "config error" "$OUT/gate.txt" | head -6
      mv /tmp/moe.so "$lib" ;;
    hf1b) run nh1b-hf model=nemotron_h_1b "${GPU[@]}" "${WARM[@]}" grpo.max_steps="${HF1B_STEPS:-12}" checkpoint.enabled=false ;;
    mhf1b) run nh1b-mega-hf model=nemotron_h_1b train.backend=megatron train.sequence_packing=false "${GPU[@]}" \
             "${WARM[@]}" grpo.max_steps="${HF1B_STEPS:-12}" checkpoint.enabled=false ;;
    vllm1b) run nh1b-vllm model=nemotron_h_1b rollout=vllm "${GPU[@]}" "${WARM[@]}" grpo.max_steps=6 checkpoint.enabled=false ;;
    mvllm1b) run nh1b-mega-vllm model=nemotron_h_1b rollout=vllm train.backend=megatron train.sequence_packing=false \
               "${GPU[@]}" "${WARM[@]}" grpo.max_steps=6 checkpoint.enabled=false ;;
    tiny) python3 -m pytest -q -s -m gpu "$TESTS/test_gpu.py" -k "nemotron_h_learns_with_vllm" 2>&1 | tail -8 ;;
    mtiny) run nhtiny-mega model=nemotron_h_tiny train.backend=megatron rollout=vllm "${GPU[@]}" grpo.max_steps=30 \
             checkpoint.enabled=false ;;
    recipe) run nanov3-torch "${RECIPE[@]}" "${GPU[@]}" "${WARM[@]}" train.backend=torch ;;
    # megatron cannot pack: the recipe's dynamic batching instead, its budget raised to 16 rows (the scaled-down
    # max_new_tokens=16 leaves micro_batch_size=1 a budget of 16 response positions: 3 rows of ~5 tokens)
    mrecipe) run nanov3-mega "${RECIPE[@]}" "${GPU[@]}" "${WARM[@]}" train.backend=megatron train.sequence_packing=false \
               train.micro_batch_size=16 train.logprob_batch_size=16 ;;
    mega) python3 -m pytest -q -s -m gpu "$TESTS/test_gpu.py" -k "nemotron_h and megatron" 2>&1 | tail -30 ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

if [ "${1:-}" = install ]; then
  bash scripts/gpu-kit.sh install "$2" /tmp/site && bash scripts/gpu-kit.sh check /tmp/site
  exit
fi
if [ "${1:-}" = bg ]; then  # a run longer than one call: started detached, collected by `wait` in later calls
  shift
  mkdir -p /tmp/bg
  # from a copy of the tree: the next call's carry replaces the carried folder (a run whose cwd vanished lost its
  # step 2 and the torch recipe, 2026-12-06)
  rm -rf /tmp/bgtree && cp -r "$PWD" /tmp/bgtree && cd /tmp/bgtree || exit 1
  OUT=/tmp/bg setsid bash benchmarks/gpu_jobs/nemotron.sh "$@" > /tmp/bg/steps.txt 2>&1 < /dev/null &
  echo $! > /tmp/bg.pid
  echo "detached: pid $(cat /tmp/bg.pid), steps $*"
  exit
fi
if [ "${1:-}" = stop ]; then  # the detached steps' process group (setsid), then Ray's daemons; files stay in /tmp/bg
  kill -9 -- "-$(cat /tmp/bg.pid)" 2>/dev/null && echo "stopped the detached steps"
  python3 -c "import sys; sys.argv = ['ray', 'stop', '--force']; from ray.scripts.scripts import main; main()" 2>&1 | tail -1
  exit 0
fi
if [ "${1:-}" = wait ]; then  # polls the detached steps' pid (at most $2 s), then copies what they wrote to $OUT
  pid=$(cat /tmp/bg.pid)
  end=$((SECONDS + ${2:-560}))
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
  # one archive (at most 8 files come back from a call): logs, nvidia-smi samples, summaries
  mkdir -p "$OUT" && tar -czf "$OUT/bg-$(date -u +%H%M%S).tgz" -C /tmp/bg . && cp /tmp/bg/steps.txt "$OUT/"
  cat /tmp/bg/steps.txt
  if kill -0 "$pid" 2>/dev/null; then echo "detached steps still running"; else echo "detached steps ended"; fi
  exit
fi
mkdir -p "$OUT"
for s in "$@"; do echo "== $s $(date -u +%T)"; step "$s"; done
