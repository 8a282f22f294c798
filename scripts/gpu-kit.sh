#!/usr/bin/env bash
# Wheels for an offline GPU node (no package index there) whose image already has torch and transformers:
# the launcher's other runtime packages, for the node's Python (PYV, default 3.12) on manylinux x86_64.
#   bash scripts/gpu-kit.sh [OUT_DIR]          (make gpu-kit)
# On the node: python3 -m pip install --no-index --no-deps --target /tmp/site OUT_DIR/*.whl
#              export PYTHONPATH=/tmp/site:$PWD/src     then: python3 launch.py cluster.gpus_per_node=1 ...
# Every kit carries Hydra's submitit launcher plugin (+ submitit) and the nemotron_h Mamba-2 kernels: mamba-ssm
# (an sdist only) built here as a pure-Python wheel WITHOUT its CUDA extension (MAMBA_SKIP_CUDA_BUILD=TRUE, local
# version +nocuda; BUILD_PYTHON, default .venv/bin/python, must have torch: setup.py imports it), with its one
# import of that extension made optional (scripts/gpu_kit.py patch-mamba): its Triton kernels (chunk scan, state
# update, gated RMSNorm) import and run, selective_scan_fn (Mamba-1) raises. causal-conv1d is not in the kit (a
# CUDA build on the node; without it transformers' NemotronH runs a torch conv1d, models/nemotron_h.py).
#   bash scripts/gpu-kit.sh OUT_DIR mamba-only   builds that mamba-ssm wheel alone (the CPU venv's: Makefile).
# causal-conv1d (mamba-ssm's fused conv + scan path) is built on the node, for its GPU only:
#   bash scripts/gpu-kit.sh OUT_DIR conv-sources          here: its sdist and ninja's wheel into OUT_DIR/conv (~0.2 MB)
#   bash scripts/gpu-kit.sh build-conv OUT_DIR/conv SITE  on the node (nvcc, torch): a wheel, installed into SITE
#     CONV_KEEP=$OUT keeps a copy in $OUT/smNN/; put that folder in OUT_DIR/conv and later nodes of that arch
#     install it instead of building (~400 s on 16 cores)
#
# rollout=vllm on such a node (its image: torch 2.11, which vLLM 0.25.0 pins exactly):
#   VLLM=0.25.0 SPLIT_MIB=56 bash scripts/gpu-kit.sh [OUT_DIR]
# adds vLLM's CUDA wheel, slimmed to what a model on Hopper needs (FlashAttention 2, the Rust frontend and two
# unused third-party kernel trees removed; its MoE library vllm/_moe_C_stable_libtorch.abi3.so is KEPT: MoE
# models, nemotron_h among them, need its grouped_topk / topk kernels), and the ~45 small packages vLLM imports
# that such an image lacks (llguidance 1.6.1: the 1.7 it pins is not on the index; it is only imported, for
# structured output), then packs everything into one tar split into SPLIT_MIB parts (a size limit per transfer):
#   OUT_DIR/parts/kit.tar.NN + OUT_DIR/parts/SHA256SUMS
#   bash scripts/gpu-kit.sh lite OUT_DIR LITE_DIR   the same wheels less vLLM and its own dependencies: one part
#     (~52 MB) that fits one call with the tree (both backends, rollout=hf)
# On the node, after the parts arrived (all of them: checked):
#   bash scripts/gpu-kit.sh install OUT_DIR/parts [/tmp/site]
# and what is there (vLLM + its MoE library, mamba-ssm's kernels, causal-conv1d, flash-attn, TE, the plugin):
#   bash scripts/gpu-kit.sh check [/tmp/site]
set -euo pipefail
if [ "${1:-}" = lite ]; then  # lite KIT_DIR OUT: the kit's wheels without vLLM and what only vLLM imports, one
  # part (~52 MB) that travels with the tree in one call: enough for both backends with rollout=hf
  src=$2 out=$3 wheels=()
  mkdir -p "$out" && out=$(cd "$out" && pwd)
  vllm_only='^(vllm|xgrammar|llguidance|openai|openai_harmony|apache_tvm_ffi|compressed_tensors|depyf|blake3|cbor2|fastar|diskcache)-'
  for w in "$src"/*.whl; do
    [[ $(basename "$w") =~ $vllm_only ]] || wheels+=("$(basename "$w")")
  done
  tar -cf "$out/kit.tar.00" -C "$src" "${wheels[@]}"
  (cd "$out" && sha256sum kit.tar.00 > SHA256SUMS && ls -l kit.tar.00)
  exit 0
fi
if [ "${1:-}" = install ]; then
  parts=$2 site=${3:-/tmp/site}
  [ -f "$parts/SHA256SUMS" ] || { echo "no $parts/SHA256SUMS" >&2; exit 1; }
  (cd "$parts" && sha256sum -c --quiet SHA256SUMS) || { echo "kit parts missing or damaged: $(ls "$parts")" >&2; exit 1; }
  tmp=$(mktemp -d)
  cat "$parts"/kit.tar.* | tar -x -C "$tmp"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$tmp"/*.whl
  rm -rf "$tmp"
  echo "installed into $site: export PYTHONPATH=$site:\$PWD/src"
  exit 0
fi
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = build-conv ]; then
  src=$2 site=${3:-/tmp/site} tmp=$(mktemp -d)
  arch=$(python3 -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
  kept=$(ls "$src/sm$arch"/causal_conv1d-*.whl 2>/dev/null | head -1)
  if [ -n "$kept" ]; then  # a wheel an earlier node built for this arch (CONV_KEEP brought it back)
    python3 -m pip install -q --no-index --no-deps --target "$site" "$kept"
    echo "causal-conv1d: the kept build $(basename "$kept") installed into $site"; exit 0
  fi
  python3 -m pip install -q --no-index --no-deps --target "$tmp/ninja" "$src"/ninja-*.whl
  tar -xzf "$src"/causal_conv1d-*.tar.gz -C "$tmp"
  python3 "$root/scripts/gpu_kit.py" one-arch "$(ls "$tmp"/causal_conv1d-*/setup.py)" "$arch"
  start=$(date +%s)
  PATH="$tmp/ninja/bin:$PATH" PYTHONPATH="$tmp/ninja${PYTHONPATH:+:$PYTHONPATH}" CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    MAX_JOBS=${MAX_JOBS:-16} python3 -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/whl" \
    "$(ls -d "$tmp"/causal_conv1d-*/)" > "$tmp/build.log" 2>&1 \
    || { echo "causal-conv1d build failed after $(($(date +%s) - start)) s (sm_$arch):"; grep -m5 -iE "error" "$tmp/build.log"
         tail -5 "$tmp/build.log"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target "$site" "$tmp"/whl/causal_conv1d-*.whl
  echo "causal-conv1d built for sm_$arch in $(($(date +%s) - start)) s, installed into $site"
  if [ -n "${CONV_KEEP:-}" ]; then  # keep the build (a later session carries it in OUT_DIR/conv: no 400 s rebuild)
    mkdir -p "$CONV_KEEP/sm$arch" && cp "$tmp"/whl/causal_conv1d-*.whl "$CONV_KEEP/sm$arch/"
    ls -la "$CONV_KEEP/sm$arch"
  fi
  rm -rf "$tmp"
  exit 0
fi
if [ "${1:-}" = check ]; then
  site=${2:-/tmp/site}
  PYTHONPATH="$site:$root/src${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$root/scripts/gpu_kit.py" check
fi
out=${1:-.gpu-kit/whl}
pyv=${PYV:-3.12}
packages=(ray==2.60.0 liger-kernel==0.8.5 hydra-core==1.3.8 omegaconf==2.3.1 megatron-core==0.19.2
          jsonschema referencing rpds-py jsonschema-specifications
          math-verify==0.9.0 latex2sympy2_extended==1.11.0)  # env=math's grader (pure Python; sympy: the torch image)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
          "${plat[@]}" -d "$@"; }
mkdir -p "$out"
rm -f "$out"/*.whl  # a rebuild starts empty: a wheel left from an earlier build (a second ray) would ride along
mamba_wheel() {  # mamba-ssm without its CUDA extension (patched, see the header) into $1
  local tmp py=${BUILD_PYTHON:-$root/.venv/bin/python} out=$1
  tmp=$(mktemp -d)
  export MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE  # FORCE: no guessed prebuilt wheel from GitHub
  "$py" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$tmp" \
    "mamba-ssm==${MAMBA_SSM:-2.3.2.post1}"
  # built from the file: pip checks a requirement's version against the built one, and the local label differs
  MAMBA_LOCAL_VERSION=nocuda "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp" "$tmp"/mamba_ssm-*.tar.gz
  rm "$tmp"/mamba_ssm-*.tar.gz
  python3 -m pip install -q wheel
  (cd "$tmp" && python3 -m wheel unpack mamba_ssm-*.whl >/dev/null && rm mamba_ssm-*.whl)
  python3 "$root/scripts/gpu_kit.py" patch-mamba "$(ls -d "$tmp"/mamba_ssm-*/)"
  python3 -m wheel pack "$(ls -d "$tmp"/mamba_ssm-*/)" -d "$out" >/dev/null
  rm -rf "$tmp"
}
mamba_kit() {  # mamba-ssm's wheel, einops, Hydra's submitit plugin
  mamba_wheel "$out"
  get "$out" einops hydra-submitit-launcher==1.2.0 submitit==1.5.4
}
if [ "${2:-}" = conv-sources ]; then  # causal-conv1d's sdist (no CUDA build here) and ninja, for build-conv
  mkdir -p "$out/conv"
  CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "${BUILD_PYTHON:-$root/.venv/bin/python}" -m pip download -q --no-deps \
    --no-binary=:all: --no-build-isolation -d "$out/conv" "causal-conv1d==${CAUSAL_CONV1D:-1.6.0}"
  get "$out/conv" ninja
  ls -la "$out/conv"
  exit
fi
if [ "${2:-}" = mamba-only ]; then  # the CPU venv's (Makefile): megatron's Mamba mixer imports it on CPU too
  mamba_wheel "$out"
  exit
fi
if [ -n "${VLLM:-}" ]; then
  # Ray slimmed (Java, RLlib, Serve, Tune, Data, LLM, dashboard source maps): the kit must fit a few transfers
  bash "$(dirname "$0")/../../shared/tools/offline-wheels.sh" "$out" 60 2>/dev/null \
    || { get "$out" "${packages[@]}"; python3 -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3; }
  mamba_kit
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  get "$tmp" "vllm==$VLLM"
  python3 -m pip install -q wheel
  (cd "$tmp" && python3 -m wheel unpack vllm-*.whl >/dev/null && rm vllm-*.whl)
  d=$(ls -d "$tmp"/vllm-*/)
  rm -rf "$d"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$d"vllm/vllm-rs \
         "$d"vllm/third_party/deep_gemm "$d"vllm/third_party/fmha_sm100
  python3 -m wheel pack "$d" -d "$out" >/dev/null
  # what vLLM imports for the offline engine, AsyncLLM and its OpenAI server, missing from a torch image
  get "$out" blake3 cachetools cbor2 compressed-tensors==0.17.0 depyf==0.20.0 astor dill diskcache==5.6.3 \
    "fastapi>=0.133,<0.137" "starlette>=1.0.1" uvicorn httptools watchfiles websockets python-dotenv ijson \
    jiter lark==1.2.2 loguru msgspec openai partial-json-parser prometheus-fastapi-instrumentator pybase64 \
    pydantic pydantic-core pydantic-extra-types pydantic-settings typing-inspection annotated-types \
    python-json-logger python-multipart pyzmq setproctitle sniffio truststore httpx2 httpcore2 fastar \
    openai-harmony xgrammar apache-tvm-ffi llguidance==1.6.1 "model-hosting-container-standards>=0.1.14,<1" jmespath supervisor
  get "$out" math-verify==0.9.0 latex2sympy2_extended==1.11.0  # env=math's grader
  rm -rf "$out/parts" && mkdir -p "$out/parts"
  (cd "$out" && tar -cf - ./*.whl) | split -b "${SPLIT_MIB:-58}M" -d - "$out/parts/kit.tar."
  (cd "$out/parts" && sha256sum kit.tar.* > SHA256SUMS)
  ls -la "$out/parts"
else
  get "$out" "${packages[@]}"
  python3 -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3  # published as an sdist only
  mamba_kit
fi
du -sh "$out"
