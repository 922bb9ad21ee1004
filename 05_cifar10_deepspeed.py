"""Step 05: DeepSpeed: one engine owns the optimizer, precision and accumulation; ZeRO shards the state.

What changes from step 04: deepspeed.initialize builds an engine around the model from ds_config.json and the command
line; the loop calls engine(images), engine.backward(loss), engine.step(). ZeRO 1 partitions the optimizer state
across the processes, 2 also the gradients, 3 also the weights. Checkpoints: the engine's, and the gathered weights.

    deepspeed --num_gpus 4 05_cifar10_deepspeed.py --deepspeed_config ds_config.json --zero-stage 3
"""
import datetime
import gc
import glob
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

if not torch.accelerator.is_available():  # DeepSpeed: on a CPU name it (else every rank warns that it found no GPU)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed:
# DeepSpeed: torch deprecates two collectives that ZeRO calls (with stage 3, every step warns)
warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.\w+` is deprecated")
try:  # plumbing: a missing DeepSpeed is one line with the fix, exit status 2
    import deepspeed
except ImportError as error:  # plumbing:
    sys.exit(print(f"error: DeepSpeed is not importable by {sys.executable} ({error}): install it with "
                   f"`{sys.executable} -m pip install deepspeed==0.19.8`", file=sys.stderr) or 2)
deepspeed.utils.logger.addFilter(lambda r: "untested optimizer" not in r.getMessage())  # DeepSpeed: SGD is fine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
WARMUP_EPOCHS = 1  # DeepSpeed: SGD's momentum and weight decay are in ds_config.json
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")  # DeepSpeed: the default config


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)  # the flags of every step
    # DeepSpeed: its launcher passes --local_rank=N too, as torch.distributed.launch does; the GPU it uses
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS", help="wait for a missing rank")  # DDP:
    parser.add_argument("--sync-bn", action="store_true", help="batch norm over the global batch (CUDA, XPU)")  # DDP:
    # DeepSpeed: its config (default: ds_config.json next to this script), and what ZeRO shards (default: the config's)
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=CONFIG, metavar="JSON", help="its config")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="0 none, 1 optimizer state, 2 + gradients, "
                                                                             "3 + weights")  # DeepSpeed:
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # DDP: set by the launcher
    device = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS; None: none
    if device is not None:  # GPU: there is one
        if args.local_rank >= torch.accelerator.device_count():  # plumbing: more processes than GPUs on this machine
            sys.exit(f"local rank {args.local_rank} has no GPU: start <= {torch.accelerator.device_count()} per node")
        device = torch.device(device.type, args.local_rank)  # DDP: one GPU per process, chosen by its local rank
        torch.accelerator.set_device_index(args.local_rank)  # DDP: its default device from now on
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:  # GPU: no accelerator: say so once and carry on on the CPU
        device = torch.device("cpu")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed: else it compiles an op (30-90 s)
        if rank == 0:  # plumbing: one line, not one per process
            print("no GPU found: running on the CPU")
    if args.sync_bn and device.type not in ("cuda", "xpu"):  # DDP: torch's SyncBatchNorm has kernels for these only
        sys.exit(f"--sync-bn needs CUDA or XPU GPUs (torch's SyncBatchNorm has no {device.type} kernel); drop it")
    deepspeed.init_distributed(dist.get_default_backend_for_device(device),  # DeepSpeed: as 04's
                               timeout=datetime.timedelta(seconds=args.dist_timeout))
    verdict = [checkpoint.settings(args) if rank == 0 else None]  # DDP: rank 0 alone reads --resume's checkpoint
    dist.broadcast_object_list(verdict, src=0)  # DDP: collective: its settings on every rank (no shared disk needed)
    verdict[0].apply(args)  # DDP: that run's settings (those not typed), or the error, on every rank
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size  # DDP: this process's rank, and how many there are


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    if args.local_rank == 0:  # DDP: one process per machine downloads; the others wait at the barrier
        data.download(args.data_dir)  # CIFAR-10: downloads it unless a cifar-10-batches-py folder is there
    dist.barrier()  # DDP: collective
    return data.cifar10(args.data_dir, seed=args.seed)


def build_loaders(args, train_set, test_set):
    # DDP: each rank gets a disjoint 1/world_size shard of one random order of the whole set per epoch, from (seed,
    # epoch) alone. EpochSampler: whole optimizer steps; a resumed epoch starts after those already done.
    order = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    sampler = data.EpochSampler(order, args.batch_size * args.grad_accum)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              persistent_workers=args.workers > 0,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    # DeepSpeed: as 04's, in batches of at most 512 that give every rank as many: under ZeRO-3 every forward gathers
    shard = -(-len(test_set) // dist.get_world_size())  # DeepSpeed: the larger shard (they differ by one at most)
    test_loader = DataLoader(test_set, batch_size=-(-shard // -(-shard // 512)), num_workers=args.workers,  # DeepSpeed:
                             sampler=range(dist.get_rank(), len(test_set), dist.get_world_size()),
                             pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
# --arch chooses one of these; the first is the default.
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device):  # DeepSpeed: no wrapper: deepspeed.initialize builds the engine around it
    model = model.to(device)  # DeepSpeed: NCHW weights: ZeRO's flat buffers need them (--channels-last: NHWC batches)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model  # DDP: BN over the global batch


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, amp_dtype, start_step):  # DeepSpeed: the engine; the schedule's start
    config = json.loads(Path(args.deepspeed_config).read_text())  # DeepSpeed: ds_config.json, or --deepspeed_config
    config.update(train_micro_batch_size_per_gpu=args.batch_size, gradient_accumulation_steps=args.grad_accum)  # DeepSpeed:
    config.pop("train_batch_size", None)  # DeepSpeed: micro batch x accumulation x processes: it derives it
    config.setdefault("optimizer", {"type": "SGD"}).setdefault("params", {})["lr"] = args.lr  # DeepSpeed: its SGD
    if args.zero_stage is not None:  # DeepSpeed: --zero-stage over the config's
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    # DeepSpeed: --amp: 16-bit weights with fp32 masters (not autocast) and 16-bit buffers (ours normalise), or fp32
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16", None: "fp32"}[amp_dtype]
    for key in ("bf16", "fp16"):  # DeepSpeed:
        config.setdefault(key, {})["enabled"] = precision == key
    config.setdefault("data_types", {})["buffer_dtype"] = None if amp_dtype is None else precision  # DeepSpeed:
    if dist.get_rank() == 0:  # DeepSpeed: the config the engine gets, once
        print(f"DeepSpeed config: {json.dumps(config, separators=(',', ':'))}")

    def schedule(optimizer):  # DeepSpeed: our warm-up and cosine, on the optimizer it builds, from step start_step
        for group in optimizer.param_groups:  # DeepSpeed: LambdaLR starts at a step only with these
            group.setdefault("initial_lr", group["lr"])
        return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS),
                                                 last_epoch=start_step - 1)  # DeepSpeed: as 01-04's

    try:  # DeepSpeed: builds SGD from the config, steps our schedule; owns precision, averaging, clipping, ZeRO
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               lr_scheduler=schedule)  # DeepSpeed: collective: broadcasts weights
    except (AssertionError, ValueError) as error:  # DeepSpeed: a config it refuses, in one line (plumbing)
        sys.exit(f"deepspeed.initialize refused the config: {' '.join(str(error).split())[:300]}")
    engine.global_steps = start_step  # DeepSpeed: its step count, saved in its checkpoints
    return engine  # DeepSpeed: model, optimizer, schedule, precision in one


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(args, engine, loader, device, stop, meter):  # DeepSpeed: the engine; it casts (no autocast)
    engine.train()  # DeepSpeed: the engine is an nn.Module around the model
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # batches as NHWC
    for step, (images, labels) in enumerate(loader):
        meter.batch_in_hand()  # per-rank timing (metrics.Meter): the wait for this batch was data time
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images, labels = (images.to(device, non_blocking=True, memory_format=memory_format),
                          labels.to(device, non_blocking=True))
        last_pass = (step + 1) % args.grad_accum == 0
        # DeepSpeed: the engine runs the model in its precision; collective under ZeRO-3: it gathers each layer first.
        loss = F.cross_entropy(engine(images).float(), labels)
        engine.backward(loss)  # DeepSpeed: / grad_accum; collective on a group's last pass: averages the gradients
        engine.step()  # DeepSpeed: on a group's last pass: clip, step optimizer and schedule, zero the gradients
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
        meter.batch_done()
        # DDP: collective every 8th step (main's agreement): every rank stops after the same step
        if last_pass and stop.requested((step + 1) // args.grad_accum):
            break
    dist.all_reduce(totals)  # DDP: collective: every rank saw different images; the sums over ranks
    timing = meter.timing().to(device)  # DDP: this rank's timing in its slots (on the device: NCCL takes no CPU tensor)
    dist.all_reduce(timing, op=dist.ReduceOp.MAX)  # DDP: collective
    return meter.row(totals, timing)  # DDP: the row holds every rank's timing


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()  # DeepSpeed: the engine in place of the model; it casts, so no autocast
def evaluate(args, engine, loader, device):
    engine.eval()  # DeepSpeed: as in train_one_epoch
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # as in training
    for images, labels in loader:
        images, labels = (images.to(device, non_blocking=True, memory_format=memory_format),  # GPU: as in training
                          labels.to(device, non_blocking=True))
        logits = engine(images).float()  # DeepSpeed: the engine's precision; collective under ZeRO-3
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # DDP: collective: add up every shard's loss sum, hits and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
# DeepSpeed: collective: the fp32 masters (ZeRO 1-3: gathered from the shards; 0: its optimizer's), whole buffers
def full_weights(engine):
    masters = {id(low): high for lows, highs in zip(getattr(engine.optimizer, "fp16_groups", []),  # DeepSpeed: ZeRO 0
                                                    getattr(engine.optimizer, "fp32_groups", [])) for low, high in zip(lows, highs)}
    state = {}  # DeepSpeed:
    for name, tensor in engine.module.state_dict(keep_vars=True).items():  # DeepSpeed: collective (ZeRO 1-3)
        full = deepspeed.utils.safe_get_full_fp32_param(tensor) if isinstance(tensor, nn.Parameter) else None
        tensor = (masters.get(id(tensor), tensor) if full is None else full).detach().cpu()
        state[name] = tensor.float() if tensor.is_floating_point() else tensor  # DeepSpeed: fp32 (counters stay int)
    return state  # DeepSpeed:


def save_checkpoint(args, epoch, global_step, engine, row, info):  # DeepSpeed: the engine for model and optimizer
    # DeepSpeed: collective: EVERY rank its shard of the engine's state, and our position; rank 0 the gathered weights
    folder, done = os.path.join(args.out_dir, "ds_checkpoints"), epoch - bool(row.get("partial"))
    engine.save_checkpoint(folder, tag=f"epoch{done:04d}" + (f"-step{row['steps']:06d}" if done < epoch else ""),
                           client_state={"step": STEP, "epoch": done, "global_step": global_step, "metrics": row,
                                         "rng": {"torch": torch.get_rng_state()}})  # DeepSpeed: collective
    model_state = full_weights(engine)  # DeepSpeed: collective
    if dist.get_rank() == 0:  # DeepSpeed: one writer, of its checkpoints too
        for old in sorted(glob.glob(os.path.join(folder, "epoch*")))[:-3]:  # DeepSpeed: keep 3 (`latest`: the newest)
            shutil.rmtree(old, ignore_errors=True)
        return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                               model_state=model_state, args=args, metrics=row, synthetic=info.synthetic)


# DeepSpeed: the (folder, tag) --resume names: auto: ds_checkpoints/, or a folder of them, or an epoch's; None: none.
def engine_checkpoint(args):
    # DeepSpeed: its folder, and the tag it saved last
    path = os.path.join(args.out_dir, "ds_checkpoints") if args.resume == "auto" else os.path.abspath(args.resume or "-")
    if os.path.isfile(os.path.join(path, "latest")):  # DeepSpeed:
        return path, Path(path, "latest").read_text().strip()  # DeepSpeed:
    return os.path.split(path) if glob.glob(os.path.join(path, "*model_states.pt")) else None  # DeepSpeed: an epoch's


# DeepSpeed: collective: every rank reads its shard of weights and optimizer state, the schedule and our position.
def resume(args, engine, found, rank):
    shards = [name for name in os.listdir(os.path.join(*found)) if name.endswith("optim_states.pt")]  # DeepSpeed:
    if shards and len(shards) != dist.get_world_size():  # DeepSpeed: it cannot re-partition SGD's state
        sys.exit(f"the DeepSpeed checkpoint {os.path.join(*found)} holds the optimizer state of {len(shards)} processes, "
                 f"this run has {dist.get_world_size()}; start {len(shards)}, or continue from its weights (momentum "
                 f"starts again) with --resume {os.path.join(os.path.dirname(found[0]), f'checkpoint-{found[1]}.pt')}")
    path, client = engine.load_checkpoint(*found)  # DeepSpeed: collective
    # DeepSpeed: our position in the run, saved with it (epochs, steps, a part-way epoch's row, the RNG)
    return checkpoint.resume(args, state=client, verbose=rank == 0, says=f", DeepSpeed checkpoint {os.path.dirname(path)}")


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:  # DDP: started without a launcher: be a group of one
        os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),  # DDP: where the ranks meet, at a
                          MASTER_PORT=os.environ.get("MASTER_PORT", "0"),  # free
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # port (0: the OS picks one when no one else meets)
    device, amp_dtype, rank, world_size = setup(args)  # DDP: joins the process group
    group = dist.new_group(backend="gloo")  # DDP: collective: a CPU group of its own for the stop flag
    # DDP: collective: a stop signal on any rank stops them all after the same step: a max over ranks, started every
    # 8th step without waiting and read 8 steps later (common/preempt.py)
    stop = preempt.Stop(args.stop_after, agree=lambda flag: dist.all_reduce(flag, dist.ReduceOp.MAX, group=group,
                                                                             async_op=True).wait)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device)
    steps_per_epoch = len(train_loader) // args.grad_accum
    found = engine_checkpoint(args)  # DeepSpeed: its own checkpoint, if --resume names one
    # DeepSpeed: else any step's checkpoint-epochNNNN.pt gives the weights (before ZeRO shards them) and its epoch
    start_epoch, global_step, part_done = (0, 0, {}) if found else checkpoint.resume(args, model=model, verbose=rank == 0)
    engine = build_optimizer(args, model, steps_per_epoch, amp_dtype, start_epoch * steps_per_epoch)  # DeepSpeed:
    if found:  # DeepSpeed: the engine's checkpoint: everything, exactly
        start_epoch, global_step, part_done = resume(args, engine, found, rank)
    if args.compile:  # DeepSpeed: compiles the module inside the engine; the checkpoints do not change
        engine.compile()
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader, prefix=f"ZeRO stage {engine.zero_optimization_stage()}, ")  # DeepSpeed:

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = {"epoch": epoch, **train_one_epoch(args, engine, train_loader, device, stop, meter)}  # DeepSpeed:
        global_step = engine.global_steps  # DeepSpeed: optimizer steps, also those skipped on fp16 overflow
        for buffer in engine.module.buffers():  # DeepSpeed: collective: buffers are never synced: take rank 0's
            dist.broadcast(buffer, 0)  # DeepSpeed: collective
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(args, engine, test_loader, device))
        save_checkpoint(args, epoch, global_step, engine, row, info)  # DeepSpeed: collective: on every rank
        log.epoch(row)
        dist.barrier()  # DDP: collective: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        # DDP: collective: a stop signal (agreed by all), or --stop-after: continue with --resume auto
        if stop.leave(epoch, start_epoch, args.epochs):
            break

    log.finish(full_weights(engine))  # DeepSpeed: collective: every rank's digest of the gathered fp32 weights
    del engine, model  # DeepSpeed: as in 04 (under ZeRO 1-3 autograd hooks would also keep the engine alive)
    gc.collect()  # plumbing: (see above)
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
