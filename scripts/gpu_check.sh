#!/usr/bin/env bash
# The check of ringcomm's CUDA path, for a machine with a GPU where CUDA torch and
# CuPy (with NCCL) are already installed. It installs nothing and needs no
# network; it runs in under four minutes, in stages with deadlines of their own,
# and writes docs/data/gpu_check.json and docs/gpu-results.md after every stage.
#   bash scripts/gpu_check.sh            (PYTHON=... picks the interpreter)
#   bash scripts/gpu_check.sh --stages versions,allreduce     (a part of it)
# The driver ends its own workers when a stage passes its deadline; the outer
# timeout only backs it up (SIGTERM first, so it still writes what it has).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
exec timeout --kill-after=15 240 "$PY" scripts/gpu_check.py "$@"
