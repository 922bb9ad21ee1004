#!/usr/bin/env bash
# gpu_check.sh - every step on this machine's NVIDIA GPUs (scripts/gpu_check.py, docs/benchmark-gpu.md), run by the
# Python with the CUDA build of torch: $PYTHON if set, else the repository's .venv/bin/python, else python3.
#   bash scripts/gpu_check.sh [--steps 02,04] [--dry-run] [--help] [-- flags for every run, e.g. --arch cnn]
# Exit status: 0 every check that ran passed; 1 one failed; 2 it cannot start here (no GPU or no CUDA torch).
REPO=$(cd "$(dirname "$0")/.." && pwd)
[[ -x $REPO/.venv/bin/python ]] && DEFAULT=$REPO/.venv/bin/python || DEFAULT=python3
PYTHON=${PYTHON:-$DEFAULT}
command -v "$PYTHON" >/dev/null || { echo "gpu_check: no $PYTHON here; nothing was run (set PYTHON)" >&2; exit 2; }
exec "$PYTHON" "$REPO/scripts/gpu_check.py" "$@"
