#!/usr/bin/env bash
# Wheels for an offline GPU node (no package index there) whose image already has torch and transformers:
# the launcher's other runtime packages, for the node's Python (PYV, default 3.12) on manylinux x86_64.
#   bash scripts/gpu-kit.sh [OUT_DIR]          (make gpu-kit)
# On the node: python3 -m pip install --no-index --no-deps --target /tmp/site OUT_DIR/*.whl
#              export PYTHONPATH=/tmp/site:$PWD/src     then: python3 launch.py cluster.gpus_per_node=1 ...
set -euo pipefail
out=${1:-.gpu-kit/whl}
pyv=${PYV:-3.12}
packages=(ray==2.60.0 hydra-core==1.3.8 omegaconf==2.3.1 megatron-core==0.19.2
          jsonschema referencing rpds-py jsonschema-specifications)
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "${packages[@]}"
python3 -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3  # published as an sdist only
du -sh "$out"
