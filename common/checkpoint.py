"""The one checkpoint format every step writes and reads, and continuing a run from it.
checkpoint-epochNNNN.pt in --out-dir (NNNN epochs done; -stepSSSSSS for a run stopped SSSSSS
optimizer steps into the next epoch) is a torch.save'd dict, loaded with weights_only=True (a file
that would run code is refused): format, step (the script that wrote it), arch, model (the bare
model's state_dict), optimizer (its state_dict, or None), scheduler, scaler, epoch (done),
global_step, rng (CPU and accelerator generators), args (the run's plain settings), processes,
metrics (the epoch's metrics.jsonl row, or a part-way epoch's so far) and synthetic. The newest 3
are kept (of the part-way ones only the newest), each written to a temporary file and renamed into
place: a crash, even SIGKILL during the save, never leaves a truncated file under a checkpoint name.
Tensors are saved in the plain layout."""
import contextlib
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import typing

import torch
import torch.utils._pytree

from .cli import UserError, brief, processes, rank

# Files written before it was renamed say "cifar10-parallel/1": they are read the same way.
FORMAT = "parallel-steps/1"
ENGINE_DIR, DCP_DIR = "ds_checkpoints", "dcp"  # the libraries' own checkpoints (steps 05 and 08)
# Settings of this invocation and this machine, never taken from a checkpoint's run.
OWN_SETTINGS = {"resume", "out_dir", "overwrite", "stop_after", "spawn", "local_rank", "workers",
                "compile", "sync_bn", "fp16_allreduce", "dist_timeout", "deepspeed_config",
                "replicate", "profile"}
TAG = re.compile(r"epoch\d{4,}(?:-step\d{6,})?")  # one epoch's folder in ds_checkpoints/ or dcp/
PATTERN = re.compile(r"checkpoint-epoch(\d{4,})(?:-step(\d{6,}))?\.pt$")


def checkpoint_path(out_dir, epoch, row=None):
    """out_dir/checkpoint-epochNNNN.pt,
    or -stepSSSSSS.pt for epoch `epoch` stopped part-way (row["partial"])."""
    partial = (row or {}).get("partial")
    part = f"{epoch - 1:04d}-step{row['steps']:06d}" if partial else f"{epoch:04d}"
    return os.path.join(out_dir, f"checkpoint-epoch{part}.pt")


def rng_states():
    """The CPU generator's state, and the accelerator's (one per device) on a machine with one."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    module = torch.get_device_module(accelerator) if accelerator else None
    states = module and getattr(module, "get_rng_state_all", lambda: [module.get_rng_state()])()
    device = {"type": accelerator.type, "states": states} if module else None
    return {"torch": torch.get_rng_state(), "device": device}


def _restore_rng(rng):
    torch.set_rng_state(rng["torch"])
    # Older files say "cuda".
    saved = rng.get("device") or (rng.get("cuda") and {"type": "cuda", "states": rng["cuda"]})
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if (saved and accelerator and saved["type"] == accelerator.type
            and len(saved["states"]) == torch.accelerator.device_count()):
        module = torch.get_device_module(accelerator)
        getattr(module, "set_rng_state_all",
                lambda states: module.set_rng_state(states[0]))(saved["states"])


def _state(obj):
    """An optimizer's, scheduler's or scaler's state_dict(), or the state itself (or None)."""
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def save(out_dir, *, step, arch, epoch, global_step, model_state, optimizer=None, scheduler=None,
         scaler=None, args=None, metrics=None, synthetic=False, keep=3, rng=None, ran_on=None):
    """Write the checkpoint of epoch `epoch` (its row: `metrics`) atomically; keep the newest
    `keep`. Returns the path. The optimizer, scheduler and scaler: objects or their state_dicts;
    rng and ran_on (processes): this process's, unless given (scripts/dcp_to_pt.py)."""
    done = epoch - 1 if (metrics or {}).get("partial") else epoch
    items = vars(args).items() if args else ()
    plain = {k: v for k, v in items if isinstance(v, (str, int, float, bool)) or v is None}
    state = {"format": FORMAT, "step": step, "arch": arch, "model": model_state,
             "optimizer": _state(optimizer), "scheduler": _state(scheduler),
             "scaler": _state(scaler), "epoch": done, "global_step": global_step,
             "rng": rng or rng_states(), "processes": ran_on or processes(),
             "metrics": metrics or {}, "synthetic": bool(synthetic), "args": plain}
    # --channels-last keeps NHWC.
    state = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.contiguous, state)
    path = checkpoint_path(out_dir, epoch, metrics)
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(out_dir, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself is durable
        finally:
            os.close(folder)
    except (OSError, RuntimeError) as error:
        # torch's zip writer reports a full disk as a RuntimeError.
        strerror = isinstance(error, OSError) and error.strerror
        reason = strerror or "the write failed: disk full?"
        raise UserError(f"cannot write checkpoint {path} ({reason}); the previous checkpoints are "
                        "untouched: free disk space or pick a writable --out-dir, then "
                        "--resume auto") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    # Newest first; a part-way checkpoint is superseded by any newer one.
    found = list_checkpoints(out_dir)
    for old in found[keep:] + [name for name in found[1:keep] if "-step" in os.path.basename(name)]:
        os.remove(old)
    return path


def list_checkpoints(out_dir):
    """Checkpoint files in out_dir, newest first (a part-way one after the epochs it completed)."""
    paths = glob.glob(os.path.join(out_dir, "checkpoint-epoch*.pt"))
    found = [(int(m.group(1)), int(m.group(2) or 0), p) for p in paths
             if (m := PATTERN.search(os.path.basename(p)))]
    return [p for _, _, p in sorted(found, reverse=True)]


def load(path, arch=None, mmap=False):
    """Load and validate a checkpoint of this collection; any problem is one UserError with the fix
    (mmap: map it)."""
    if os.path.isdir(path):
        raise UserError(_not_a_file(path))
    if not os.path.isfile(path):
        raise UserError(f"--resume {path}: no such file (use --resume auto to pick the newest "
                        "checkpoint in --out-dir)")
    fix = "pass a checkpoint-epochNNNN.pt written by one of the numbered scripts"
    with open(path, "rb") as f:
        # torch.save writes a zip (old torch: a pickle).
        if (head := f.read(4)) != b"PK\x03\x04" and head[:1] != b"\x80":
            raise UserError(f"{path} is not a checkpoint (not a file written by torch.save): {fix}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        if unsafe:
            raise UserError(f"refusing to load {path}: it would run code ({unsafe.group(1)}), "
                            f"which torch.load(weights_only=True) does not allow; {fix}") from None
        raise UserError(f"{path} is not a readable checkpoint (damaged or not a torch file): "
                        "resume from an older checkpoint-epoch*.pt") from None
    except Exception as error:  # truncated zip, not a torch file at all, unreadable
        raise UserError(f"{path} is not a readable checkpoint ({type(error).__name__}: "
                        f"{brief(error, 160)}); it may be truncated or corrupt: resume from an "
                        "older checkpoint-epoch*.pt") from None
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, "cifar10-parallel/1"):
        raise UserError(f"{path} is not a checkpoint of this collection (expected format "
                        f"{FORMAT!r}); {fix}")
    if arch is not None and state["arch"] != arch:
        raise UserError(f"{path} holds a {state['arch']} model but this run uses --arch {arch}: "
                        f"pass --arch {state['arch']}")
    return state


def _newest(folder):
    """The newest epoch's folder in ds_checkpoints/ or dcp/, or `folder` if it is one epoch's."""
    if TAG.fullmatch(os.path.basename(os.path.normpath(folder))):
        return folder
    return os.path.join(folder, max((n for n in os.listdir(folder) if TAG.fullmatch(n)),
                                    default="none"))


def dcp_folders(out_dir):
    """Step 08's complete DCP checkpoints in out_dir (dcp/epochNNNN[-stepSSSSSS]; a save still
    being written, or killed, is epochNNNN.tmp), newest first."""
    return sorted(glob.glob(os.path.join(glob.escape(out_dir), DCP_DIR, "epoch*[0-9]")),
                  reverse=True)


def dcp_header(folder):
    """The plain values step 08 writes beside a DCP checkpoint (position.json: its run's settings,
    as a .pt holds them, and its position), what settings() needs of it."""
    try:
        with open(os.path.join(folder, "position.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as error:  # not 08's, or damaged
        raise UserError(f"{folder} has no readable position.json of step 08 ({error}); resume "
                        "an older one") from None


def _beside(folder):
    """The checkpoint-epochNNNN.pt that 05 or 08 writes with a folder of its own checkpoints (or
    with their newest), whether it is there or not."""
    epoch = os.path.abspath(_newest(folder))
    return os.path.join(os.path.dirname(os.path.dirname(epoch)),
                        f"checkpoint-{os.path.basename(epoch)}.pt")


def library_folder(path):
    """(kind, the folder to resume) of a folder of the libraries' own checkpoints, or (None, path):
    "deepspeed", 05's engine checkpoint (ds_checkpoints/ with its `latest` file, or one epoch's
    folder of *model_states.pt); "dcp", 08's torch.distributed.checkpoint shards (a folder with a
    .metadata file, or dcp/ holding them: the newest)."""
    path = os.path.normpath(path)
    if (os.path.isfile(os.path.join(path, "latest"))
            or glob.glob(os.path.join(glob.escape(path), "*model_states.pt"))):
        return "deepspeed", path
    for folder in (path, _newest(path)):
        if os.path.isfile(os.path.join(folder, ".metadata")):
            return "dcp", folder
    return None, path


def _not_a_file(path):
    """load()'s line for a folder: 05's or 08's own checkpoint, which only that step resumes (any
    step resumes the checkpoint-epochNNNN.pt it writes beside it), or some other folder."""
    kind, folder = library_folder(path)
    if kind is None:
        return (f"--resume {path} is a folder, not a checkpoint file: pass a "
                "checkpoint-epochNNNN.pt, or --resume auto to pick the newest in --out-dir")
    step, script = ("05", "05_cifar10_deepspeed.py") if kind == "deepspeed" else (
        "08", "08_cifar10_fsdp.py")
    beside = _beside(folder)
    shown = f"the checkpoint-epochNNNN.pt that {step} wrote into the same --out-dir"
    if os.path.isfile(beside):
        shown = beside if os.path.relpath(beside).startswith(os.pardir) else os.path.relpath(beside)
    elif kind == "dcp":  # 08 writes it at the end of a run: after a crash, the converter
        shown = f"the file `python scripts/dcp_to_pt.py {_newest(folder)}` makes of it"
    which = "it" if folder == os.path.normpath(path) else folder
    if kind == "deepspeed":
        return (f"--resume {path} is a DeepSpeed checkpoint folder (step 05's engine checkpoint), "
                f"which only {script} resumes: resume {which} with that step, or continue with "
                f"this one from {shown} (its weights; momentum starts from zero)")
    # dcp_to_torch of torch.distributed.checkpoint.format_utils makes a plain torch file of the
    # folder, not a checkpoint of this format: not offered.
    return (f"--resume {path} is a DCP checkpoint folder (step 08's torch.distributed.checkpoint "
            f"shards), which only {script} resumes: resume {which} with that step, or continue "
            f"with this one from {shown} (the same epoch, gathered into one file)")


def _find(resume, out_dir, arch, verbose):
    """`--resume`: None -> None; 'auto' -> the newest
    readable checkpoint in out_dir (None if none); a path."""
    if resume != "auto":
        return None if resume is None else load(resume, arch)
    found = list_checkpoints(out_dir)
    for path in found:
        try:
            return load(path, arch)
        except UserError as error:
            if path == found[-1]:  # none can be continued: never start over silently on top
                raise UserError(f"--resume auto: no checkpoint in {out_dir} can be continued by "
                                f"this run ({error}); or use another --out-dir, or --overwrite "
                                "to replace that run") from None
            if verbose:
                print(f"warning: skipping {path}: {error}", file=sys.stderr)
    if verbose:
        print(f"no checkpoint in {out_dir}: starting from scratch")


def find(args, verbose=True):
    """The checkpoint --resume names (auto: the newest readable one in --out-dir), loaded; {} if
    there is none to continue; {"error": its line} if it cannot be continued, which resume() raises
    on every rank. Rank 0 calls it and sends what it found to the others, whose disks may hold
    another --out-dir or none."""
    try:
        return _find(args.resume, args.out_dir, args.arch, verbose) or {}
    except UserError as error:
        return {"error": str(error)}


def position(progress, model_state):
    """What every rank must hold after resume, to compare across the ranks (agree): resume()'s
    (epochs done, optimizer steps) and a digest of the weights and buffers."""
    return progress[0], progress[1], weights_digest(model_state)


def agree(positions):
    """positions: every rank's position(), in rank order (an all-gather's). One UserError, on every
    rank, naming the ranks that differ from rank 0."""
    other = [rank for rank, found in enumerate(positions) if found != positions[0]]
    if other:
        epoch, steps, _ = positions[other[0]]
        raise UserError(f"after resume, rank(s) {', '.join(map(str, other))} hold another state "
                        f"than rank 0 (rank {other[0]}: epoch {epoch}, step {steps}; rank 0: "
                        f"epoch {positions[0][0]}, step {positions[0][1]}; or other weights): "
                        "every rank must start from the checkpoint rank 0 chose "
                        "(docs/checkpoints.md)")


def check_seen(seen, folder, kind):
    """seen: every rank's whether it sees `folder`, the `kind` checkpoint rank 0 chose (written as
    files per rank). One UserError, on every rank, naming those that do not."""
    missing = [rank for rank, found in enumerate(seen) if not found]
    if missing:
        raise UserError(f"rank(s) {', '.join(map(str, missing))} cannot see {folder}, the {kind} "
                        "checkpoint rank 0 resumes: its files are written per rank and read where "
                        "they were written, so put --out-dir on storage every machine reads, or "
                        "copy the folder to the same path on each machine first (rsync -a, "
                        "docs/checkpoints.md)")


def resume(args, *, state=None, model=None, optimizer=None, scheduler=None, scaler=None,
           verbose=True, says=""):
    """Continue what --resume names (or `state`: the checkpoint rank 0 found and sent, {} for none,
    or one a library's own load gave): its states
    into the objects given (each with load_state_dict(), or a function that takes the state), and
    the RNGs; with verbose, one line says so (+ `says`). Returns (epochs done, optimizer steps done,
    {epoch: the row of a run stopped part-way in it}), or (0, 0, {}). Under other batch arithmetic a
    LambdaLR schedule goes on by progress (epochs done), not step count."""
    if state is None:
        state = find(args, verbose)
    if "error" in state:
        raise UserError(state["error"])
    if not state:
        return 0, 0, {}
    row, global_step = state.get("metrics") or {}, state["global_step"]
    try:
        for target, saved in ((model, state.get("model")), (optimizer, state.get("optimizer")),
                              (scaler, state.get("scaler"))):
            # A disabled scaler's state is {}.
            if target is not None and saved is not None and (saved or target is not scaler):
                getattr(target, "load_state_dict", target)(saved)
        groups = getattr(optimizer, "param_groups", ())
        for p in [p for g in groups for p in g["params"] if p in optimizer.state]:
            # Saved plainly: each state tensor takes its parameter's layout again.
            optimizer.state[p].update({k: torch.empty_like(p, dtype=v.dtype).copy_(v)
                                       for k, v in optimizer.state[p].items() if k != "step"
                                       and torch.is_tensor(v) and v.shape == p.shape})
        global_step = _continue_schedule(scheduler, state, row, global_step)
    except (RuntimeError, ValueError, KeyError) as error:
        cause = brief(str(error).splitlines()[0])
        raise UserError(f"the checkpoint does not fit this model/optimizer ({cause}); check --arch "
                        "and that it was written by this collection") from None
    _restore_rng(state["rng"])
    if verbose:
        where = (f"step {row['steps']} of {row['of_steps']} in epoch {row['epoch']}"
                 if row.get("partial") else f"epoch {state['epoch']}")
        # Step 05 reads, or wrote, weights only.
        weights = model is not None and None in (optimizer, state.get("optimizer"))
        print(f"resumed from {where} (written by {state.get('step', 'an earlier run')}){says}"
              + ": weights only, momentum starts from zero" * weights)
    return state["epoch"], global_step, ({row["epoch"]: row} if row.get("partial") else {})


def _continue_schedule(scheduler, state, row, global_step):
    """resume()'s schedule: the saved one where the batch arithmetic is the same, else placed by
    progress (epochs done) for this run's steps per epoch. Returns the optimizer steps done."""
    if scheduler is None:
        return global_step
    first = scheduler.lr_lambdas[0]
    steps_now = getattr(first, "steps_per_epoch", None)
    steps_then = row.get("of_steps", row.get("steps")) or (
        global_step // state["epoch"] if state["epoch"] else None)
    if state.get("scheduler") and steps_then in (None, steps_now):
        scheduler.load_state_dict(state["scheduler"])
    else:  # other batch arithmetic, or no schedule saved (05's)
        if steps_then and steps_now and steps_then != steps_now:
            part = (min(round(row["steps"] * steps_now / steps_then), steps_now - 1)
                    if row.get("partial") else 0)
            global_step, before = state["epoch"] * steps_now + part, global_step
            # With another number of processes, settings() said it already.
            if rank() == 0 and state.get("processes", processes()) == processes():
                print(f"note: the checkpoint ran {steps_then} optimizer steps per epoch, this "
                      f"run {steps_now}: the learning-rate schedule continues by progress, at "
                      f"step {global_step} (epochs done: {state['epoch']}), not at the "
                      f"checkpoint's step {before}")
        scheduler.last_epoch = global_step  # where the schedule is after that many steps
        for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                          scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(global_step)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return global_step


class Settings(typing.NamedTuple):
    """What settings() found: the settings to take, or the error to stop with;
    apply(args) does either."""
    values: dict = {}  # read only
    error: str = None

    def apply(self, args):
        if self.error:
            raise UserError(self.error)
        for name, value in self.values.items():
            setattr(args, name, value)


def settings(args):
    """Make --out-dir this run's (make_out_dir), and with --resume find the settings of the run it
    continues: every setting not typed (args.given) comes from the checkpoint, so `--resume auto`
    alone continues it. It reads files: rank 0 calls it and shares the result, so that hosts without
    a shared disk agree; apply(args) on every rank."""
    try:
        values = _settings_to_continue(args)
        make_out_dir(args.out_dir, args.resume, args.overwrite)
        return Settings(values)
    except UserError as error:
        return Settings({}, str(error))


def _settings_to_continue(args):
    """{setting: value} of the checkpoint's run; a typed --arch that differs stops; a new number of
    processes or of --epochs is said in one line. A folder of 05's or 08's own checkpoints: the
    checkpoint-epochNNNN.pt beside it."""
    # Nothing to continue, or a new start.
    if args.resume is None or (args.resume == "auto" and args.overwrite):
        return {}
    found = [args.resume]
    if args.resume == "auto":  # 08: its newest DCP folder first (after a crash, the only one)
        found = dcp_folders(args.out_dir)[:1] + list_checkpoints(args.out_dir)
    elif os.path.isdir(args.resume):
        # ds_checkpoints/ or dcp/ (its newest epoch's), or one epoch's folder in it.
        kind, folder = library_folder(args.resume)
        beside = _beside(args.resume)
        found = [folder] if kind == "dcp" else []  # 08's settings, beside its shards
        if os.path.isfile(beside):
            found.append(beside)
    for path in found:
        try:
            # only the small values are read
            state = dcp_header(path) if os.path.isdir(path) else load(path, mmap=True)
            break
        except UserError:
            if args.resume != "auto" and not os.path.isdir(args.resume):
                raise
    else:
        return {}  # nothing to continue: resume() says so, or which files it skipped
    if "arch" in args.given and args.arch != state["arch"]:
        raise UserError(f"--arch {args.arch} contradicts {path}, which holds a {state['arch']} "
                        "model: drop --arch to continue it, or start a new run in another "
                        "--out-dir")
    saved = state.get("args", {})
    values = {name: value for name, value in {**saved, "arch": state["arch"]}.items()
              if name not in args.given and name not in OWN_SETTINGS and hasattr(args, name)}
    if "epochs" in args.given and saved.get("epochs") and args.epochs != saved["epochs"]:
        print(f"note: --epochs {args.epochs}, the checkpoint's run had {saved['epochs']}: the "
              f"learning-rate schedule is stretched to {args.epochs} epochs from where the run "
              "stands (not started again)")
    before, now = state.get("processes"), processes()
    if before and before != now:
        batch_then = saved.get("batch_size", 0) * before * saved.get("grad_accum", 1)
        batch_now = (values.get("batch_size", args.batch_size) * now
                     * values.get("grad_accum", args.grad_accum))
        how = "the learning-rate schedule continues by progress (epochs done), not by step count"
        same = "the same global batch, the learning-rate schedule goes on as it was"
        print(f"note: the checkpoint's run had {before} process{'es' * (before != 1)} (global "
              f"batch {batch_then}), this one has {now} (global batch {batch_now}): "
              + (how if batch_then != batch_now else same))
    return values


def weights_digest(model_state):
    """SHA-256 over every tensor of a state_dict (names, dtypes, shapes and exact bytes)."""
    h = hashlib.sha256()
    for name in sorted(model_state):
        tensor = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_digest(out_dir, rank, model_state):
    """out_dir/weights-rankN.sha256: equal files mean bit-identical weights."""
    # A rank on another host than rank 0 (no shared disk) has no folder yet.
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"weights-rank{rank}.sha256"), "w") as f:
        f.write(weights_digest(model_state) + "\n")


def make_out_dir(out_dir, resume=None, overwrite=False):
    """Check --out-dir before training: writable, and not another run's (its checkpoints) unless
    this run continues it (--resume auto, or of its newest checkpoint or its own folders) or
    replaces it (--overwrite)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out-dir {out_dir} is a file: pass a folder")
    held = [os.path.basename(path) for path in list_checkpoints(out_dir)] + [
        f"{name}/" for name in (ENGINE_DIR, DCP_DIR) if os.path.isdir(os.path.join(out_dir, name))
        and os.listdir(os.path.join(out_dir, name))]
    inside = resume not in (None, "auto") and (
        os.path.realpath(resume).startswith(os.path.realpath(out_dir) + os.sep))
    if held and overwrite:
        if inside:
            raise UserError(f"--overwrite would delete --resume {resume}: "
                            f"copy it out of {out_dir} first")
        print(f"--overwrite: replacing the run in {out_dir} ({held[0]} and its metrics)")
        for name in held + [ENGINE_DIR, DCP_DIR, "metrics.jsonl", "training_curves.png"]:
            path = os.path.join(out_dir, name)
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    elif held and resume is None:
        raise UserError(f"--out-dir {out_dir} already holds a run ({held[0]}): continue it with "
                        "--resume auto, write to another --out-dir, or replace it with --overwrite")
    elif held and resume != "auto" and not (
            inside and (os.path.isdir(resume) or os.path.basename(resume) == held[0])):
        raise UserError(f"--out-dir {out_dir} already holds a run ({held[0]}); continuing {resume} "
                        "there would mix two runs (and the newest-3 rule would delete the new "
                        "checkpoints): pass another --out-dir, or --overwrite to replace that run")
    # Leftovers: saves killed before their rename,
    # an earlier run's weight digests (more ranks' would disagree).
    for leftover in [path for pattern in ("checkpoint-epoch*.pt.tmp-*", "weights-rank*.sha256")
                     for path in glob.glob(os.path.join(glob.escape(out_dir), pattern))]:
        with contextlib.suppress(OSError):
            os.remove(leftover)
    existing = os.path.abspath(out_dir)  # writable? the folder is made by the first write
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        reason = "Permission denied" if os.path.isdir(existing) else "Not a directory"
        raise UserError(f"--out-dir {out_dir} is not writable ({reason}): pick another folder")
