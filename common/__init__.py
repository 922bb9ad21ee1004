"""What every numbered script shares and none of them teaches: data, models, checkpoints, metrics.

Nothing in here is specific to a parallelism method; the method's own code lives in the scripts.
"""
import gc

from . import _torchvision  # noqa: E402,F401  (torchvision imports after this, also with a CPU-only torch)

# torch and torchvision leave ~300,000 objects that live as long as the process. Frozen (moved out of the collector's
# generations), they are no longer walked by each full collection during training nor by the collection at shutdown:
# about 0.7 s of CPU less per process here. What the run itself makes is collected as usual.
gc.freeze()
