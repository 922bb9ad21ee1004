"""The test harness's speed-up, in every Python process a test starts (tests/conftest.py puts this
folder first on their PYTHONPATH). It changes how long a process takes, never what it computes; a
user's run has none of it (docs/testing.md).

Once torch, torchvision and common/ are imported (at the first garbage collection after that), the
objects alive then are frozen: torch and torchvision leave ~300,000 that live as long as the
process, and every later full collection, the one at exit too, would walk them (about 0.6 s of CPU a
process here). SUITE_HARNESS=off leaves a process as a user's (tests/test_exit.py times the real
exit).
"""
import gc
import os
import sys


def _freeze_once_common_is_imported(phase, info):
    # common/'s package is imported whole (torchvision with it) before any of its modules.
    if phase == "start" and "common.cli" in sys.modules:
        gc.callbacks.remove(_freeze_once_common_is_imported)
        gc.freeze()


if os.environ.get("SUITE_HARNESS") != "off":
    gc.callbacks.append(_freeze_once_common_is_imported)
