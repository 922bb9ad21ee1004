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
import functools
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import types
import typing
import warnings

import torch

from .cli import UserError, brief, processes, rank

# Files written before it was renamed say "cifar10-parallel/1": they are read the same way.
FORMAT = "parallel-steps/1"
# 05's and 08's own checkpoints: what they are, the step that resumes them, the .pt's converter.
ENGINE_DIR, DCP_DIR = "ds_checkpoints", "dcp"
OWN = {ENGINE_DIR: ("a DeepSpeed checkpoint folder (step 05's engine checkpoint)",
                    "05_cifar10_deepspeed.py", "ds_to_pt.py",
                    "its weights; momentum starts from zero"),
       DCP_DIR: ("a DCP checkpoint folder (step 08's torch.distributed.checkpoint shards)",
                 "08_cifar10_fsdp.py", "dcp_to_pt.py", "the same epoch, gathered into one file")}
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


def _plain_layout(obj):
    """Every tensor in nested dicts, lists and tuples, in the plain layout (--channels-last keeps
    NHWC)."""
    if torch.is_tensor(obj):
        return obj.contiguous()
    if isinstance(obj, dict):
        return {key: _plain_layout(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain_layout(value) for value in obj)
    return obj


def _with_run(args, row, state):
    """`state` with what every checkpoint holds added unless given: the run's arch, plain settings,
    epochs done, processes, random state and row."""
    plain = {k: v for k, v in vars(args).items()
             if isinstance(v, (str, int, float, bool)) or v is None}
    return {"format": FORMAT, "arch": args.arch, "scheduler": None, "scaler": None,
            "epoch": row["epoch"] - 1 if row.get("partial") else row["epoch"], "rng": rng_states(),
            "processes": processes(), "metrics": row, "synthetic": False, "args": plain, **state}


def save(args, row, state, keep=3):
    """Write the checkpoint of row's epoch (row: its metrics.jsonl row, or a part-way epoch's so
    far) into args.out_dir atomically; keep the newest `keep`. Returns the path. `state`: what the
    step saves (step, model, optimizer, scheduler and scaler state_dicts, global_step, synthetic);
    the run's arch, settings, epochs done, processes, random state (save_converted gives them)."""
    epoch, out_dir = row["epoch"], args.out_dir
    state = _plain_layout({"optimizer": None, **_with_run(args, row, state)})
    path = checkpoint_path(out_dir, epoch, row)
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


def _kind(folder):
    """ENGINE_DIR for a folder of 05's *model_states.pt, DCP_DIR for 08's .metadata, else None."""
    if glob.glob(os.path.join(glob.escape(folder), "*model_states.pt")):
        return ENGINE_DIR
    return DCP_DIR if os.path.isfile(os.path.join(folder, ".metadata")) else None


def own_folders(folder):
    """The complete checkpoints in 05's ds_checkpoints/ or 08's dcp/ `folder`, newest first:
    epochNNNN[-stepSSSSSS] with position.json and the library's files (05's rank 0 writes
    position.json after the engine's save, 08's DCP's .metadata after every rank's shards)."""
    names = sorted(os.listdir(folder), reverse=True) if os.path.isdir(folder) else []
    paths = [os.path.join(folder, name) for name in names if TAG.fullmatch(name)]
    return [path for path in paths
            if _kind(path) and os.path.isfile(os.path.join(path, "position.json"))]


def own_path(out_dir, row, library=DCP_DIR):
    """row's folder in out_dir/library (ENGINE_DIR, DCP_DIR): epochNNNN[-stepSSSSSS], as a .pt's."""
    name = os.path.basename(checkpoint_path(out_dir, row["epoch"], row))
    return os.path.join(out_dir, library, name.removeprefix("checkpoint-").removesuffix(".pt"))


def save_position(args, row, state, library=DCP_DIR, keep=3):
    """05's and 08's save(): position.json (a .pt's contents but what the library writes) in row's
    folder, which 08 makes afresh before its shards (DCP's writer may make it first), 05 after the
    engine's save. Unfinished and part-way folders are removed, the newest keep-1 complete kept."""
    folder = own_path(args.out_dir, row, library)
    kept = [old for old in own_folders(os.path.dirname(folder))
            if "-step" not in os.path.basename(old) and old != folder][:keep - 1]
    for old in glob.glob(os.path.join(glob.escape(os.path.dirname(folder)), "epoch*")):
        if old not in kept and (old != folder or library == DCP_DIR):
            shutil.rmtree(old, ignore_errors=True)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "position.json"), "w") as f:
            json.dump(_with_run(args, row, state), f, default=torch.Tensor.tolist)  # rng: lists
    except OSError as error:
        raise UserError(f"cannot write {folder} ({error.strerror}); the previous checkpoints are "
                        "untouched: free disk space or pick a writable --out-dir, then "
                        "--resume auto") from None
    return folder


def own_header(folder):
    """05's or 08's position.json (a .pt's contents but model and optimizer), as load() gives."""
    try:
        with open(os.path.join(folder, "position.json")) as f:
            position = json.load(f)
    except (OSError, ValueError) as error:  # not 05's or 08's, or damaged
        raise UserError(f"{folder} has no readable position.json of step 05 or 08 ({error}); "
                        "resume an older folder, or a checkpoint-epochNNNN.pt") from None
    if "rng" not in position:  # written by 08 before its random state moved here (2026-11-29)
        raise UserError(f"{folder} was written by an earlier step 08, which kept its random state "
                        "in the shards: continue it with that version, or start anew")
    rng, as_bytes = position["rng"], functools.partial(torch.tensor, dtype=torch.uint8)
    states = [as_bytes(state) for state in (rng["device"] or {}).get("states", ())]
    device = rng["device"] and {**rng["device"], "states": states}
    return {**position, "rng": {"torch": as_bytes(rng["torch"]), "device": device}}


def save_converted(folder, out_dir, state):
    """scripts/ds_to_pt.py's and dcp_to_pt.py's checkpoint-epochNNNN.pt of 05's or 08's `folder`:
    `state` (model, optimizer) with the run of its position.json (not this process's), into out_dir
    (None: the run's folder)."""
    position = own_header(folder)
    out_dir = out_dir or os.path.dirname(os.path.dirname(os.path.abspath(folder)))
    row = position["metrics"]
    path = save(types.SimpleNamespace(out_dir=out_dir, arch=position["arch"]), row,
                {**position, **state})
    print(f"wrote {path} ({position['step']}'s epoch {position['epoch']}"
          + (f", {row['steps']} steps into the next" if row.get("partial") else "") + ")")
    return path


def _beside(folder):
    """The checkpoint-epochNNNN.pt that scripts/ makes beside 05's or 08's epoch `folder`."""
    parent = os.path.dirname(os.path.dirname(os.path.abspath(folder)))
    return os.path.join(parent, f"checkpoint-{os.path.basename(folder)}.pt")


def library_folder(path):
    """(ENGINE_DIR or DCP_DIR, the folder to resume) of 05's or 08's own checkpoints: one epoch's,
    or the newest complete one in ds_checkpoints/ or dcp/ (else the newest); or (None, path)."""
    path = os.path.normpath(path)
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    newest = [os.path.join(path, name) for name in names if TAG.fullmatch(name)][-1:]
    folder = ([path] if _kind(path) else own_folders(path) or newest or [path])[0]
    return (_kind(folder), folder) if _kind(folder) else (None, path)


def _not_a_file(path):
    """load()'s line for a folder: 05's or 08's own checkpoint, which only that step resumes (any
    step resumes the .pt that its converter in scripts/ makes), or some other folder."""
    kind, folder = library_folder(path)
    if kind is None:
        return (f"--resume {path} is a folder, not a checkpoint file: pass a "
                "checkpoint-epochNNNN.pt, or --resume auto to pick the newest in --out-dir")
    what, script, converter, gained = OWN[kind]
    beside = _beside(folder)
    shown = f"the checkpoint-epochNNNN.pt that `python scripts/{converter} {path}` makes of it"
    if os.path.isfile(beside):
        shown = beside if os.path.relpath(beside).startswith(os.pardir) else os.path.relpath(beside)
    which = "it" if folder == os.path.normpath(path) else folder
    # 08's: torch's dcp_to_torch_save makes a plain torch file, not one of this format: not offered.
    return (f"--resume {path} is {what}, which only {script} resumes: resume {which} with that "
            f"step, or continue with this one from {shown} ({gained})")


def _find(resume, out_dir, arch, verbose):
    """--resume: None -> None; 'auto' -> the newest readable in out_dir (None if none); a path."""
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


def _find_own(resume, out_dir, own):
    """The folder in out_dir/own (05's or 08's) that --resume names (auto: the newest complete), as
    its position with "folder": the folder; or None."""
    folders = own_folders(os.path.join(out_dir, own)) if resume == "auto" else []
    if resume not in (None, "auto") and os.path.isdir(resume):
        kind, folder = library_folder(resume)
        folders = [folder] if kind == own else []
    return {**own_header(folders[0]), "folder": folders[0]} if folders else None


def find(args, verbose=True, own=None):
    """The checkpoint --resume names (auto: the newest readable in --out-dir; own: 05's or 08's
    folders first), loaded; {} if none; {"error": its line}, which resume() raises on every rank.
    Rank 0 calls it and sends it to the others, whose disks may hold another --out-dir or none."""
    try:
        found = _find_own(args.resume, args.out_dir, own) if own else None
        return found or _find(args.resume, args.out_dir, args.arch, verbose) or {}
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


def resume(state, model=None, optimizer=None, scheduler=None, scaler=None, verbose=True):
    """Continue `state`: the checkpoint that find() gave (on rank 0, sent to every rank), {} for
    none, or the position a library's own load gave. Its states go into the objects given (each
    with load_state_dict(), or a function that takes the state), and the RNGs; with verbose, one
    line says so. Returns (epochs done, optimizer steps done, {epoch: the row of a run stopped
    part-way in it}), or (0, 0, {}). Under other batch arithmetic a LambdaLR schedule goes on by
    progress (epochs done), not step count."""
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
        weights = None not in (model, state.get("model")) and None in (optimizer,
                                                                       state.get("optimizer"))
        print(f"resumed from {where} (written by {state.get('step', 'an earlier run')})"
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
        _place_schedule(scheduler, global_step)
    return global_step


def _place_schedule(scheduler, global_step):
    """Put a scheduler where `global_step` optimizer steps take it: its public step() sets every
    group's learning rate and get_last_lr() (a scheduler has no public setter for them). step()
    warns that it runs before optimizer.step(), which is the point here."""
    scheduler.last_epoch = global_step - 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()


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


def settings(args, own=None):
    """Make --out-dir this run's (make_out_dir), and with --resume find the settings of the run it
    continues: every setting not typed (args.given) comes from the checkpoint, so `--resume auto`
    alone continues it (own: 05's or 08's folders first). It reads files: rank 0 calls it and
    shares the result, so that hosts without a shared disk agree; apply(args) on every rank."""
    try:
        values = _settings_to_continue(args, own)
        make_out_dir(args.out_dir, args.resume, args.overwrite)
        return Settings(values)
    except UserError as error:
        return Settings({}, str(error))


def _settings_to_continue(args, own):
    """{setting: value} of the checkpoint's run; a typed --arch that differs stops; a new number of
    processes or of --epochs is said in one line. 05's or 08's folder: position.json, or the .pt."""
    # Nothing to continue, or a new start.
    if args.resume is None or (args.resume == "auto" and args.overwrite):
        return {}
    found = [args.resume]
    if args.resume == "auto":
        newest = own_folders(os.path.join(args.out_dir, own))[:1] if own else []
        found = newest + list_checkpoints(args.out_dir)
        others = [name for name in OWN if name != own
                  and own_folders(os.path.join(args.out_dir, name))]
        if others and not found:
            _, script, converter, _ = OWN[others[0]]
            raise UserError(f"--resume auto: {args.out_dir} holds {script[:2]}'s own checkpoints "
                            f"only ({others[0]}/), which only {script} resumes: continue with that "
                            "step, or with this one from the checkpoint-epochNNNN.pt that `python "
                            f"scripts/{converter} {os.path.join(args.out_dir, others[0])}` makes")
    elif os.path.isdir(args.resume):
        # ds_checkpoints/ or dcp/ (its newest epoch's), or one epoch's folder in it.
        kind, folder = library_folder(args.resume)
        found = [folder, _beside(folder)] if kind else []  # position.json, else a converted .pt
    for path in found:
        try:
            # only the small values are read
            state = own_header(path) if os.path.isdir(path) else load(path, mmap=True)
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
        events = [os.path.basename(path) for path in glob.glob(
            os.path.join(glob.escape(out_dir), "events.out.tfevents.*"))]
        for name in held + events + [ENGINE_DIR, DCP_DIR, "metrics.jsonl", "training_curves.png"]:
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
