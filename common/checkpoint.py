"""The one checkpoint format every step writes and reads, and continuing a run from it.

A checkpoint is a `torch.save`d dict (loaded back with `weights_only=True`, so a file that would run code is refused):

    format       "parallel-steps/1"
    step         the script that wrote it, e.g. "04_cifar10_ddp"
    arch         the --arch of the model
    model        state_dict of the bare model: never a `module.` prefix; tensors contiguous (NCHW)
    optimizer    optimizer.state_dict(), or None (05's: the engine keeps its own)
    scheduler    LR scheduler state_dict, or None
    scaler       torch.amp.GradScaler state_dict ({} when disabled), or None
    epoch        epochs completed
    global_step  optimizer steps taken (also those of a part-way epoch)
    rng          {"torch": CPU generator state, "device": {"type": "cuda" (xpu, mps), "states": one per device} or
                 None} (files written before 2026-11-26: "cuda", the per-GPU states)
    args         the run's arguments (plain values); --resume takes those not typed (settings)
    processes    the number of processes of the run
    metrics      the metrics.jsonl row of that epoch; for a run stopped part-way through an epoch (preempt.py) the
                 training half of the row so far, with "partial": True, "steps" done and "of_steps" per epoch
    synthetic    True when trained on common.synthetic data

Files are `checkpoint-epochNNNN.pt` in --out-dir (NNNN epochs done), and `checkpoint-epochNNNN-stepSSSSSS.pt` for a
run stopped SSSSSS optimizer steps into the epoch after those; the newest 3 are kept, and of the part-way ones only the
newest. A save writes a temporary file, flushes it to disk and renames it into place, so a crash (even SIGKILL during
the save) never leaves a truncated file under a checkpoint name: the previous one stays the newest complete one.
"""
import contextlib
import glob
import os
import pickle
import re
import shutil
import sys

import torch

from .cli import UserError, brief, processes, rank

FORMAT = "parallel-steps/1"  # (files written before it was renamed say "cifar10-parallel/1": read the same way)
FORMATS = (FORMAT, "cifar10-parallel/1")
ENGINE_DIR, DCP_DIR = "ds_checkpoints", "dcp"  # the folders of the libraries' own checkpoints (steps 05 and 08)
# Settings of this invocation and this machine, never taken from a checkpoint's run: where to write, how to start,
# what the hardware allows, and the DeepSpeed config's path.
OWN_SETTINGS = {"resume", "out_dir", "overwrite", "stop_after", "spawn", "local_rank", "workers", "compile", "sync_bn",
                "fp16_allreduce", "dist_timeout", "deepspeed_config", "profile"}
TAG = re.compile(r"epoch\d{4,}(?:-step\d{6,})?")  # one epoch's folder in ds_checkpoints/ or dcp/
PATTERN = re.compile(r"checkpoint-epoch(\d{4,})(?:-step(\d{6,}))?\.pt$")


def tag(epoch, row=None):
    """epochNNNN (epochs done), or epochNNNN-stepSSSSSS for epoch `epoch` stopped part-way: names in training order."""
    done = epoch - 1 if (row or {}).get("partial") else epoch
    return f"epoch{done:04d}" + (f"-step{row['steps']:06d}" if done < epoch else "")


def checkpoint_path(out_dir, epoch, row=None):
    return os.path.join(out_dir, f"checkpoint-{tag(epoch, row)}.pt")


def rng_states():
    """The CPU generator's state, and the accelerator's (one per device) on a machine with one."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    module = torch.get_device_module(accelerator) if accelerator else None
    states = getattr(module, "get_rng_state_all", lambda: [module.get_rng_state()])() if module else None
    return {"torch": torch.get_rng_state(), "device": {"type": accelerator.type, "states": states} if module else None}


def _restore_rng(rng):
    torch.set_rng_state(rng["torch"])
    saved = rng.get("device") or (rng.get("cuda") and {"type": "cuda", "states": rng["cuda"]})
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if saved and accelerator and saved["type"] == accelerator.type \
            and len(saved["states"]) == torch.accelerator.device_count():
        module = torch.get_device_module(accelerator)
        getattr(module, "set_rng_state_all", lambda states: module.set_rng_state(states[0]))(saved["states"])


def save(out_dir, *, step, arch, epoch, global_step, model_state, optimizer=None, scheduler=None,
         scaler=None, args=None, metrics=None, synthetic=False, keep=3):
    """Write checkpoint-epochNNNN.pt (or -stepSSSSSS.pt for a part-way epoch) atomically; keep the newest `keep`
    of them, and of the part-way ones only the newest file. Returns the path."""
    state = {
        "format": FORMAT, "step": step, "arch": arch, "model": _contiguous(model_state),
        "optimizer": _contiguous(getattr(optimizer, "state_dict", lambda: optimizer)()),  # optimizer, state or None
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": epoch - 1 if (metrics or {}).get("partial") else epoch, "global_step": global_step,
        "rng": rng_states(), "processes": processes(), "metrics": metrics or {}, "synthetic": bool(synthetic),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
        if args is not None else {},
    }
    path = checkpoint_path(out_dir, epoch, metrics)
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(folder)  # make the rename itself durable
        finally:
            os.close(folder)
    except (OSError, RuntimeError) as error:  # torch's zip writer reports a full disk as a RuntimeError
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "the write failed: disk full?"
        raise UserError(f"cannot write checkpoint {path} ({reason}); the previous checkpoints "
                        "are untouched: free disk space or pick a writable --out-dir, then --resume auto") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    for old in superseded(list_checkpoints(out_dir), keep):
        os.remove(old)
    return path


def _contiguous(state):
    """A state_dict (nested dicts and lists) with every tensor in the plain layout: a run with --channels-last keeps
    NHWC weights and momentum, which a step that runs NCHW would load as they are (Horovod's broadcast refuses them)."""
    if isinstance(state, torch.Tensor):
        return state.contiguous()
    if isinstance(state, dict):
        return {key: _contiguous(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_contiguous(value) for value in state)
    return state


def superseded(newest_first, keep=3):
    """The checkpoints (names or paths, newest first) to delete: all but the newest `keep`, and every part-way one
    (-stepSSSSSS) that is not the newest (a later one continues further)."""
    return newest_first[keep:] + [name for name in newest_first[1:keep] if "-step" in os.path.basename(name)]


def list_checkpoints(out_dir):
    """Checkpoint files in out_dir, newest first (a part-way checkpoint after the epochs it completed)."""
    found = [(int(m.group(1)), int(m.group(2) or 0), p) for p in glob.glob(os.path.join(out_dir, "checkpoint-epoch*.pt"))
             if (m := PATTERN.search(os.path.basename(p)))]
    return [p for _, _, p in sorted(found, reverse=True)]


def load(path, arch=None, mmap=False):
    """Load and validate a checkpoint of this collection. Any problem is one UserError with the fix.
    mmap: map the tensors' storage instead of reading it (for a look at the other values)."""
    if not os.path.isfile(path):
        raise UserError(f"--resume {path}: no such file (use --resume auto to pick the newest checkpoint in --out-dir)")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save writes a zip archive (old torch: a pickle)
        raise UserError(f"{path} is not a checkpoint (not a file written by torch.save): "
                        "pass a checkpoint-epochNNNN.pt written by one of the numbered scripts")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        if unsafe is None:  # not a pickle we can read at all
            raise UserError(f"{path} is not a readable checkpoint (damaged or not a torch file): "
                            "resume from an older checkpoint-epoch*.pt") from None
        raise UserError(f"refusing to load {path}: it would run code ({unsafe.group(1)}), which "
                        "torch.load(weights_only=True) does not allow; it is not a checkpoint of this collection") from None
    except Exception as error:  # truncated zip, not a torch file at all, unreadable
        raise UserError(f"{path} is not a readable checkpoint ({type(error).__name__}: {brief(error, 160)}); "
                        "it may be truncated or corrupt: resume from an older checkpoint-epoch*.pt") from None
    if not isinstance(state, dict) or state.get("format") not in FORMATS:
        raise UserError(f"{path} is not a checkpoint of this collection (expected format {FORMAT!r}); "
                        "pass a checkpoint-epochNNNN.pt written by one of the numbered scripts")
    if arch is not None and state["arch"] != arch:
        raise UserError(f"{path} holds a {state['arch']} model but this run uses --arch {arch}: "
                        f"pass --arch {state['arch']}")
    return state


def _find(resume, out_dir, arch, verbose):
    """`--resume`: None -> None; 'auto' -> newest readable checkpoint in out_dir (None if there is none); a path."""
    if resume is None:
        return None
    if resume != "auto":
        return load(resume, arch)
    found = list_checkpoints(out_dir)
    for path in found:
        try:
            return load(path, arch)
        except UserError as error:
            if path == found[-1]:  # none can be continued: never start over silently on top
                raise UserError(f"--resume auto: no checkpoint in {out_dir} can be continued by this run ({error}); "
                                "or use another --out-dir, or --overwrite to replace that run") from None
            if verbose:
                print(f"warning: skipping {path}: {error}", file=sys.stderr)
    if verbose:
        print(f"no checkpoint in {out_dir}: starting from scratch")
    return None


def resume(args, *, state=None, model=None, optimizer=None, scheduler=None, scaler=None, verbose=True, says=""):
    """Continue what --resume names (a checkpoint-epochNNNN.pt, or `state`: one a library's checkpoint held): its
    states into the objects given (each anything with load_state_dict(), or a function that takes the state), the
    RNGs, and, with verbose, one line saying so (+ `says`). Returns (epochs done, optimizer steps done, {epoch: the
    row a run stopped part-way through it saved}); (0, 0, {}) for a fresh start."""
    state = state or _find(args.resume, args.out_dir, args.arch, verbose)
    if state is None:
        return 0, 0, {}
    global_step = state["global_step"]
    try:
        for target, saved in ((model, state.get("model")), (optimizer, state.get("optimizer"))):
            if target is not None and saved is not None:
                getattr(target, "load_state_dict", target)(saved)
        steps_now = getattr(scheduler.lr_lambdas[0], "steps_per_epoch", None) if scheduler is not None else None
        steps_then = _steps_per_epoch(state)
        if scheduler is not None and state.get("scheduler") is not None and steps_then in (None, steps_now):
            scheduler.load_state_dict(state["scheduler"])
        elif scheduler is not None:  # other batch arithmetic, or no schedule saved (05's)
            global_step = _by_progress(state, steps_then, steps_now)
            scheduler.last_epoch = global_step  # where the schedule would be after that many steps
            for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group["lr"] = base_lr * factor(global_step)
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        if scaler is not None and state.get("scaler"):  # {} = saved by a disabled (bf16/fp32) scaler
            getattr(scaler, "load_state_dict", scaler)(state["scaler"])
    except (RuntimeError, ValueError, KeyError) as error:
        raise UserError(f"the checkpoint does not fit this model/optimizer ({brief(str(error).splitlines()[0])}); "
                        "check --arch and that it was written by this collection") from None
    _restore_rng(state["rng"])
    row = state.get("metrics") or {}
    if verbose:
        where = (f"step {row['steps']} of {row['of_steps']} in epoch {row['epoch']}" if row.get("partial")
                 else f"epoch {state['epoch']}")
        weights_only = ": weights only, momentum starts from zero" if optimizer is None and model is not None else ""
        print(f"resumed from {where} (written by {state.get('step', 'an earlier run')}){says}{weights_only}")
    return state["epoch"], global_step, ({row["epoch"]: row} if row.get("partial") else {})


def _steps_per_epoch(state):
    """Optimizer steps per epoch of the run that wrote `state` (None where it cannot tell)."""
    row = state.get("metrics") or {}
    if "of_steps" in row or "steps" in row:
        return row.get("of_steps", row.get("steps"))
    return state["global_step"] // state["epoch"] if state["epoch"] else None


def _by_progress(state, steps_then, steps_now):
    """Where a run with steps_now steps per epoch stands after the checkpoint's progress: its epochs done (and
    the done fraction of a part-way epoch), not its raw step count, which counts another batch arithmetic."""
    if steps_then is None or steps_now is None or steps_then == steps_now:
        return state["global_step"]
    row = state.get("metrics") or {}
    part = min(round(row["steps"] * steps_now / steps_then), steps_now - 1) if row.get("partial") else 0
    step = state["epoch"] * steps_now + part
    if rank() == 0 and state.get("processes", processes()) == processes():  # else settings() said it
        print(f"note: the checkpoint ran {steps_then} optimizer steps per epoch, this run {steps_now}: the "
              f"learning-rate schedule continues by progress, at step {step} (epochs done: {state['epoch']}), "
              f"not at the checkpoint's step {state['global_step']}")
    return step


class Settings:
    """What settings() found: the settings to take, or the error to stop with; apply(args) does either."""

    def __init__(self, values=None, error=None):
        self.values, self.error = values or {}, error

    def apply(self, args):
        if self.error:
            raise UserError(self.error)
        for name, value in self.values.items():
            setattr(args, name, value)


def settings(args):
    """Make --out-dir this run's (the refusal, --overwrite's deletions, leftovers), and with --resume find the settings
    of the run it continues: every setting not typed on the command line (args.given) comes from the checkpoint, so
    `--resume auto` alone continues it. Reads files: in a job of several processes, rank 0 calls it and shares the
    result, so that hosts without a shared disk agree. Returns Settings; apply(args) on every rank."""
    try:
        values = _settings_to_continue(args)
        make_out_dir(args.out_dir, args.resume, args.overwrite)
        return Settings(values)
    except UserError as error:
        return Settings(error=str(error))


def _settings_to_continue(args):
    """{setting: value} of the checkpoint's run that this run takes; a typed --arch that differs stops. A new number of
    processes is announced with the global batch before and after. A folder of DeepSpeed's or FSDP's own checkpoints:
    the settings of the checkpoint-epochNNNN.pt beside it."""
    if not args.resume or (args.resume == "auto" and args.overwrite):  # nothing to continue, or a new start
        return {}
    found = list_checkpoints(args.out_dir) if args.resume == "auto" else [_export_of(args.resume)]
    for path in found:
        if path is not None:
            try:
                state = load(path, mmap=True)  # only the small values are read
                break
            except UserError:
                if args.resume != "auto":
                    raise
    else:
        return {}  # nothing to continue: resume() says so, or which files it skipped
    if "arch" in args.given and args.arch != state["arch"]:
        raise UserError(f"--arch {args.arch} contradicts {path}, which holds a {state['arch']} model: "
                        f"drop --arch to continue it, or start a new run in another --out-dir")
    values = {name: value for name, value in {**state.get("args", {}), "arch": state["arch"]}.items()
              if name not in args.given and name not in OWN_SETTINGS and hasattr(args, name)}
    saved_epochs = state.get("args", {}).get("epochs")
    if "epochs" in args.given and saved_epochs and args.epochs != saved_epochs:
        print(f"note: --epochs {args.epochs}, the checkpoint's run had {saved_epochs}: the learning-rate schedule is "
              f"stretched to {args.epochs} epochs from where the run stands (not started again)")
    before, now = state.get("processes"), processes()
    if before and before != now:
        saved = state.get("args", {})
        batch_then = saved.get("batch_size", 0) * before * saved.get("grad_accum", 1)
        batch_now = values.get("batch_size", args.batch_size) * now * values.get("grad_accum", args.grad_accum)
        print(f"note: the checkpoint's run had {before} process{'es' * (before != 1)} (global batch {batch_then}), "
              f"this one has {now} (global batch {batch_now}): "
              + ("the learning-rate schedule continues by progress (epochs done), not by step count"
                 if batch_then != batch_now else "the same global batch, the learning-rate schedule goes on as it was"))
    return values


def _export_of(resume):
    """--resume PATH: that file; for a folder of DeepSpeed's or FSDP's own checkpoints (ds_checkpoints/ or dcp/, or one
    epochNNNN folder in it) the checkpoint-epochNNNN.pt that 05 and 08 write beside it (None if there is none)."""
    if not os.path.isdir(resume):
        return resume
    folder = os.path.abspath(resume)
    if TAG.fullmatch(os.path.basename(folder)):
        name, out_dir = os.path.basename(folder), os.path.dirname(os.path.dirname(folder))
    else:
        names = sorted(n for n in os.listdir(folder) if TAG.fullmatch(n))
        name, out_dir = (names[-1] if names else None), os.path.dirname(folder)
    path = os.path.join(out_dir, f"checkpoint-{name}.pt")
    return path if name and os.path.isfile(path) else None


def weights_digest(model_state):
    """SHA-256 over every tensor of a state_dict (names, dtypes, shapes and exact bytes)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(model_state):
        tensor = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_digest(out_dir, rank, model_state):
    """Write out_dir/weights-rankN.sha256: equal files mean bit-identical weights."""
    path = os.path.join(out_dir, f"weights-rank{rank}.sha256")
    os.makedirs(out_dir, exist_ok=True)  # a rank on another host than rank 0 (no shared disk) has no folder yet
    with open(path, "w") as f:
        f.write(weights_digest(model_state) + "\n")
    return path


def earlier_run(out_dir):
    """The checkpoints (file and folder names, newest file first) that out_dir holds."""
    held = [os.path.basename(path) for path in list_checkpoints(out_dir)]
    return held + [f"{name}/" for name in (ENGINE_DIR, DCP_DIR) if os.path.isdir(os.path.join(out_dir, name))
                   and os.listdir(os.path.join(out_dir, name))]


def make_out_dir(out_dir, resume=None, overwrite=False):
    """Check that --out-dir can be written before any training time is spent. A run owns its folder: one that holds
    another run's checkpoints is refused (with the fix) unless this run continues it (--resume auto, or --resume of its
    newest checkpoint) or replaces it (--overwrite)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out-dir {out_dir} is a file: pass a folder")
    held = earlier_run(out_dir) if os.path.isdir(out_dir) else []
    inside = resume not in (None, "auto") and os.path.realpath(resume).startswith(os.path.realpath(out_dir) + os.sep)
    if held and overwrite:
        if inside:
            raise UserError(f"--overwrite would delete --resume {resume}: copy it out of {out_dir} first")
        print(f"--overwrite: replacing the run in {out_dir} ({held[0]} and its metrics)")
        for name in held + [ENGINE_DIR, DCP_DIR, "metrics.jsonl", "training_curves.png"]:
            path = os.path.join(out_dir, name)
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    elif held and resume is None:
        raise UserError(f"--out-dir {out_dir} already holds a run ({held[0]}): continue it with --resume auto, "
                        "write to another --out-dir, or replace it with --overwrite")
    elif held and resume != "auto" and not (inside and (os.path.isdir(resume) or os.path.basename(resume) == held[0])):
        raise UserError(f"--out-dir {out_dir} already holds a run ({held[0]}); continuing {resume} there would mix "
                        "two runs (and the newest-3 rule would delete the new checkpoints): pass another --out-dir, "
                        "or --overwrite to replace that run")
    # Leftovers: saves killed before their rename, and the weight digests of an earlier run (which, from a run with
    # more processes, would claim a disagreement with this run's).
    for pattern in ("checkpoint-epoch*.pt.tmp-*", "weights-rank*.sha256"):
        for leftover in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            with contextlib.suppress(OSError):
                os.remove(leftover)
    # Writable? The folder itself is made by the first write (a run stopped by bad input before then leaves none).
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    why = "Not a directory" if not os.path.isdir(existing) else None if os.access(existing, os.W_OK | os.X_OK) \
        else "Permission denied"
    if why:
        raise UserError(f"--out-dir {out_dir} is not writable ({why}): pick another folder")
