"""What every numbered script shares and none of them teaches: the data, the models, the checkpoint
file format, the schedule, the command line and what a run reports. No parallelism library is
imported here, and no collective is made here: each method's own calls, and every place where the
ranks meet, are in its script."""
from ._torchvision import import_torchvision

# The scripts, and a user's code beside them, import torchvision after this.
import_torchvision()
