#!/usr/bin/env bash
# gpu_bundle.sh - on a machine WITH a package registry, download what a GPU machine WITHOUT one needs for steps 05
# and 06 of the GPU check (docs/benchmark-gpu.md says how to install it there): requirements.txt's pins for that
# machine's Python and platform (DeepSpeed as source), Horovod's source (built there by scripts/install_horovod.sh),
# and setuptools and wheel to build them. Not torch or torchvision (its CUDA builds are used), torch's own
# dependencies or the test tools. It installs nothing.
#
#   bash scripts/gpu_bundle.sh [--out gpu-bundle] [--python 3.12] [--platform manylinux_2_28_x86_64] [--dry-run]
#                              [SPEC...]
#
# SPEC: more to take along, e.g. cmake==3.31.10 for a GPU machine without cmake (Horovod's build needs >= 3.13).
# One line per file; "skipped SPEC: why" for what cannot be downloaded (exit status 1).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=gpu-bundle PYV=3.12 PLATFORM=manylinux_2_28_x86_64 DRY=0 EXTRA=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) OUT=${2:?--out needs a folder}; shift ;;
        --python) PYV=${2:?--python needs a version like 3.12}; shift ;;
        --platform) PLATFORM=${2:?--platform needs a tag like manylinux_2_28_x86_64}; shift ;;
        --dry-run) DRY=1 ;;
        -h | --help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_bundle: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) EXTRA+=("$1") ;;
    esac
    shift
done
[[ -x $REPO/.venv/bin/python ]] && DEFAULT=$REPO/.venv/bin/python || DEFAULT=python3
PYTHON=${PYTHON:-$DEFAULT}
# pip takes only the platform tags it is given: a manylinux_2_28 machine runs manylinux_2_17..2_27 wheels too.
TAGS=(--platform "$PLATFORM")
if [[ $PLATFORM =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    for ((m = BASH_REMATCH[1] - 1; m >= 17; m--)); do TAGS+=(--platform "manylinux_2_${m}_${BASH_REMATCH[2]}"); done
    TAGS+=(--platform "manylinux2014_${BASH_REMATCH[2]}")
fi
NOT='^(torch|torchvision|filelock|fsspec|jinja2|markupsafe|mpmath|networkx|sympy|pytest|pytest-xdist|execnet|iniconfig|pluggy|pygments)=='
mapfile -t SPECS < <(grep -E '^[A-Za-z0-9][A-Za-z0-9_.-]*==' "$REPO/requirements.txt" | grep -viE "$NOT")
SPECS+=(setuptools==84.2.1 wheel==0.48.0 "${EXTRA[@]}")
HOROVOD=horovod==$(sed -n 's/^HVD_VERSION=//p' "$REPO/scripts/install_horovod.sh")
FAILED=0

# get DEST SPEC OPTIONS...: a wheel for the GPU machine, else the source; one line saying which, or why neither.
get() {
    local dest=$1 spec=$2 output attempt why=
    for attempt in "--only-binary=:all: --python-version $PYV --implementation cp ${TAGS[*]}" "--no-binary=:all:"; do
        [[ $spec == horovod==* && $attempt == --only-binary* ]] && continue # built there, for its torch
        if [[ $DRY == 1 ]]; then
            echo "$PYTHON -m pip download --no-deps --dest $dest $attempt $spec"
            continue
        fi
        # shellcheck disable=SC2086 # the options are words without spaces
        if output=$("$PYTHON" -m pip download --disable-pip-version-check --no-deps --dest "$dest" $attempt "$spec" \
            2>&1); then
            echo "   $(grep -oE '(Saved|File was already downloaded) \S+' <<<"$output" | tail -n 1 | sed 's|.*/||')"
            return
        fi
        why=${why:-$(grep -m 1 '^ERROR: ' <<<"$output" | sed 's/^ERROR: //')}
    done
    [[ $DRY == 1 ]] || { echo "skipped $spec: ${why:-pip failed}"; FAILED=1; }
}

echo "== $OUT: for CPython $PYV on $PLATFORM"
for spec in "${SPECS[@]}"; do get "$OUT" "$spec"; done
get "$OUT/sdist" "$HOROVOD" # where install_horovod.sh looks, with HOROVOD_WHEEL_CACHE=the bundle
[[ $DRY == 1 ]] || echo "== $OUT: $(find "$OUT" -type f | wc -l) files, $(du -sh "$OUT" | cut -f1)"
exit $FAILED
