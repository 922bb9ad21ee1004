"""Make the checkpoint-epochNNNN.pt of steps 01-07 from one of step 08's DCP folders.

    python scripts/dcp_to_pt.py RUN/dcp/epoch0003      # -> RUN/checkpoint-epoch0003.pt
    python scripts/dcp_to_pt.py RUN/dcp --out-dir DIR  # the newest complete one, into DIR

Step 08 writes DCP folders only. This gathers one on one process, without a GPU and without the
model's code: the whole model and optimizer state (torch's dcp_to_torch_save), the optimizer
re-keyed by parameter index as torch.optim keys it, and the run's settings, position and random
state from the folder's position.json. Any step then continues it
(`--resume DIR/checkpoint-epoch0003.pt`), 08 too.
Reading a DCP folder unpickles its .metadata: convert only folders you trust.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `common`

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from common import checkpoint  # noqa: E402
from common.cli import UserError, exits_cleanly  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="dcp/epochNNNN[-stepSSSSSS] of a step 08 run, or its dcp/")
    parser.add_argument("--out-dir", help="where to write it (default: the run's folder)")
    return parser.parse_args(argv)


def by_index(optim, index):
    """08's optimizer state (parameters by name) keyed by index, as torch.optim keys it."""
    return {"state": {index[name]: value for name, value in optim["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in optim["param_groups"]]}


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    kind, folder = checkpoint.library_folder(args.folder)
    if kind != checkpoint.DCP_DIR:
        raise UserError(f"{args.folder} is not a DCP checkpoint folder of step 08 (dcp/epochNNNN "
                        "with a .metadata file, or dcp/ holding them)")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, os.path.join(tmp, "whole.pt"))
        whole = torch.load(os.path.join(tmp, "whole.pt"), weights_only=True)
    names = [name for group in whole["optim"]["param_groups"] for name in group["params"]]
    optimizer = by_index(whole["optim"], {name: i for i, name in enumerate(names)})
    checkpoint.save_converted(folder, args.out_dir,
                              {"model": whole["model"], "optimizer": optimizer})


if __name__ == "__main__":
    sys.exit(main())
