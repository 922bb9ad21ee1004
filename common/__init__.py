"""What every numbered script shares and none of them teaches: data, models, checkpoints, metrics.

Nothing in here is specific to a parallelism method; the method's own code lives in the scripts.
"""
from . import _torchvision  # noqa: E402,F401  (torchvision imports after this, also with a CPU-only torch)
