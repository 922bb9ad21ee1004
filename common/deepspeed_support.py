"""What step 05 needs around DeepSpeed that is not the lesson: a quiet import, config reading, checkpoint mechanics.

* load(): import DeepSpeed (one line with the fix if it is missing), with the CPU named up front (else every
  process warns that it found no GPU), the C++ op that only inference's all-reduce uses marked unavailable on the
  CPU (else the first run compiles it for 30-90 s of silence), and two known warnings filtered: torch's
  deprecation of two collectives ZeRO calls (under ZeRO-3, every step) and "untested optimizer" for torch's SGD.
* config(), read_config(), set_precision(): ds_config.json as a dict, with one-line errors; the command line
  (batch, accumulation, lr, ZeRO stage, --amp) written into it.
* load_weights(): a checkpoint-epochNNNN.pt's weights into the model before the engine is built.
* export_weights(): the fp32 weights gathered from the ZeRO shards, for checkpoint-epochNNNN.pt.
* engine_checkpoint() / load_engine(): which engine checkpoint --resume names, and loading it with one-line errors.
"""
import glob
import json
import os
import shutil
import sys
import warnings

import torch
import torch.nn as nn

from .checkpoint import ENGINE_DIR, find_resume, restore, restore_rng, superseded
from .cli import UserError, brief

VERSION = "0.19.8"  # as pinned in requirements.txt
KNOWN_NOISE = ("**** You are using ZeRO with an untested optimizer",)


def load():
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    if not torch.accelerator.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "OMP_NUM_THREADS" not in os.environ:  # the deepspeed launcher does not set it (torchrun does): share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    try:
        import deepspeed
    except ImportError as error:
        reason = brief(str(error).strip().splitlines()[0], 120)
        raise UserError(f"DeepSpeed is not importable by {sys.executable} ({reason}): install it with "
                        f"`{sys.executable} -m pip install deepspeed=={VERSION}`") from None
    if not torch.accelerator.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.addFilter(lambda record: not record.getMessage().startswith(KNOWN_NOISE))
    return deepspeed


def read_config(path, default):
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as error:
        raise UserError(f"--deepspeed_config {path}: {error.strerror}; pass a DeepSpeed config such as {default}") \
            from None
    except json.JSONDecodeError as error:
        raise UserError(f"--deepspeed_config {path} is not valid JSON ({error})") from None
    if not isinstance(config, dict) or "optimizer" not in config:
        raise UserError(f"{path} has no \"optimizer\" block: the engine builds the optimizer from the config here "
                        f"(copy the one in {default})")
    config.pop("train_batch_size", None)  # micro batch x accumulation x processes: DeepSpeed derives it
    return config


def config(args, default, amp_dtype):
    """--deepspeed_config as a dict with the command line written in: the micro batch, accumulation, learning rate,
    --zero-stage (if given) and --amp (set_precision)."""
    config = read_config(args.deepspeed_config, default)
    config.update(train_micro_batch_size_per_gpu=args.batch_size, gradient_accumulation_steps=args.grad_accum)
    config["optimizer"].setdefault("params", {})["lr"] = args.lr
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    set_precision(config, amp_dtype)
    return config


def load_weights(args, model):
    """--resume of a checkpoint-epochNNNN.pt (any step's): its weights into the plain model, before the engine shards
    it; the epoch it ends (0: none, or --resume names an engine checkpoint, which the engine loads itself)."""
    if engine_checkpoint(args.resume, args.out_dir) is not None:
        return 0
    state = find_resume(args.resume, args.out_dir, args.arch, verbose=torch.distributed.get_rank() == 0)
    if state is None:
        return 0
    epoch, _ = restore(state, model=model)
    if torch.distributed.get_rank() == 0:
        print(f"resumed from epoch {epoch} (written by {state['step']}): weights only, momentum starts from zero")
    return epoch


def set_precision(config, amp_dtype):
    """Write --amp into the config: the engine keeps 16-bit weights with fp32 master copies (fp16 with loss scaling)
    instead of autocast. Our models normalise the images with buffers, so buffers take that dtype too (DeepSpeed
    casts them only when told to)."""
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16", None: "fp32"}[amp_dtype]
    for key in ("bf16", "fp16"):
        config.setdefault(key, {})["enabled"] = precision == key
    if amp_dtype is None:
        config.get("data_types", {}).pop("buffer_dtype", None)
    else:
        config.setdefault("data_types", {})["buffer_dtype"] = precision


def export_weights(engine):
    """The whole model as a plain fp32 state_dict, gathered from the ZeRO shards of all ranks.
    Collective: every rank must call it, and every rank gets the whole model."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}  # ZeRO 0 with bf16/fp16 keeps the fp32 master weights in its optimizer wrapper
    if engine.zero_optimization_stage() == 0 and hasattr(engine.optimizer, "fp32_groups"):
        for low, high in zip(engine.optimizer.fp16_groups, engine.optimizer.fp32_groups):
            masters.update({id(weight): master for weight, master in zip(low, high)})
    state = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):  # ZeRO 1-3: the fp32 master, all-gathered; ZeRO 0: master or weight
            full = safe_get_full_fp32_param(tensor)
            tensor = full if full is not None else masters.get(id(tensor), tensor)
        # Buffers (batch-norm statistics) are never partitioned; stored as fp32 like the weights.
        state[name] = (tensor.detach().float() if tensor.is_floating_point() else tensor.detach()).cpu().clone()
    return state


def prune(folder, keep=3):
    """Keep the newest `keep` epoch folders of the engine's checkpoints, and of the part-way ones (epochNNNN-stepSSSSSS)
    only the newest folder, like checkpoint-epoch*.pt. Tags sort in training order."""
    for old in superseded(sorted((name for name in os.listdir(folder) if name.startswith("epoch")), reverse=True), keep):
        shutil.rmtree(os.path.join(folder, old), ignore_errors=True)


def engine_checkpoint(resume, out_dir):
    """The engine checkpoint --resume names, as (folder, tag); None if it names none.
    auto: the newest in --out-dir (its `latest` file); PATH: that folder, or one epoch folder in it."""
    if resume == "auto":
        folder = os.path.join(out_dir, ENGINE_DIR)
        return (folder, None) if os.path.isfile(os.path.join(folder, "latest")) else None
    if resume is None or not os.path.isdir(resume):
        return None
    path = os.path.abspath(resume)
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    if not any(name.endswith("model_states.pt") for name in os.listdir(path)):
        raise UserError(f"--resume {resume}: not a DeepSpeed checkpoint (no `latest` file, no *model_states.pt); "
                        f"pass its {ENGINE_DIR} folder, one epoch folder in it, or a checkpoint-epochNNNN.pt")
    return os.path.split(path)


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def load_engine(engine, found, resume, step):
    """engine.load_checkpoint(*found): every rank reads its shard of weights and optimizer state, the schedule and
    our client_state (whose RNG state it restores). Returns (folder, client_state); errors in one line."""
    folder, tag = found
    tag = tag or _read(os.path.join(folder, "latest"))
    shards = len(glob.glob(os.path.join(glob.escape(os.path.join(folder, tag or "")), "*zero_pp_rank_*_optim_states.pt")))
    if shards and shards != torch.distributed.get_world_size():  # DeepSpeed's own message is long and cut short
        export = os.path.join(os.path.dirname(folder), f"checkpoint-{tag}.pt")
        raise UserError(f"the DeepSpeed checkpoint {os.path.join(folder, tag)} holds the optimizer state of "
                        f"{shards} processes, this run has {torch.distributed.get_world_size()}; DeepSpeed cannot "
                        "re-partition SGD's state (its universal checkpoint converts Adam's only): start "
                        f"{shards} processes, or continue from the weights with --resume {export} "
                        "(the momentum starts again)")
    try:
        path, client = engine.load_checkpoint(*found)
    except Exception as error:  # a checkpoint of another ZeRO stage or world size fails deep inside DeepSpeed
        reason = brief(": ".join(filter(None, [type(error).__name__, str(error)])))
        raise UserError(f"cannot load the DeepSpeed checkpoint in {os.path.join(*filter(None, found))} ({reason}); "
                        "resume with the ZeRO stage and number of processes that wrote it, or continue from its "
                        "checkpoint-epochNNNN.pt (weights only)") from None
    if path is None or "epoch" not in (client or {}):
        raise UserError(f"--resume {resume}: no DeepSpeed checkpoint of {step} there (expected a folder written "
                        "by it, holding `latest` or *model_states.pt)")
    restore_rng(client["rng"])
    return os.path.dirname(path), client
