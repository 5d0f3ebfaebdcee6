#!/usr/bin/env bash
# The check of ringcomm's CUDA path, for a machine with a GPU where CUDA torch and
# CuPy (with NCCL) are already installed. It installs nothing and needs no
# network; it runs in under four minutes and writes docs/gpu-results.md.
#   bash scripts/gpu_check.sh            (PYTHON=... picks the interpreter)
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
exec timeout 240 "$PY" scripts/gpu_check.py "$@"
