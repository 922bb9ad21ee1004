#!/usr/bin/env bash
# =============================================================================
# gpu_check.sh - run every step on this machine's NVIDIA GPUs and write docs/benchmark-gpu.md.
#
# Usage:
#   bash scripts/gpu_check.sh                          # every step (02-08) on every GPU
#   bash scripts/gpu_check.sh --bundle gpu-bundle      # install what is missing from scripts/gpu_bundle.sh's folder
#   bash scripts/gpu_check.sh --steps 02,05 --arch cnn # a subset, the small model
#   bash scripts/gpu_check.sh --dry-run --gpus 4       # the runs and commands; needs no GPU
#   bash scripts/gpu_check.sh --help                   # every option
#   PYTHON=/opt/conda/bin/python bash scripts/gpu_check.sh   # the Python whose CUDA torch to use
#
# On generated CIFAR-10-layout data, each step through its launcher: 02 (--amp fp16, bf16, off), 03,
# 04 (torchrun, NCCL, a process per GPU), 05 (deepspeed, ZeRO 2 and 3, bf16 and fp16), 06 (horovodrun,
# if Horovod is there or can be built), 07 (torchrun), 08 (if it exists). Each must learn, resume bit
# for bit (--stop-after 1, then --resume auto), and reports img/s, loop/compute and peak GPU memory;
# step 02's loop must reach 90% of the pure compute rate and its data loader 5x the training rate.
# The work is done by scripts/gpu_check.py (its docstring says how); this script finds the GPU and a
# Python with a CUDA build of torch (>= 2.4: the one found is used, not requirements.txt's pin).
#
# Exit status: 0 every check that ran passed; 1 a check failed; 2 it could not start here (no GPU,
# no CUDA torch: one line saying so). The CPU test suite does not need this: .venv/bin/python -m pytest
# =============================================================================
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2

fail() {
    echo "gpu_check: $*" >&2
    exit 2
}

# The Pythons to try, best first: $PYTHON alone if it is set.
candidates() {
    if [[ -n ${PYTHON:-} ]]; then
        echo "$PYTHON"
    else
        [[ -x .venv/bin/python ]] && echo .venv/bin/python
        command -v python3 python 2>/dev/null
    fi
}

# What needs no GPU goes straight to the Python part, run by the first Python there is.
for arg in "$@"; do
    case $arg in
        -h | --help | --dry-run | --bundle-list | --pending-doc | --rehearse-on-cpu)
            exec "$(candidates | head -n 1)" scripts/gpu_check.py "$@" ;;
    esac
done

# 1. A GPU? nvidia-smi lists them; without nvidia-smi, a /dev/nvidia0 device still counts (containers).
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    [[ $GPUS -gt 0 ]] ||
        fail "no NVIDIA GPU: nvidia-smi lists none ($(nvidia-smi -L 2>&1 | head -n 1)); nothing was run"
    SEEN="nvidia-smi lists $GPUS GPU(s)"
elif compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
    SEEN="/dev/nvidia* is there (no nvidia-smi)"
else
    fail "no NVIDIA GPU on this machine (no nvidia-smi, no /dev/nvidia*): this check needs one; nothing was run"
fi

# 2. A Python with a CUDA build of torch that sees it.
TRIED=()
PY=
while read -r candidate; do
    [[ -n $candidate ]] || continue
    if answer=$("$candidate" scripts/gpu_check.py --probe 2>/dev/null); then
        PY=$candidate
        break
    fi
    TRIED+=("$candidate: ${answer:-cannot run}")
done < <(candidates)
if [[ -z $PY ]]; then
    TRIED=$(printf '%s; ' "${TRIED[@]}")
    fail "$SEEN, but no Python here has a CUDA build of torch >= 2.4 that sees it (${TRIED%; }):" \
        "point PYTHON at one: PYTHON=/path/to/python bash scripts/gpu_check.sh"
fi
echo "gpu_check: $SEEN; using $PY: $answer"

GPU_CHECK_COMMAND="bash scripts/gpu_check.sh${*:+ $(printf '%q ' "$@")}"
export GPU_CHECK_COMMAND=${GPU_CHECK_COMMAND% } GPU_CHECK_OUTER=$PY
exec "$PY" scripts/gpu_check.py "$@"
