"""torchvision, importable beside a CPU-only torch."""
import torch


def import_torchvision():
    """Import torchvision. The registry's torchvision is a CUDA build: beside a CPU-only torch its
    compiled ops do not load, and its import dies registering fake kernels for them ("operator
    torchvision::nms does not exist", pytorch/vision#9085), so those registrations are skipped
    while it imports. Its data sets, transforms and models are Python and work as they are."""
    real = torch.library.register_fake

    def register_fake(op, func=None, /, **kwargs):
        missing = isinstance(op, str) and op.startswith("torchvision::") and not hasattr(
            torch.ops.torchvision, op.removeprefix("torchvision::"))
        if not missing:
            return real(op, func, **kwargs)
        return func if func is not None else skip

    torch.library.register_fake = register_fake
    try:
        import torchvision
    finally:
        torch.library.register_fake = real
    return torchvision


def skip(function):
    """register_fake's decorator form for an op that does not exist: the function as it is."""
    return function
