"""Make the checkpoint-epochNNNN.pt of steps 01-07 from one of step 05's DeepSpeed engine folders.

    python scripts/ds_to_pt.py RUN/ds_checkpoints/epoch0003      # -> RUN/checkpoint-epoch0003.pt
    python scripts/ds_to_pt.py RUN/ds_checkpoints --out-dir DIR  # the newest complete one, into DIR

Step 05 writes the engine's checkpoint only. This gathers one on one process, without a GPU and
without the model's code: the fp32 weights and buffers (DeepSpeed's own converter,
get_fp32_state_dict_from_zero_checkpoint, for ZeRO 1-3; under ZeRO 0, which it does not read, the
engine's model file holds them whole, with the fp32 masters beside them in bf16 or fp16), and the
run's settings, position and random state from the folder's position.json. The optimizer state
stays behind (DeepSpeed keeps it in its own flat partitions): any step continues the file as
weights only, momentum starting from zero (`--resume DIR/checkpoint-epoch0003.pt`), 05 too.
Reading an engine folder unpickles its files: convert only folders you trust.
"""
import argparse
import glob
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `common`

import torch  # noqa: E402

# DeepSpeed picks its accelerator on import; converting needs none.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
except ImportError as error:
    sys.exit(f"error: DeepSpeed is not importable by {sys.executable} ({error}): install it with "
             f"`{sys.executable} -m pip install deepspeed==0.19.8`")

from common import checkpoint  # noqa: E402
from common.cli import UserError, exits_cleanly  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="ds_checkpoints/epochNNNN[-stepSSSSSS] of a step 05 run, "
                        "or its ds_checkpoints/")
    parser.add_argument("--out-dir", help="where to write it (default: the run's folder)")
    return parser.parse_args(argv)


def fp32_weights(folder):
    """The whole model's weights and buffers in fp32 (integer buffers as they are)."""
    # The engine's model file; DeepSpeed pickles its config into it, so weights_only cannot be set.
    engine_file = sorted(glob.glob(os.path.join(glob.escape(folder), "*model_states.pt")))[0]
    saved = torch.load(engine_file, map_location="cpu", weights_only=False)
    if saved.get("param_shapes") is None:  # ZeRO 0, which DeepSpeed's converter does not read
        weights = zero0_weights(saved)
    else:
        parent, tag = os.path.split(folder)
        weights = get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
    return {name: tensor.float() if tensor.is_floating_point() else tensor
            for name, tensor in weights.items()}


def zero0_weights(saved):
    """ZeRO 0's module, whole in the engine's model file; in bf16 or fp16 with the fp32 masters of
    the optimizer wrapper (its fp32_groups, in the module's parameter order), as step 05's
    zero0_fp32_masters takes them: no public call reads them."""
    weights = dict(saved["module"])
    groups = (saved.get("optimizer") or {}).get("fp32_groups", [])
    masters = [tensor for group in groups for tensor in group]
    names = [name for name in weights if name not in saved["buffer_names"]]
    if len(masters) == len(names):
        weights.update(zip(names, masters))
    return weights


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    kind, folder = checkpoint.library_folder(args.folder)
    if kind != checkpoint.ENGINE_DIR:
        raise UserError(f"{args.folder} is not a DeepSpeed checkpoint folder of step 05 "
                        "(ds_checkpoints/epochNNNN with *model_states.pt, or ds_checkpoints/ "
                        "holding them)")
    checkpoint.save_converted(folder, args.out_dir, {"model": fp32_weights(folder)})


if __name__ == "__main__":
    sys.exit(main())
