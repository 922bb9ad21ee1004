#!/usr/bin/env bash
# From a fresh machine to a ready collection: a virtual environment in .venv with every pinned
# requirement, and Horovod built against its torch (scripts/install_horovod.sh, ~5 min the first
# time, seconds when its cached wheel fits). Safe to run again: it only adds what is missing.
#
#   bash scripts/setup.sh            # then: . .venv/bin/activate
#   PYTHON=python3.11 bash scripts/setup.sh
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
PYTHON=.venv/bin/python bash scripts/install_horovod.sh
echo "== ready: . .venv/bin/activate"
