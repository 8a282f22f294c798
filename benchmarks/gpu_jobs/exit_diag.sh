#!/usr/bin/env bash
# A run that does not exit after "finished at step N": launch.py in the background; 20 s after that line, if the
# process is still there, what holds the GPU (nvidia-smi's compute apps, the process tree) and every thread's stack
# of the launcher (PYTHONFAULTHANDLER: SIGABRT dumps them to its stderr).
#   OUT=DIR bash benchmarks/gpu_jobs/exit_diag.sh NAME launch.py-overrides...
set -uo pipefail
OUT=${OUT:-/tmp/out}
name=$1; shift
mkdir -p "$OUT"; rm -rf /tmp/o
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONFAULTHANDLER=1
python3 launch.py output_root=/tmp/o name="$name" "$@" > "$OUT/$name.log" 2>&1 &
pid=$!
deadline=$((SECONDS + 480))
until grep -q "finished at step\|^error\|Traceback" "$OUT/$name.log" || ! kill -0 "$pid" 2>/dev/null; do
  [ $SECONDS -gt $deadline ] && break
  sleep 2
done
grep -E "start-up|^step .*/|finished at step" "$OUT/$name.log" | cut -c1-200
[ -f "/tmp/o/$name/metrics.jsonl" ] && python3 - "/tmp/o/$name/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first = sum(r["train/reward_mean"] for r in rows[:10]) / min(10, len(rows))
last = sum(r["train/reward_mean"] for r in rows[-10:]) / min(10, len(rows))
lp = max(r["train/gen_vs_policy_logprob_absdiff"] for r in rows)
print(f"{len(rows)} steps; reward first-10 {first:.3f} last-10 {last:.3f}; logprob |d| max {lp:.4f}; "
      f"step median {sorted(r['time/step_s'] for r in rows)[len(rows) // 2]:.3f} s")
PY
t_end=$SECONDS
while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t_end)) -lt 20 ]; do sleep 1; done
if kill -0 "$pid" 2>/dev/null; then
  echo "still running 20 s after its last line:"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  ps -eo pid,ppid,etimes,rss,args --forest | grep -v "ps -eo" | cut -c1-160 | tail -30
  kill -ABRT "$pid"; sleep 3
  grep -A25 "Thread 0x\|Current thread" "$OUT/$name.log" | cut -c1-160 | head -80
  pkill -9 -f "ray::|raylet|gcs_server"
else
  wait "$pid"; echo "exit $? within 20 s of its last line"
fi
