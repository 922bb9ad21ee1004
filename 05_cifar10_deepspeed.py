"""Step 05: DeepSpeed: one engine owns the optimizer, precision and accumulation; ZeRO shards the state.

What changes from step 04: `deepspeed.initialize` wraps the model in an engine built from
ds_config.json (batch sizes, optimizer, LR schedule, bf16/fp16, gradient clipping, ZeRO stage);
a few command-line options override the file. The loop only calls engine(images),
engine.backward(loss) and engine.step(): the engine averages gradients across processes (as DDP
did), accumulates, clips, and steps the optimizer and the schedule. ZeRO stage 1 partitions the
optimizer state across the processes, stage 2 also the gradients, stage 3 also the weights, so each
process holds 1/N of them. Checkpoints: the engine's own (every rank writes its shard; --resume auto
continues from it bit for bit) and, every epoch, checkpoint-epochNNNN.pt in the common format (fp32
weights gathered from all shards), which steps 01-04 load.

    deepspeed --num_gpus 4 05_cifar10_deepspeed.py --deepspeed_config ds_config.json
    deepspeed --num_gpus 4 05_cifar10_deepspeed.py --zero-stage 3 --amp bf16   # override the config
    torchrun --nproc_per_node=4 05_cifar10_deepspeed.py
    deepspeed --hostfile hostfile 05_cifar10_deepspeed.py                        # several machines (README)
    python 05_cifar10_deepspeed.py                                               # one process, world size 1
"""
import argparse
import datetime
import gc
import itertools
import json
import os
import shutil
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from common import checkpoint, data, metrics, models
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int
from common.schedule import warmup_cosine

# DeepSpeed: torch calls two collectives that ZeRO uses deprecated; under ZeRO-3 the FutureWarning would repeat
# every step. Only these two are silenced.
warnings.filterwarnings("ignore", category=FutureWarning,
                        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
if not torch.cuda.is_available():  # DeepSpeed: name the CPU up front; else every process warns that it found no GPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import safe_get_full_fp32_param
except ImportError as error:  # DeepSpeed: an extra install, so it may be missing (see main)
    deepspeed, DEEPSPEED_IMPORT_ERROR = None, error

STEP = "05_cifar10_deepspeed"
WARMUP_EPOCHS = 1  # DeepSpeed: momentum 0.9 and weight decay 5e-4 of 01-04's SGD are in ds_config.json
LOG_EVERY = 20  # steps between progress-bar loss updates
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")  # DeepSpeed: the default config
ENGINE_DIR = "ds_checkpoints"  # DeepSpeed: the engine's checkpoints, a folder in --out-dir
# DeepSpeed: a warning every correct run prints (torch's own SGD is "untested" under ZeRO). It is filtered out; any
# other warning still shows.
KNOWN_NOISE = ("**** You are using ZeRO with an untested optimizer",)


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Step 05: CIFAR-10 with DeepSpeed (ZeRO 0-3), one process per GPU.")
    parser.add_argument("--data-dir", default="./data",
                        help="CIFAR-10 root holding cifar-10-batches-py/ (downloaded if missing; default ./data)")
    parser.add_argument("--out-dir", default=f"runs/{STEP}",
                        help=f"checkpoints, metrics.jsonl, training_curves.png (default runs/{STEP})")
    parser.add_argument("--epochs", type=positive_int, default=30, help="total epochs (default 30)")
    # DeepSpeed: --batch-size, --lr and --grad-accum default to ds_config.json; given, they override it.
    parser.add_argument("--batch-size", type=positive_int,
                        help="images per PROCESS per forward pass (train_micro_batch_size_per_gpu); global batch = "
                             "this x processes x --grad-accum (default: the config's, 128)")
    parser.add_argument("--lr", type=positive_float,
                        help="peak learning rate of SGD (optimizer.params.lr; default: the config's, 0.1)")
    parser.add_argument("--arch", choices=sorted(models.ARCHS), default="resnet18",
                        help="resnet18 (default) or cnn (small and fast, for smoke runs)")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for weights, order and augmentation")
    parser.add_argument("--resume", metavar="PATH|auto",  # DeepSpeed: engine checkpoints, or weights of any step
                        help="'auto' = the newest DeepSpeed checkpoint in --out-dir (exact continuation), else the "
                             "newest checkpoint-epochNNNN.pt there (weights only); PATH = a DeepSpeed checkpoint "
                             "folder, or a checkpoint-epochNNNN.pt of any step (weights only); fresh start if none")
    parser.add_argument("--stop-after", type=positive_int, metavar="N",
                        help="leave after N epochs of this run (time-limited jobs); continue with --resume auto")
    # GPU: the speed knobs of a single device.
    parser.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",  # DeepSpeed: the config's
                        help="precision of the weights (the config's bf16/fp16 blocks): auto = bf16 on CPU; on GPU "
                             "what the config enables, else fp16 (default auto)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                        help="NHWC batches, faster convolutions on tensor cores and CPUs (default on; "
                             "the weights stay NCHW under DeepSpeed)")  # DeepSpeed: see build_model
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (first epoch pays a one-time compile, 30-60 s on CPU)")
    # DeepSpeed: what the launchers pass, and the options of DeepSpeed's data-parallel training.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher and torch.distributed.launch (torchrun sets the LOCAL_RANK "
                             "variable instead)")
    parser.add_argument("--grad-accum", type=positive_int,
                        help="forward/backward passes per optimizer step (gradient_accumulation_steps; default: the "
                             "config's, 1)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch-norm statistics over the global batch (SyncBatchNorm; needs CUDA GPUs)")
    # DeepSpeed: the config file and the ZeRO stage. No --spawn: the deepspeed launcher or torchrun start the ranks.
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=CONFIG, metavar="JSON",
                        help="the DeepSpeed config (default: ds_config.json next to this script)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="override zero_optimization.stage: 0 = no partitioning, 1 = optimizer state, "
                             "2 = + gradients, 3 = + weights (default: the config's)")
    parser.add_argument("--dist-timeout", type=positive_int, default=600, metavar="SECONDS",
                        help="how long a collective waits for a missing rank before failing (default 600)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    torch.manual_seed(args.seed)
    # DDP: the launcher tells each process who it is through environment variables.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    if "OMP_NUM_THREADS" not in os.environ:  # DeepSpeed: its launcher does not set it (torchrun does): share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                            f"start at most {torch.cuda.device_count()} processes per node (--nproc_per_node)")
        device = torch.device("cuda", local_rank)  # DDP: one GPU per process, chosen by local rank
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:
        device = torch.device("cpu")
        if rank == 0:  # DeepSpeed: bf16 weights, not autocast
            print("no CUDA GPU found: running on the CPU (gloo backend, bf16 instead of fp16)")
        # DeepSpeed: on the CPU, joining the group would first compile a C++ op (deepspeed_shm_comm), 30-90 s of
        # silence on the first run; only inference's all-reduce uses it. Marked unavailable, it is never built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed: joins the processes as init_process_group does, with the backend of DeepSpeed's accelerator (nccl
    # on GPU, gloo on CPU, ccl with Intel's oneCCL bindings). The timeout bounds every collective, so a
    # dead peer turns into an error instead of a hang.
    deepspeed.init_distributed(get_accelerator().communication_backend_name(),
                               timeout=datetime.timedelta(seconds=args.dist_timeout))
    deepspeed.utils.logger.addFilter(lambda record: not record.getMessage().startswith(KNOWN_NOISE))  # DeepSpeed
    config = ds_config(args, device)  # DeepSpeed: batch sizes, optimizer, precision, ZeRO stage
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch's SyncBatchNorm has no CPU kernel); drop --sync-bn on CPU")
    return device, config, rank, world_size, local_rank


def ds_config(args, device):
    """DeepSpeed: ds_config.json with the command line's choices written into it, checked for this world size."""
    try:
        with open(args.deepspeed_config) as f:
            config = json.load(f)
    except OSError as error:
        raise UserError(f"--deepspeed_config {args.deepspeed_config}: {error.strerror}; pass a DeepSpeed config "
                        f"such as {CONFIG}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"--deepspeed_config {args.deepspeed_config} is not valid JSON ({error})") from None
    if not isinstance(config, dict) or "optimizer" not in config:
        raise UserError(f"{args.deepspeed_config} has no \"optimizer\" block: the engine builds the optimizer from "
                        f"the config here (copy the one in {CONFIG})")
    # DeepSpeed: the command line wins. With a new micro batch or accumulation, train_batch_size (micro batch x
    # accumulation x processes) is left to DeepSpeed to derive, so that it cannot contradict them.
    if args.batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = args.batch_size
    if args.grad_accum is not None:
        config["gradient_accumulation_steps"] = args.grad_accum
    if args.batch_size is not None or args.grad_accum is not None:
        config.pop("train_batch_size", None)
    if args.lr is not None:
        config["optimizer"].setdefault("params", {})["lr"] = args.lr
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    # GPU: fp16 needs a loss scale (its range is small; the fp16 block sets it up); bf16 has fp32's range and does not.
    configured = next((key for key in ("bf16", "fp16") if config.get(key, {}).get("enabled")), "fp16")
    amp = {"auto": configured if device.type == "cuda" else "bf16"}.get(args.amp, args.amp)
    if amp == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; on the CPU use --amp bf16 or --amp off")
    if amp == "bf16" and not get_accelerator().is_bf16_supported():  # DeepSpeed: GPUs before Ampere
        raise UserError("--amp bf16: this GPU has no bf16 support; use --amp fp16 or --amp off")
    for key in ("bf16", "fp16"):  # DeepSpeed: the engine casts the weights and keeps fp32 master copies
        config.setdefault(key, {})["enabled"] = amp == key
    # DeepSpeed: our models normalise the uint8 images with buffers, and batch norm keeps its statistics in
    # buffers: they must be in the weights' dtype, and DeepSpeed casts buffers only when told to.
    data_types = config.setdefault("data_types", {})
    if amp == "off":
        data_types.pop("buffer_dtype", None)
    else:
        data_types["buffer_dtype"] = amp
    try:
        resolved = DeepSpeedConfig(json.loads(json.dumps(config)))  # a copy: it checks the batch arithmetic now
    except (AssertionError, ValueError) as error:
        raise UserError(f"{args.deepspeed_config}: {' '.join(str(error).split())[:300]}") from None
    # DeepSpeed: what the data loader, the log and the checkpoints read: the values the engine will use.
    args.batch_size = resolved.train_micro_batch_size_per_gpu
    args.grad_accum = resolved.gradient_accumulation_steps
    args.lr = config["optimizer"].get("params", {}).get("lr")
    args.zero_stage, args.amp = resolved.zero_optimization_stage, amp
    return config


# ----------------------------------------------------------------------------- data
def build_data(args, rank, world_size, local_rank):
    # DDP: one process per machine downloads; the others wait at the barrier, then all read it.
    if local_rank == 0:
        data.prepare_cifar10(args.data_dir)  # downloads unless a cifar-10-batches-py folder is there
    dist.barrier()
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    # DDP: each rank draws a disjoint 1/world_size shard of one shared permutation (seed + epoch).
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.cuda.is_available())  # GPU: page-locked batches copy asynchronously
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, sampler=range(rank, len(test_set), world_size),
                             num_workers=args.workers, pin_memory=torch.cuda.is_available())
    if len(train_loader) < args.grad_accum:
        raise UserError(f"{world_size} process(es) x --batch-size {args.batch_size} x --grad-accum {args.grad_accum} "
                        f"needs more than the {len(train_set)} training images: lower them")
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
def build_model(args, device):
    model = models.build_model(args.arch).to(device)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # DDP: BN statistics over the global batch
    # DeepSpeed: with --channels-last only the batches are NHWC (convolutions still pick NHWC kernels); the weights
    # keep the default layout: the engine's broadcast and ZeRO's flat buffers need contiguous weights.
    # DeepSpeed: no wrapper yet: deepspeed.initialize (next section) wraps the model and the optimizer together in
    # its engine. It broadcasts rank 0's weights; under ZeRO-3 it then keeps only this rank's 1/N of each weight.
    return model


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, config):
    # DeepSpeed: the engine builds the optimizer (torch's SGD, as in 01-04) from the config and steps the schedule we
    # hand it: the same warm-up + cosine as 01-04 (DeepSpeed's WarmupCosineLR would start with two steps at lr 0).
    # From now on it owns precision (16-bit weights, fp32 master copies, fp16 loss scaling), the gradient average
    # across processes, accumulation, clipping and ZeRO's partitioning. The loop only talks to the engine.
    schedule = warmup_cosine(args.epochs * steps_per_epoch, WARMUP_EPOCHS * steps_per_epoch)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               lr_scheduler=lambda optimizer: LambdaLR(optimizer, schedule))
    except (AssertionError, ValueError) as error:  # a config DeepSpeed refuses, in one line
        raise UserError(f"deepspeed.initialize refused the config: {' '.join(str(error).split())[:300]}") from None
    return engine


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(engine, loader, device, memory_format, epoch, grad_accum, rank):
    engine.train()  # DeepSpeed: the engine is an nn.Module around the model: train()/eval() reach it
    loss_sum = torch.zeros((), device=device)
    seen = 0
    batches = itertools.islice(loader, len(loader) // grad_accum * grad_accum)  # DDP: whole accumulation groups
    bar = tqdm(batches, total=len(loader) // grad_accum * grad_accum, desc=f"epoch {epoch}", leave=False,
               disable=rank != 0 or not sys.stderr.isatty())
    start = time.perf_counter()
    for step, (images, labels) in enumerate(bar):
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True)
        # DeepSpeed: the engine runs the model in the configured precision (the uint8 images are normalised inside
        # the model, in its dtype) and under ZeRO-3 gathers each layer's weights just before it runs. Loss in fp32.
        loss = F.cross_entropy(engine(images).float(), labels)
        # DeepSpeed: divides the loss by the accumulation steps (fp16: scales it) and, on the last pass of a group,
        # averages the gradients across processes (ZeRO 2/3: each rank receives only its shard's average).
        engine.backward(loss)
        # DeepSpeed: after every pass. The engine counts them: on the last of a group it clips the gradients, steps
        # the optimizer and the schedule, and zeroes the gradients; on the others it does nothing.
        engine.step()
        loss_sum += loss.detach() * len(labels)  # stays on the device: no wait per step
        seen += len(labels)
        if not bar.disable and step % LOG_EVERY == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    # DDP: every rank saw different images; sum over ranks for the epoch's loss and throughput.
    totals = torch.stack([loss_sum.double(), torch.tensor(float(seen), dtype=torch.float64, device=device)])
    dist.all_reduce(totals)
    train_loss, seen = totals[0].item() / totals[1].item(), int(totals[1].item())
    seconds = time.perf_counter() - start
    return {"train_loss": train_loss, "images_per_sec": seen / seconds, "epoch_seconds": seconds,
            "peak_memory_mb": metrics.peak_memory_mb(device)}


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(engine, loader, device, memory_format):
    engine.eval()  # DeepSpeed: see train_one_epoch
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        # GPU: the same device, memory layout and precision as in training.
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True)
        logits = engine(images).float()  # DeepSpeed: through the engine (its precision; ZeRO-3 gathers the weights)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # DDP: add up every shard's loss sum, hits and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def export_weights(engine):
    """DeepSpeed: the whole model as a plain fp32 state_dict, gathered from the ZeRO shards of all ranks.
    Collective: every rank must call it, and every rank gets the whole model."""
    # ZeRO 0 with bf16/fp16 keeps the fp32 master weights in its optimizer wrapper, next to the 16-bit ones.
    masters = {}
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


def save_checkpoint(args, epoch, global_step, engine, row, synthetic, rank):
    # DeepSpeed: called on EVERY rank. Each rank writes its shard of the weights and the optimizer state; with the
    # schedule and our client_state this is what --resume auto continues from, bit for bit.
    folder = os.path.join(args.out_dir, ENGINE_DIR)
    engine.save_checkpoint(folder, tag=f"epoch{epoch:04d}",
                           client_state={"epoch": epoch, "global_step": global_step, "rng": checkpoint.rng_states()})
    # DeepSpeed: and the common format for steps 01-04: the fp32 weights gathered from all shards, no optimizer
    # state (the momentum stays in the engine checkpoint).
    model_state = export_weights(engine)
    if rank == 0:  # DDP: one writer
        for old in sorted(name for name in os.listdir(folder) if name.startswith("epoch"))[:-3]:
            shutil.rmtree(os.path.join(folder, old), ignore_errors=True)  # keeps 3, like checkpoint-epoch*.pt
        return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                               model_state=model_state, args=args, metrics=row, synthetic=synthetic)


def engine_checkpoint(args):
    """DeepSpeed: the engine checkpoint --resume names, as (folder, tag); None if it names none.
    auto: the newest in --out-dir (the `latest` file that save_checkpoint writes); PATH: that folder."""
    if args.resume == "auto":
        folder = os.path.join(args.out_dir, ENGINE_DIR)
        return (folder, None) if os.path.isfile(os.path.join(folder, "latest")) else None
    if args.resume is None or not os.path.isdir(args.resume):
        return None
    path = os.path.abspath(args.resume)
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    if not any(name.endswith("model_states.pt") for name in os.listdir(path)):
        raise UserError(f"--resume {args.resume}: not a DeepSpeed checkpoint (no `latest` file, no *model_states.pt); "
                        f"pass its {ENGINE_DIR} folder, one epoch folder in it, or a checkpoint-epochNNNN.pt")
    return os.path.split(path)  # one tag's folder, e.g. ds_checkpoints/epoch0003


def load_weights(args, model, rank):
    # DeepSpeed: a checkpoint-epochNNNN.pt (this step's export, or any step's checkpoint) holds weights only. They
    # go into the plain model, before the engine shards it; SGD's momentum then starts from zero.
    if args.resume is None or engine_checkpoint(args) is not None:
        return 0
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch)
    if state is None:
        if args.resume == "auto" and rank == 0:
            print(f"no checkpoint in {args.out_dir}: starting from scratch")
        return 0  # DeepSpeed: the epoch to continue after; resume() then places the schedule there
    epoch, _ = checkpoint.restore(state, model=model)
    if rank == 0:  # DDP: one line, not one per process
        print(f"resumed from epoch {epoch} (written by {state['step']}): weights only, momentum starts from zero")
    return epoch


def resume(args, engine, rank, start_epoch, steps_per_epoch):
    found = engine_checkpoint(args)
    if found is None:  # DeepSpeed: fresh, or weights from load_weights: the schedule goes to where that epoch ended
        global_step = start_epoch * steps_per_epoch
        checkpoint.place_schedule(engine.lr_scheduler, global_step)
        return start_epoch, global_step
    # DeepSpeed: every rank reads its own shard of weights and optimizer state, the schedule, and our client_state.
    try:
        path, client = engine.load_checkpoint(*found)
    except Exception as error:  # a checkpoint of another ZeRO stage or world size fails deep inside DeepSpeed
        reason = ": ".join(filter(None, [type(error).__name__, " ".join(str(error).split())]))[:200]
        raise UserError(f"cannot load the DeepSpeed checkpoint in {os.path.join(*filter(None, found))} ({reason}); "
                        "resume with the ZeRO stage and number of processes that wrote it, or continue from its "
                        "checkpoint-epochNNNN.pt (weights only)") from None
    if path is None or "epoch" not in (client or {}):
        raise UserError(f"--resume {args.resume}: no DeepSpeed checkpoint of {STEP} there (expected a folder written "
                        "by this script, holding `latest` or *model_states.pt)")
    torch.set_rng_state(client["rng"]["torch"])
    if rank == 0:  # DDP: one line, not one per process
        print(f"resumed from epoch {client['epoch']} (DeepSpeed checkpoint {os.path.dirname(path)})")
    return client["epoch"], client["global_step"]


# ----------------------------------------------------------------------------- main
def train(args):
    device, config, rank, world_size, local_rank = setup(args)
    checkpoint.make_out_dir(args.out_dir)
    train_loader, test_loader, sampler = build_data(args, rank, world_size, local_rank)
    synthetic = data.is_synthetic(args.data_dir)
    model = build_model(args, device)
    start_epoch = load_weights(args, model, rank)  # DeepSpeed: weights of a checkpoint-epochNNNN.pt, before the engine
    engine = build_optimizer(args, model, len(train_loader) // args.grad_accum, config)
    start_epoch, global_step = resume(args, engine, rank, start_epoch, len(train_loader) // args.grad_accum)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # GPU: batches as NHWC
    if args.compile:
        engine.compile()  # DeepSpeed: compiles the module inside the engine; the checkpoints do not change
    log = metrics.MetricsLog(args.out_dir, start_epoch, synthetic) if rank == 0 else None
    if rank == 0:  # DeepSpeed: the numbers as the engine resolved them from the config
        print(f"{STEP}: {args.arch} on {world_size} x {device.type}, ZeRO stage {engine.zero_optimization_stage()}, "
              f"amp {args.amp}, batch {engine.train_micro_batch_size_per_gpu()} per process x {world_size} processes "
              f"x {engine.gradient_accumulation_steps()} accumulation = {engine.train_batch_size()} global "
              f"(train_batch_size), {len(train_loader.dataset)} training images, "
              f"{len(train_loader) // args.grad_accum} steps/epoch"
              + ("  [SYNTHETIC DATA, not CIFAR-10]" if synthetic else ""))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # DDP: a new shared permutation each epoch (without it: same order every epoch)
        train_loader.dataset.set_epoch(epoch)
        row = {"epoch": epoch, **train_one_epoch(engine, train_loader, device, memory_format, epoch, args.grad_accum,
                                                 rank)}
        global_step += len(train_loader) // args.grad_accum
        # DeepSpeed: unlike DDP, the engine never syncs buffers, so each rank's batch-norm statistics follow its own
        # shard. Every rank takes rank 0's before evaluating and saving (DDP does it before every forward).
        for buffer in engine.module.buffers():
            dist.broadcast(buffer, 0)
        row.update(evaluate(engine, test_loader, device, memory_format))
        save_checkpoint(args, epoch, global_step, engine, row, synthetic, rank)  # DeepSpeed: on every rank
        if rank == 0:  # DDP: one writer; the others would race on the same files
            print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        dist.barrier()  # DDP: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        if args.stop_after and epoch - start_epoch >= args.stop_after and epoch < args.epochs:
            if rank == 0:
                print(f"stopping after {args.stop_after} epoch(s) as asked; continue with --resume auto")
            break

    if rank == 0:
        metrics.plot(args.out_dir, f"{STEP} ({args.arch}, {world_size} processes)")
    # DDP: every rank writes a fingerprint of its weights: equal files prove the replicas never diverged.
    # DeepSpeed: of the exported fp32 weights, as in checkpoint-epochNNNN.pt, so that the digest 01-04 write after
    # loading that file compares with it. Under ZeRO 1-3 each rank assembles them from all ranks' shards.
    checkpoint.write_digest(args.out_dir, rank, export_weights(engine))
    # DeepSpeed: as in 04, free the engine before leaving the group. Under ZeRO 0 it sits in a reference cycle
    # that only the garbage collector frees, at a random later moment (gloo's threads would then shut down while
    # holding the GIL); under ZeRO 1-3 hooks held by autograd keep it alive until exit.
    del engine, model
    gc.collect()
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if deepspeed is None:  # DeepSpeed: one line with the fix instead of an ImportError
        reason = str(DEEPSPEED_IMPORT_ERROR).strip().splitlines()[0][:120]
        raise UserError(f"DeepSpeed is not importable by {sys.executable} ({reason}): install it with "
                        f"`{sys.executable} -m pip install deepspeed==0.19.8`")
    if "RANK" not in os.environ:  # DeepSpeed: no --spawn (see parse_args)
        # DDP: no launcher. Pick a rendezvous address on this machine for the processes we start.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        # DeepSpeed: its init_distributed needs all five variables (else it looks for MPI); a launcher sets them.
        print("not started by a launcher: running as a single process (world size 1)")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    train(args)


if __name__ == "__main__":
    main()
