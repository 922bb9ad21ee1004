#!/usr/bin/env bash
# From a fresh machine to a ready collection: a virtual environment in .venv with every pinned
# requirement, and Horovod built against its torch (scripts/install_horovod.sh, ~5 min the first
# time, seconds when its cached wheel fits). Safe to run again: it only adds what is missing.
#
#   bash scripts/setup.sh            # then: . .venv/bin/activate
#   PYTHON=python3.11 bash scripts/setup.sh
#   REQUIRE_HOROVOD=1 bash scripts/setup.sh   # fail if Horovod cannot be built (CI); by default set-up finishes
#                                             # without it, with one line saying so: only step 06 needs it
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
echo "== installing requirements.txt into .venv"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
echo "== Horovod (step 06)"
if PYTHON=.venv/bin/python bash scripts/install_horovod.sh; then
    echo "== ready: . .venv/bin/activate"
elif [ "${REQUIRE_HOROVOD:-0}" = 1 ]; then  # CI: every step, Horovod's too, or a failure
    echo "setup: Horovod could not be built (see above) and REQUIRE_HOROVOD=1 asks for it" >&2
    exit 1
else  # only step 06 needs it: the rest is ready
    echo "== ready: . .venv/bin/activate"
    echo "setup: every step is ready except 06: Horovod could not be built (see above; it needs g++, make, cmake," \
        "and with a CUDA torch nvcc and NCCL); build it later with: PYTHON=.venv/bin/python bash scripts/install_horovod.sh"
fi
