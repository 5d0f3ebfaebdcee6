#!/usr/bin/env bash
# The check of ringcomm's CUDA path, for a machine with a GPU where CUDA torch and
# CuPy (with NCCL) are already installed. It installs nothing and needs no
# network; it runs in under four minutes, in stages with deadlines of their own,
# and writes docs/data/gpu_check.json and docs/gpu-results.md after every stage.
#   bash scripts/gpu_check.sh            (PYTHON=... picks the interpreter)
#   bash scripts/gpu_check.sh --stages versions,allreduce     (a part of it)
#   bash scripts/gpu_check.sh --outdir "$OUT"
#       on a lent machine where only one folder comes back: the JSON, the report
#       (gpu-results.md) and each stage's whole log (<stage>.log) all go there,
#       and nothing in docs/ is written
# A stage that hangs leaves, in its log, the name of the case each rank started
# last and the stack of every thread of every rank (faulthandler, just before the
# deadline and on the driver's SIGUSR1 at it).
# The driver ends its own workers when a stage passes its deadline; the outer
# timeout only backs it up (SIGTERM first, so it still writes what it has).
set -u
# relative paths in the arguments are the caller's, not the repository's
export GPU_CHECK_CALLER_DIR="$PWD"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
exec timeout --kill-after=15 240 "$PY" scripts/gpu_check.py "$@"
