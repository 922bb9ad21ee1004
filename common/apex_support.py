"""What step 07 needs around NVIDIA Apex that is not the lesson: finding a usable Apex, choosing the stack, and
fitting apex.amp's loss-scaler state into the common checkpoint format."""
import contextlib
import importlib.util
import io
import os
import pickle
import sys

import torch

from .cli import UserError, brief


def find_apex(device):
    """(apex with .amp and .parallel or None, FusedSGD or None, why there is no apex.amp)."""
    spec = importlib.util.find_spec("apex")
    if spec is None:
        return None, None, "NVIDIA Apex is not installed"
    folders = list(spec.submodule_search_locations or [])  # empty for a single-file module
    # `pip install apex` gives an unrelated package of that name; NVIDIA's has amp/ (<= 25.05) or optimizers/.
    if not any(os.path.isdir(os.path.join(folder, sub)) for folder in folders for sub in ("amp", "optimizers")):
        return None, None, (f"the apex in {folders[0] if folders else spec.origin} is the unrelated registry package "
                            "of that name, not NVIDIA Apex (pip uninstall apex)")
    fused_sgd = None
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # FusedSGD needs the CUDA extensions (amp_C), built with nvcc
            import amp_C  # noqa: F401
            from apex.optimizers import FusedSGD as fused_sgd
    if not any(os.path.isdir(os.path.join(folder, "amp")) for folder in folders):
        return None, fused_sgd, "the installed NVIDIA Apex is newer than 25.05, without apex.amp and apex.parallel"
    try:
        import apex.amp
        import apex.parallel
    except Exception as error:  # e.g. an old Apex that still imports torch._six, which torch 2.0 removed
        return None, fused_sgd, f"NVIDIA Apex does not import ({type(error).__name__}: {brief(error, 120)})"
    if device.type != "cuda":
        return None, fused_sgd, "apex.amp is installed but needs a CUDA GPU, and none was found"
    return apex, fused_sgd, None


def choose(args, device, rank):
    """--amp-backend: (apex or None for torch's native stack, FusedSGD or None). One line says what auto chose;
    an impossible choice stops with one line. Called before joining the group, so every rank stops at once."""
    apex, fused_sgd, missing = find_apex(device)
    misfit = args.amp in ("bf16", "off") or args.compile or args.grad_accum > 1  # not on the apex path here
    if args.amp_backend == "apex" and apex is None:
        raise UserError(f"--amp-backend apex needs NVIDIA Apex with apex.amp and a CUDA GPU, but {missing}. "
                        "apex.amp was removed upstream in May 2025: build Apex tag 25.05 or older from source on a "
                        "CUDA machine, or use an NGC PyTorch container that still has it (docs/07-apex.md); "
                        "or use --amp-backend torch")
    if args.amp_backend == "apex" and misfit:
        raise UserError("--amp-backend apex takes its precision from --opt-level (O0 = fp32) and is not combined with "
                        "--amp bf16/off, --compile or --grad-accum here: drop those, or use --amp-backend torch")
    if args.amp_backend == "auto" and rank == 0:
        why = missing or ("--amp bf16/off, --compile or --grad-accum was asked for" if misfit else None)
        print(f"amp backend: torch (auto: {why}; using its native successors torch.autocast + GradScaler + torch DDP)"
              if why else f"amp backend: apex (auto: apex.amp and a CUDA GPU found; --opt-level {args.opt_level})")
    return (None if args.amp_backend == "torch" or misfit else apex), fused_sgd


def _plain_data(state):
    """True if torch.load(weights_only=True) takes `state` back (numbers in dicts)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
        return True
    except pickle.UnpicklingError:
        return False


def savable_scaler(scaler):
    """The scaler to store: apex.amp's state goes in only as plain data (else none, said once)."""
    if _plain_data(scaler.state_dict()):
        return scaler
    print("warning: the loss-scaler state is not plain data; this checkpoint holds none", file=sys.stderr)
    return None


def fit_scaler_state(state, scaler):
    """torch's GradScaler state and apex.amp's loss scalers ("loss_scaler0") do not fit each other: start afresh."""
    saved_by_apex = any(key.startswith("loss_scaler") for key in state["scaler"] or {})
    if saved_by_apex != (not isinstance(scaler, torch.amp.GradScaler)):
        state["scaler"] = None
    return state
