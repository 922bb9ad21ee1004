#!/usr/bin/env bash
# =============================================================================
# gpu_bundle.sh - on a machine WITH access to the package index, put into one folder everything that
# scripts/gpu_check.sh may have to install on a GPU machine WITHOUT it: wheels of our pins in
# requirements.txt (built for the GPU machine's Python and platform), the sources of DeepSpeed and
# Horovod (built there, against its torch), and setuptools/wheel to build them. Never torch (the GPU
# machine's CUDA build is used), torch's own dependencies, or the test tools: the list is
# `python scripts/gpu_check.py --bundle-list`. Nothing is installed here: it only runs `pip download`.
#
# Usage:
#   bash scripts/gpu_bundle.sh                          # ./gpu-bundle, CPython 3.12, Linux x86_64
#   bash scripts/gpu_bundle.sh --python 3.11,3.12 --platform manylinux_2_28_aarch64 --out /tmp/bundle
#   bash scripts/gpu_bundle.sh --with-cmake             # + a cmake wheel, for a GPU machine without cmake
#   bash scripts/gpu_bundle.sh --dry-run                # print the pip commands, download nothing
# then copy the folder next to the repository on the GPU machine and run there:
#   bash scripts/gpu_check.sh --bundle gpu-bundle       # (./gpu-bundle is used without asking)
#
# Options:
#   --out DIR          the bundle folder (default ./gpu-bundle; it is not part of the repository)
#   --python X.Y[,..]  the GPU machine's Python version(s) (default 3.12): binary wheels are per version
#   --platform TAG     its platform (default manylinux_2_28_x86_64; older manylinux wheels are taken too)
#   --with-cmake       also cmake (Horovod's build needs cmake >= 3.13; ~30 MB)
#   --skip A,B         leave out packages the GPU machine is known to have (its CUDA torch often comes
#                      with numpy, pillow and torchvision: --skip numpy,pillow,torchvision saves ~30 MB)
#   --dry-run          print what it would run
# Settings (environment): PYTHON, the python whose pip downloads (default .venv/bin/python, else python3).
# A package that cannot be downloaded is one line ("skipped ...: why"); the exit status is then 1.
# =============================================================================
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)

OUT=./gpu-bundle PYTHONS=3.12 PLATFORM=manylinux_2_28_x86_64 WITH_CMAKE=0 DRY=0 SKIP=
usage() { sed -n '/^# Usage:/,/^# =====/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) OUT=${2:?--out needs a folder}; shift ;;
        --python) PYTHONS=${2:?--python needs versions like 3.12}; shift ;;
        --platform) PLATFORM=${2:?--platform needs a tag like manylinux_2_28_x86_64}; shift ;;
        --with-cmake) WITH_CMAKE=1 ;;
        --skip) SKIP=${2:?--skip needs package names like numpy,pillow}; shift ;;
        --dry-run) DRY=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_bundle: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x $REPO/.venv/bin/python ]] && PYTHON=$REPO/.venv/bin/python
fi

LIST=$("$PYTHON" "$REPO/scripts/gpu_check.py" --bundle-list) || {
    echo "gpu_bundle: '$PYTHON scripts/gpu_check.py --bundle-list' failed; set PYTHON to a python3" >&2
    exit 2
}
PIP=("$PYTHON" -m pip download --disable-pip-version-check --no-deps --dest "$OUT")
# pip takes a wheel only for a platform it is told, and does not widen manylinux_2_Y to the older
# manylinux_2_17..2_Y that the same machine runs too (many wheels are tagged manylinux_2_17 only).
PLATFORMS=(--platform "$PLATFORM")
if [[ $PLATFORM =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    GLIBC=${BASH_REMATCH[1]} ARCH=${BASH_REMATCH[2]}
    for ((minor = GLIBC - 1; minor >= 17; minor--)); do PLATFORMS+=(--platform "manylinux_2_${minor}_$ARCH"); done
    PLATFORMS+=(--platform "manylinux2014_$ARCH")
fi
FAILED=0

# The ways to get one item, best first, a line of pip options each: a pure-Python wheel (smallest, and
# it fits any machine), a binary wheel for that Python and platform, the source (built on the GPU machine).
attempts() { # KIND SPEC [PYTHON VERSION]
    local kind=$1 spec=$2 target="--python-version ${3:-} --implementation cp"
    case $kind in
        wheel | optional)
            echo "--only-binary=:all: --platform any $target $spec"
            echo "--only-binary=:all: ${PLATFORMS[*]} $target $spec"
            echo "--no-binary=:all: $spec" ;;
        sdist) echo "--no-binary=:all: $spec" ;;
        tool) echo "--only-binary=:all: $spec" ;;
    esac
}

# fetch WHAT KIND SPEC [PYTHON VERSION]: the first attempt that works, the file it saved; or one line why not.
fetch() {
    local what=$1 options first= saved
    while read -r options; do
        if [[ $DRY == 1 ]]; then
            echo "${PIP[*]} $options"
            continue
        fi
        # shellcheck disable=SC2086 # the options are words without spaces
        if OUTPUT=$("${PIP[@]}" $options 2>&1); then
            saved=$(grep -oE '(Saved|File was already downloaded) \S+' <<<"$OUTPUT" | tail -n 1)
            echo "   $what: ${saved##*/}"
            return
        fi
        first=${first:-$(grep -m1 -E '^(ERROR: |× )' <<<"$OUTPUT" | sed -E 's/^(ERROR: |× )//')}
    done < <(attempts "${@:2}")
    if [[ $DRY == 0 ]]; then
        echo "skipped $what: ${first:-pip failed}"
        FAILED=1
    fi
}

[[ $DRY == 1 ]] || mkdir -p "$OUT" || exit 2
echo "== bundle $OUT for CPython ${PYTHONS//,/ and } on $PLATFORM"
while read -r kind spec; do
    name=${spec%%==*}
    if [[ ,${SKIP,,}, == *,${name,,},* ]]; then
        echo "   left out $spec (--skip)"
    elif [[ $kind == wheel || ($kind == optional && $WITH_CMAKE == 1) ]]; then
        for version in ${PYTHONS//,/ }; do
            fetch "$spec (Python $version)" "$kind" "$spec" "$version"
        done
    elif [[ $kind != optional ]]; then
        fetch "$spec" "$kind" "$spec"
    fi
done <<<"$LIST"
[[ $DRY == 1 ]] && exit 0

cp "$REPO/requirements.txt" "$OUT/"
{
    echo "Made by scripts/gpu_bundle.sh on $(date -u +%Y-%m-%dT%H:%MZ) for CPython ${PYTHONS} on ${PLATFORM}."
    echo "Use on the GPU machine: bash scripts/gpu_check.sh --bundle $(basename "$OUT")"
    echo
    ls -1 "$OUT" | grep -v -e '^MANIFEST.txt$' -e '^requirements.txt$'
} >"$OUT/MANIFEST.txt"
SIZE=$(du -sm "$OUT" | cut -f1)
echo "== $OUT: $(ls "$OUT" | wc -l) files, $(du -sh "$OUT" | cut -f1) ($SIZE MiB)"
if [[ $SIZE -ge 64 ]]; then
    echo "warning: $SIZE MiB is not well under 64 MiB: fewer --python versions, --skip what the GPU" \
        "machine has, or no --with-cmake" >&2
fi
exit $FAILED
