"""Import torchvision's CIFAR10, fast, even where its compiled ops cannot load. Beside a CPU-only
torch the registry's CUDA build of torchvision dies on import with "operator torchvision::nms does
not exist" (pytorch/vision#9085): fake kernels for ops that do not exist are skipped. And
torchvision.ops.roi_align imports one function of torch._dynamo, which imports all of TorchDynamo
(1 s of every process here): during the import stand-ins take its place, whose functions import the
real one when called (--compile, FSDP and DeepSpeed import it as they need it)."""
import importlib
import sys
import types

import torch


def _register_fake(op, func=None, /, **kwargs):
    if (isinstance(op, str) and op.startswith("torchvision::")
            and not hasattr(torch.ops.torchvision, op[13:])):
        return func if func is not None else (lambda fn: fn)
    return _REAL(op, func, **kwargs)


def _later(module, name):  # the stand-in's `name`: a function that calls the real module's
    if name.startswith("__"):
        raise AttributeError(name)
    return lambda *args, **kwargs: getattr(importlib.import_module(module), name)(*args, **kwargs)


_REAL, torch.library.register_fake = torch.library.register_fake, _register_fake
_STANDS_IN = {} if "torch._dynamo" in sys.modules else {
    name: types.ModuleType(name) for name in ("torch._dynamo", "torch._dynamo.utils")}
for _name, _module in _STANDS_IN.items():
    _module.__path__, _module.__getattr__ = [], lambda name, module=_name: _later(module, name)
sys.modules.update(_STANDS_IN)
try:
    import torchvision  # noqa: E402,F401
    from torchvision.datasets import CIFAR10  # noqa: E402,F401
finally:
    torch.library.register_fake = _REAL
    for _name, _module in _STANDS_IN.items():
        if sys.modules.get(_name) is _module:
            del sys.modules[_name]
    if _STANDS_IN and torch.__dict__.get("_dynamo") is _STANDS_IN["torch._dynamo"]:
        del torch._dynamo
