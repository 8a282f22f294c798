#!/usr/bin/env bash
# make test (what CI runs) and make test-all: lint, then the tests of the tier folders (tests/README.md).
# NeMo Gym's one-time build (make gym: CPython from source, ~7 min on 2 cores, then ~1.4 GB of wheels) runs niced
# in the background beside the venv, lint and every test that does not need Gym; the `gym` tests run last.
#
#   TIERS        the folders: "tests/unit tests/integration" (make test, the default), + tests/extended (make test-all)
#   MARKS        a marker expression over them: "not extended" (make test, the default: the extended cases beside the
#                real runs in tests/integration), "" (make test-all: all of them)
#   PYTEST_ARGS  more pytest arguments (the Makefile passes --durations=30)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
read -r -a TIERS <<< "${TIERS:-tests/unit tests/integration}"
MARKS="${MARKS-not extended}"
read -r -a ARGS <<< "${PYTEST_ARGS:-}"
PY=.venv/bin/python
GYM_LOG=.cache/gym-install.log
mkdir -p .cache

gym_pid=""
stop_gym() {  # the build this script started (its own process group), on any early exit
  if [[ -n "$gym_pid" ]]; then kill -- "-$gym_pid" 2>/dev/null || true; fi
}
trap stop_gym EXIT
if ! make -s -q .gym/.installed 2>/dev/null; then
  echo "test: building NeMo Gym's venv in the background (log: $GYM_LOG)"
  setsid nice -n 10 make -s gym > "$GYM_LOG" 2>&1 &
  gym_pid=$!
fi

t0=$SECONDS
make -s .venv/.installed lint slurm-up
echo "test: venv, lint and Slurm ready after $((SECONDS - t0)) s"
marks() { if [[ -n "$MARKS" ]]; then echo "($MARKS) and $1"; else echo "$1"; fi; }
rc=0
"$PY" -m pytest "${TIERS[@]}" -m "$(marks "not gym")" "${ARGS[@]}" || rc=$?
if [[ -n "$gym_pid" ]]; then
  echo "test: waiting for NeMo Gym's build ($((SECONDS - t0)) s so far)"
  if ! wait "$gym_pid"; then
    gym_pid=""
    tail -30 "$GYM_LOG" >&2
    echo "test: make gym failed (log: $GYM_LOG)" >&2
    exit 1
  fi
  gym_pid=""
fi
"$PY" -m pytest "${TIERS[@]}" -m "$(marks gym)" "${ARGS[@]}" || rc=$?
echo "test: done in $((SECONDS - t0)) s (exit $rc)"
exit "$rc"
