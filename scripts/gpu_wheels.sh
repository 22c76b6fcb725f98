#!/usr/bin/env bash
# Wheels for a GPU machine that has a CUDA PyTorch and no network: what batchqueue and its
# gpu-marked tests import beyond such an image's own packages (or need newer than it may
# have: the generated stubs need grpcio and protobuf at least as new as their generator).
# Run where pip can reach an index; the versions are the ones this checkout's venv holds, the
# wheels are for CPython 3.12 on x86-64 Linux (PY_VERSION to change it). See docs/gpu.md.
# Usage: scripts/gpu_wheels.sh [DEST] (default .whl, which git ignores).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
py="${PYTHON:-.venv/bin/python}"
pyver="${PY_VERSION:-3.12}"
packages=(grpcio grpcio-health-checking grpcio-reflection protobuf zlib-ng pytest-asyncio)
pins=()
for p in "${packages[@]}"; do
  pins+=("$p==$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$p")")
done
rm -rf "$dest"
"$py" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$dest" "${pins[@]}"
ls "$dest"
