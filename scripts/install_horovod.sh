#!/usr/bin/env bash
# =============================================================================
# install_horovod.sh - build and install Horovod 0.28.1 for the PyTorch that is
# already installed in the target Python environment.
#
# Usage:
#   PYTHON=.venv/bin/python bash scripts/install_horovod.sh   # or: activate the
#   venv first and run `bash scripts/install_horovod.sh` (uses `python`)
#
# What it does:
#   1. If Horovod already works (import horovod.torch + `horovodrun --check-build`
#      shows PyTorch and Gloo), it prints one line and exits.
#   2. Otherwise it looks for a wheel built earlier for the same Python, torch
#      version and CPU/GPU flavour in the wheel cache and installs that (seconds).
#   3. If there is none, it downloads the Horovod 0.28.1 source, patches it (see
#      below), builds a wheel (~5 min on 2 cores), caches it and installs it.
#   4. It checks the result: `horovodrun --check-build` and a 2-process allreduce.
#
# Why a patch is needed:
#   Horovod 0.28.1 (the last release) hard-codes `set(CMAKE_CXX_STANDARD 14)` in
#   CMakeLists.txt and horovod/torch/CMakeLists.txt, but the headers of
#   PyTorch >= 2.1 need C++17 ("You need C++17 to compile PyTorch"), see
#   https://github.com/horovod/horovod/issues/3996. The fix,
#   https://github.com/horovod/horovod/pull/3998, was merged after 0.28.1 and has
#   never been released. CXXFLAGS=-std=c++17 does not help: Horovod's CMakeLists
#   removes any -std= flag from CMAKE_CXX_FLAGS. So we change 14 -> 17 in those
#   two lines of the source before building.
#   Three more for the GPU machine of docs/benchmark-gpu.md (CUDA 13, GCC 13): its
#   CUDA kernels ask nvcc for C++11 (set(CMAKE_CUDA_STANDARD 11)), while CUDA 13's
#   own C++ libraries require C++17: 17 there too; and GCC 13's C++ library no longer
#   brings in <cstdint>, <string> and <stdexcept> through other headers, which Horovod's
#   headers rely on (the build stopped at group_table.h): CXXFLAGS includes all three
#   in every C++ file (-include), rather than patching each header that needs one.
#
# Why --no-build-isolation:
#   Horovod's CMake scripts `import torch` to find its headers and libraries, so
#   the build must run in the environment that holds the torch you will use (and
#   the wheel is only valid for that torch version, hence one cache folder per
#   torch version).
#
# Requirements: g++ (C++17), make, cmake >= 3.13 and the Python headers.
#   Debian/Ubuntu: apt-get install g++ make cmake python3-dev
#   (or `pip install cmake` into the venv; the venv's bin/ is put on PATH here).
#
# CPU-only build (default): Gloo is the controller and does the CPU collectives;
#   no MPI is needed (horovodrun starts the processes itself).
#
# GPU machines (NVIDIA): with a CUDA build of torch installed, the build is one with
#   NCCL (HOROVOD_GPU_OPERATIONS=NCCL, set here unless you set it; set it empty,
#   HOROVOD_GPU_OPERATIONS=, for a CPU-only build there). Optionally also
#     HOROVOD_CUDA_HOME=/usr/local/cuda   (where nvcc is; needs the CUDA toolkit)
#     HOROVOD_NCCL_HOME=/path/to/nccl     (include/ and lib/ of NCCL, if NCCL is
#                                          not in a system or CUDA location)
#   NCCL then does the collectives on GPU tensors, while Gloo remains the
#   controller (rank coordination) and does the collectives on CPU tensors, so
#   HOROVOD_CPU_OPERATIONS=GLOO stays correct there too. Every HOROVOD_* variable
#   you export (HOROVOD_WITH_MPI=1, HOROVOD_CPU_OPERATIONS=..., etc.) reaches the
#   build; this script only fills in defaults for the ones you did not set.
#
# Other settings (environment):
#   PYTHON               python of the target environment (default: python)
#   HOROVOD_WHEEL_CACHE  wheel cache (default: ~/.cache/cifar10-parallel/wheels)
#   MAKEFLAGS            parallel build jobs (default: -j<number of cores>)
#
#   bash scripts/install_horovod.sh --dry-run   # which build it would make for this torch; builds nothing
# =============================================================================
set -euo pipefail

HVD_VERSION=0.28.1
PY=${PYTHON:-python}
# An absolute path, because the build runs in another folder. Not resolved through symlinks:
# a venv's python is a symlink, and resolving it would leave the venv.
case "$PY" in
    /*) ;;
    */*) PY="$PWD/$PY" ;;
    *) PY=$(command -v "$PY" || echo "$PY") ;;
esac
WHEEL_CACHE=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cifar10-parallel/wheels}
LOG_DIR=$WHEEL_CACHE/logs
LOG=$LOG_DIR/horovod-$HVD_VERSION-$(date +%Y%m%d-%H%M%S).log

# ---- error handling: one clear message, the log path, a non-zero exit ------------
fail() {
    echo "ERROR: $*" >&2
    [[ -s $LOG ]] && echo "       Full log: $LOG" >&2
    exit 1
}
trap 'fail "unexpected error (exit $?) at line $LINENO of $0"' ERR

# The first compiler/CMake error in the log (and the line after it), if any.
first_error() {
    awk '/CMake Error|error:|ERROR:/ && !/subprocess-exited-with-error/ {
             n = 2; printf "\n       First error in the log:" }
         n-- > 0 { gsub(/^ +/, ""); printf "\n         %s", $0 }
         n == 0 { exit }' "$LOG"
}

# step "description" "what to do if it fails" command...
# Runs the command with its output appended to the log.
step() {
    local what=$1 hint=$2
    shift 2
    echo "==> $what"
    echo "==> $what: $*" >>"$LOG"
    "$@" >>"$LOG" 2>&1 || fail "$what failed. $hint$(first_error)"
}

mkdir -p "$LOG_DIR"

# ---- the target Python and its torch ---------------------------------------------
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
    fail "'$PY' cannot import torch. Install torch first, or point PYTHON at the venv's python."
PY_TAG=$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
# Scripts that pip installs (horovodrun, a pip-installed cmake) live next to python.
SCRIPTS_DIR=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
export PATH=$SCRIPTS_DIR:$PATH

# A CUDA torch gets a build with NCCL (a CPU-only Horovod cannot all-reduce its GPU tensors), unless asked otherwise.
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
if [[ -z ${HOROVOD_GPU_OPERATIONS+set} && -n $TORCH_CUDA ]]; then
    HOROVOD_GPU_OPERATIONS=NCCL
    echo "torch $TORCH_VERSION is a CUDA $TORCH_CUDA build: building Horovod with NCCL" \
        "(HOROVOD_GPU_OPERATIONS= for CPU only)"
fi
# CMake compares these case-sensitively ("gloo" would be silently ignored).
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}
GPU_OPS=${GPU_OPS^^}
FLAVOUR=${GPU_OPS:-cpu}
FLAVOUR=${FLAVOUR,,}
if [[ ${1:-} == --dry-run ]]; then
    echo "install_horovod --dry-run: torch $TORCH_VERSION (${TORCH_CUDA:+CUDA }${TORCH_CUDA:-CPU only}) in $PY:" \
        "a $FLAVOUR build of Horovod $HVD_VERSION"
    exit 0
fi

# Did --check-build (output on stdin) list everything we need?
check_build_ok() {
    local out
    out=$(cat)
    grep -q '\[X\] PyTorch' <<<"$out" && grep -q '\[X\] Gloo' <<<"$out" &&
        { [[ -z $GPU_OPS ]] || grep -q "\[X\] $GPU_OPS" <<<"$out"; }
}

# ---- 1. already installed? ---------------------------------------------------------
if "$PY" -c "import horovod, horovod.torch; assert horovod.__version__ == '$HVD_VERSION'" >/dev/null 2>&1 &&
    horovodrun --check-build 2>/dev/null | check_build_ok; then
    echo "Horovod $HVD_VERSION is already installed and working for torch $TORCH_VERSION ($PY); nothing to do."
    exit 0
fi

# ---- 2. a cached wheel for this Python + torch + flavour? ---------------------------
WHEEL_DIR=$WHEEL_CACHE/horovod-$HVD_VERSION/torch-$TORCH_VERSION-$PY_TAG-$FLAVOUR
WHEEL=$(ls "$WHEEL_DIR"/horovod-"$HVD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)

# ---- 3. otherwise build one ----------------------------------------------------------
if [[ -z $WHEEL ]]; then
    echo "Building Horovod $HVD_VERSION for torch $TORCH_VERSION ($FLAVOUR). This takes a few"
    echo "minutes; follow the progress with: tail -f $LOG"

    # Build tools.
    command -v "${CXX:-g++}" >/dev/null ||
        fail "No C++ compiler (${CXX:-g++}) found. Install one: apt-get install g++ make cmake"
    command -v make >/dev/null || fail "'make' not found. Install it: apt-get install make"
    CMAKE=${HOROVOD_CMAKE:-cmake}
    CMAKE_VERSION=$("$CMAKE" --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p' || true)
    if [[ -z $CMAKE_VERSION ]] ||
        [[ $(printf '%s\n' 3.13 "$CMAKE_VERSION" | sort -V | head -n 1) != 3.13 ]]; then
        fail "cmake >= 3.13 is needed (found: ${CMAKE_VERSION:-none}). Install it with" \
            "'apt-get install cmake g++' or '$PY -m pip install cmake'."
    fi
    "$PY" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' ||
        fail "Python.h not found for $PY. Install the Python headers (e.g. apt-get install python3-dev)."

    BUILD_DIR=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
    trap 'rm -rf "$BUILD_DIR"' EXIT

    # Source release (kept in the cache, so a rebuild for another torch needs no download).
    SDIST=$WHEEL_CACHE/sdist/horovod-$HVD_VERSION.tar.gz
    if [[ ! -f $SDIST ]]; then
        step "Downloading the Horovod $HVD_VERSION source" "Check network access to the package index." \
            "$PY" -m pip download --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$WHEEL_CACHE/sdist"
    fi
    tar -xzf "$SDIST" -C "$BUILD_DIR"
    SRC=$BUILD_DIR/horovod-$HVD_VERSION

    # The C++14 -> C++17 patch (see the top of this file), verified line by line.
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$SRC/$f" ||
            fail "Cannot apply the C++17 patch: 'set(CMAKE_CXX_STANDARD 14)' not found in $f." \
                "This script is written for Horovod $HVD_VERSION only."
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/$f"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/$f" || fail "Patching $f did not work."
    done
    echo "==> Patched CMAKE_CXX_STANDARD 14 -> 17 (horovod/horovod#3996)"
    patch_line() { # FILE OLD NEW: replace the line OLD (which must be there) with NEW
        grep -qxF "$2" "$SRC/$1" || fail "Cannot patch $1: '$2' not found (Horovod $HVD_VERSION only)."
        OLD=$2 NEW=$3 "$PY" -c 'import os, sys; p = sys.argv[1]; s = open(p).read()
open(p, "w").write(s.replace(os.environ["OLD"] + "\n", os.environ["NEW"] + "\n", 1))' "$SRC/$1"
    }
    patch_line horovod/common/ops/cuda/CMakeLists.txt 'set(CMAKE_CUDA_STANDARD 11)' \
        'set(CMAKE_CUDA_STANDARD 17)'
    echo "==> Patched CMAKE_CUDA_STANDARD 11 -> 17 (CUDA 13)"

    # Horovod's setup.py lists its runtime dependencies as setup_requires too; with
    # --no-build-isolation they must already be installed, or setuptools tries to
    # fetch them on its own.
    step "Installing Horovod's Python dependencies" "Check network access to the package index." \
        "$PY" -m pip install cloudpickle psutil pyyaml packaging

    # Build settings. Defaults only: any HOROVOD_* you exported wins.
    export HOROVOD_WITH_PYTORCH=1
    export HOROVOD_WITHOUT_TENSORFLOW=${HOROVOD_WITHOUT_TENSORFLOW:-1}
    export HOROVOD_WITHOUT_MXNET=${HOROVOD_WITHOUT_MXNET:-1}
    export HOROVOD_WITH_GLOO=1 # the controller horovodrun uses without MPI
    HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-GLOO}
    export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS^^}
    if [[ ${HOROVOD_WITH_MPI:-} != 1 ]]; then
        export HOROVOD_WITHOUT_MPI=1 # or CMake links whatever MPI it happens to find
    fi
    if [[ -n $GPU_OPS ]]; then
        export HOROVOD_GPU_OPERATIONS=$GPU_OPS # HOROVOD_CUDA_HOME/NCCL_HOME pass through
    fi
    export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
    # Horovod's bundled Gloo asks for CMake < 3.5, which CMake 4 refuses ("Compatibility with CMake
    # < 3.5 has been removed"); CMake 4 takes this instead (older CMake ignores it).
    export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
    # GCC 13 (see the top of this file): the headers Horovod uses without including them.
    export CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept"
    # Horovod builds RelWithDebInfo (-g): ~60 MB of debug info in the .so. Drop it
    # at link time, so the wheel (and the installed library) is ~10x smaller.
    export LDFLAGS="${LDFLAGS:-} -Wl,--strip-debug"

    step "Building the Horovod wheel (MAKEFLAGS=$MAKEFLAGS)" \
        "Needs g++ with C++17, cmake >= 3.13, the Python headers$([[ -n $GPU_OPS ]] && echo ', and for GPU builds nvcc (HOROVOD_CUDA_HOME) and NCCL (HOROVOD_NCCL_HOME)')." \
        bash -c 'cd "$1" && "$2" -m pip wheel --no-build-isolation --no-deps --no-cache-dir -w "$1/dist" .' \
        _ "$SRC" "$PY"

    # Move the finished wheel into the cache (only now, so a failed build caches nothing).
    mkdir -p "$WHEEL_DIR"
    mv "$SRC"/dist/horovod-"$HVD_VERSION"-*.whl "$WHEEL_DIR"/
    WHEEL=$(ls "$WHEEL_DIR"/horovod-"$HVD_VERSION"-*.whl | head -n 1)
    echo "==> Cached $WHEEL ($(du -h "$WHEEL" | cut -f1))"
else
    echo "==> Using cached wheel $WHEEL"
fi

# ---- install (replacing a broken or mismatched horovod, if any) -----------------------
step "Removing any previous horovod" "" "$PY" -m pip uninstall -y horovod
step "Installing $(basename "$WHEEL") and its dependencies" \
    "Check network access to the package index (for cloudpickle, pyyaml, ...)." \
    "$PY" -m pip install "$WHEEL"

# ---- 4. verify -------------------------------------------------------------------------
CHECK=$(horovodrun --check-build 2>&1) || true
echo "$CHECK" >>"$LOG"
check_build_ok <<<"$CHECK" ||
    fail "'horovodrun --check-build' does not list PyTorch and Gloo${GPU_OPS:+ and $GPU_OPS} as available:" \
        "$CHECK"

# Two processes on this machine: each contributes rank+1, the sum must be 1+2=3.
SMOKE='
import torch, horovod.torch as hvd
hvd.init()
x = torch.tensor([hvd.rank() + 1.0])
s = hvd.allreduce(x, op=hvd.Sum)
assert hvd.size() == 2 and s.item() == 3.0, (hvd.size(), s)
if torch.cuda.is_available() and torch.cuda.device_count() >= hvd.local_size():
    torch.cuda.set_device(hvd.local_rank())
    assert hvd.allreduce(x.cuda(), op=hvd.Sum).item() == 3.0
print(f"rank {hvd.rank()}/{hvd.size()}: allreduce OK")
'
step "Smoke test: horovodrun -np 2 -H localhost:2 (allreduce)" \
    "Horovod is installed but a 2-process run failed." \
    timeout 300 horovodrun -np 2 -H localhost:2 "$PY" -c "$SMOKE"

echo "Horovod $HVD_VERSION installed for torch $TORCH_VERSION ($FLAVOUR) in ${SECONDS}s; log: $LOG"
