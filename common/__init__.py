"""What every numbered script shares and none of them teaches: data, models, checkpoints, metrics.

Nothing in here is specific to a parallelism method; the method's own code lives in the scripts.
"""
import atexit
import gc

from . import _torchvision  # noqa: E402,F401  (torchvision imports after this, also with a CPU-only torch)

# torch and torchvision leave ~300,000 objects that live as long as the process. Frozen, Python's garbage collector
# no longer walks them on each of its full collections during training, nor again while the interpreter shuts down
# (there, about 0.7 s of CPU per process here). Frozen again at exit: what the run made is freed without a walk too.
gc.freeze()
atexit.register(gc.freeze)
