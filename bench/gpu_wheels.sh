#!/usr/bin/env bash
# Downloads into bench/wheels (or DIR) the wheels bench/gpu_check.sh's test step needs beyond
# the GPU machine's image (Python 3.12, x86-64; it has torch, pytest, numpy, transformers, peft,
# safetensors): llguidance for constrained decoding and jsonschema for its checks. Run it where
# pip reaches PyPI, then carry the folder to the GPU machine (about 3.5 MB).
#
#   bash bench/gpu_wheels.sh [DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/bench/wheels}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$DIR" \
    llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
ls "$DIR"
