"""Step 08 with another choice of FSDP units, to measure what the choice costs (docs/08-fsdp.md):

    torchrun --nproc_per_node=2 scripts/fsdp_units.py CHOICE [08's arguments]
    python scripts/benchmark.py --arch resnet18:04,08,08ublocks,08ustages,08uwhole   # a table

08 itself: runs of consecutive layers of at least 1/UNITS of the weights, the batch norms one unit.
CHOICE:
    blocks  each child with weights a unit, containers opened (ResNet-18's stem, 8 residual blocks
            and head; the cnn's layers), and every batch norm a unit of its own: 08 until
            2026-11-29 (31 units and the root for ResNet-18)
    stages  runs of those children of one width (their first weight's rows: ResNet-18's residual
            stages, the stem with the first, the head with the last), the batch norms one unit
    whole   one run of all the layers (UNITS = 1), the batch norms one unit
"""
import importlib.util
import sys
from pathlib import Path

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def children(module):
    """The children with weights, in order, containers opened."""
    for child in module.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            yield from children(child)
        elif list(child.parameters()):
            yield child


def blocks(step):
    def units(model, norms):
        return [[child] for child in children(model) if child not in norms]

    def one_by_one(modules, **options):  # every batch norm a unit of its own
        if not isinstance(modules, list):  # the root
            return fully_shard(modules, **options)
        for module in modules:
            fully_shard(module, **options)
    step.units, step.fully_shard = units, one_by_one


def stages(step):
    def units(model, norms):
        runs, width = [], None
        for child in (child for child in children(model) if child not in norms):
            rows = next(child.parameters()).shape[0]
            if not runs or rows > width:
                runs.append([])
                width = rows
            runs[-1].append(child)
        return runs
    step.units = units


def whole(step):
    step.UNITS = 1


CHOICES = {"blocks": blocks, "stages": stages, "whole": whole}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in CHOICES:
        print(f"usage: torchrun ... scripts/fsdp_units.py {{{','.join(CHOICES)}}} [08's arguments]",
              file=sys.stderr)
        return 2
    (path,) = REPO.glob("08_cifar10_*.py")
    spec = importlib.util.spec_from_file_location("step08", path)
    step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step)
    CHOICES[sys.argv[1]](step)
    return step.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
