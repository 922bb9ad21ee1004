"""Mixed-precision plumbing that is not a step's lesson: a work-around for DataParallel's replica threads."""
import torch


def autocast_in_threads(model, device_type, dtype):
    """Make every forward of `model` (and of the copies DataParallel makes of it) compute in `dtype` under autocast.

    DataParallel's parallel_apply (torch 2.13, nn/parallel/parallel_apply.py) runs each replica in a new thread under
    `torch.amp.autocast(device_type, enabled=...)` without a dtype. The autocast dtype belongs to a thread, and a new
    one starts at the default: fp16 on a GPU, so `--amp bf16` computed in fp16, without loss scaling. A forward
    pre-hook, copied into every replica, sets the run's dtype in whichever thread runs it. Returns `model`."""
    if dtype is not None:  # fp32: autocast is off, nothing to set
        model.register_forward_pre_hook(lambda module, inputs: torch.set_autocast_dtype(device_type, dtype))
    return model
