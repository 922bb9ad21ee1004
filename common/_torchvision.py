"""Import torchvision even when its compiled ops cannot load: beside a CPU-only torch the registry's CUDA build of
torchvision dies on import with "operator torchvision::nms does not exist" (pytorch/vision#9085). We use only its
pure-Python CIFAR10, so fake kernels for ops that do not exist are skipped; on a working install nothing is."""
import contextlib

import torch


def _op_exists(qualname):
    namespace, _, name = qualname.partition("::")
    with contextlib.suppress(AttributeError, RuntimeError):
        return bool(getattr(getattr(torch.ops, namespace), name))
    return False


_REAL = torch.library.register_fake


def _register_fake(op, func=None, /, **kwargs):
    if isinstance(op, str) and op.startswith("torchvision::") and not _op_exists(op):
        return func if func is not None else (lambda fn: fn)
    return _REAL(op, func, **kwargs)


torch.library.register_fake = _register_fake
try:
    import torchvision  # noqa: E402,F401
    from torchvision.datasets import CIFAR10  # noqa: E402,F401
finally:
    torch.library.register_fake = _REAL
