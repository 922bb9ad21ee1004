"""Import torchvision even when its compiled ops cannot load.

The registry's torchvision wheel is built for CUDA torch. Paired with a CPU-only torch (what
`pip install torch==2.13.0` gives on many machines) its C++ ops (nms, roi_align, ...) do not
load, and `import torchvision` dies in torchvision/_meta_registrations.py with
"operator torchvision::nms does not exist" (pytorch/vision#9085, pytorch/pytorch#122494).
We use only the pure-Python parts (datasets), so registering fake kernels for ops that do not
exist can safely be skipped. On a working install nothing is skipped.
"""
import contextlib

import torch


def _op_exists(qualname):
    namespace, _, name = qualname.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def _skip_fakes_for_missing_ops():
    real_register_fake = torch.library.register_fake

    def register_fake(op, func=None, /, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::") and not _op_exists(op):
            return func if func is not None else (lambda fn: fn)
        return real_register_fake(op, func, **kwargs)

    torch.library.register_fake = register_fake
    try:
        yield
    finally:
        torch.library.register_fake = real_register_fake


with _skip_fakes_for_missing_ops():
    import torchvision  # noqa: E402,F401
    from torchvision.datasets import CIFAR10  # noqa: E402,F401
