#!/usr/bin/env bash
# Wheels for an offline GPU node (no package index there) whose image already has torch and transformers:
# the launcher's other runtime packages, for the node's Python (PYV, default 3.12) on manylinux x86_64.
#   bash scripts/gpu-kit.sh [OUT_DIR]          (make gpu-kit)
# On the node: python3 -m pip install --no-index --no-deps --target /tmp/site OUT_DIR/*.whl
#              export PYTHONPATH=/tmp/site:$PWD/src     then: python3 launch.py cluster.gpus_per_node=1 ...
#
# rollout=vllm on such a node (its image: torch 2.11, which vLLM 0.25.0 pins exactly):
#   VLLM=0.25.0 SPLIT_MIB=58 bash scripts/gpu-kit.sh [OUT_DIR]
# adds vLLM's CUDA wheel, slimmed to what a dense model on Hopper needs (FlashAttention 2, the MoE kernels, the Rust
# frontend and two unused third-party kernel trees removed: 250 -> 99 MB), and the ~45 small packages vLLM imports
# that such an image lacks (llguidance 1.6.1: the 1.7 it pins is not on the index; it is only imported, for
# structured output), then packs everything into one tar split into SPLIT_MIB parts (a size limit per transfer):
#   OUT_DIR/parts/kit.tar.NN + OUT_DIR/parts/SHA256SUMS
# On the node, after the parts arrived (all of them: checked):
#   bash scripts/gpu-kit.sh install OUT_DIR/parts [/tmp/site]
set -euo pipefail
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
if [ -n "${VLLM:-}" ]; then
  # Ray slimmed (Java, RLlib, Serve, Tune, Data, LLM, dashboard source maps): the kit must fit a few transfers
  bash "$(dirname "$0")/../../shared/tools/offline-wheels.sh" "$out" 60 2>/dev/null \
    || { get "$out" "${packages[@]}"; python3 -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  get "$tmp" "vllm==$VLLM"
  python3 -m pip install -q wheel
  (cd "$tmp" && python3 -m wheel unpack vllm-*.whl >/dev/null && rm vllm-*.whl)
  d=$(ls -d "$tmp"/vllm-*/)
  rm -rf "$d"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$d"vllm/_moe_C_stable_libtorch.abi3.so "$d"vllm/vllm-rs \
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
fi
du -sh "$out"
