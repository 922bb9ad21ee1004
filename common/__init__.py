"""What every numbered script shares and none of them teaches: the data, the models, the checkpoint
file format, the schedule, the command line and what a run reports. No parallelism library is
imported here, and no collective is made here: each method's own calls, and every place where the
ranks meet, are in its script."""
import gc

# torchvision imports after this, also with a CPU-only torch.
from . import _torchvision  # noqa: F401

# torch and torchvision leave ~300,000 objects that live as long as the process. Frozen, they are no
# longer walked by each full collection nor by the one at shutdown: about 0.7 s of CPU less per
# process here.
gc.freeze()
