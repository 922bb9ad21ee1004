"""Step 06: one process per GPU with Horovod, on one machine or many.

What changes from step 04: Horovod takes the place of torch.distributed and DDP. horovodrun starts the processes,
hvd.init() connects them, the model stays a plain module, hvd.DistributedOptimizer averages the gradients with
allreduce, and broadcasts copy rank 0's weights, optimizer state and position in the run.

    horovodrun -np 4 -H localhost:4 python 06_cifar10_horovod.py
    horovodrun -np 8 -H host1:4,host2:4 python 06_cifar10_horovod.py   # 2 machines x 4 (ssh, same paths)
"""
import functools
import os
import sys

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

try:  # plumbing: a missing Horovod is one line with the fix, exit status 2
    import horovod.torch as hvd
except ImportError as error:  # plumbing:
    sys.exit(print(f"error: Horovod is not importable by {sys.executable} ({error}): build it for this torch with "
                   f"`PYTHON={sys.executable} bash scripts/install_horovod.sh`", file=sys.stderr) or 2)
# Horovod: DataLoader workers start from a forkserver, which imports what they need once: forked from this process
# they would inherit Horovod's threads (and, with MPI over InfiniBand, memory registrations), not fork-safe.
mp.set_start_method("forkserver", force=True)
mp.set_forkserver_preload(["common", "horovod.torch"])  # Horovod: (see above)

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)  # the flags of every step
    parser.add_argument("--sync-bn", action="store_true",  # Horovod: its SyncBatchNorm (prepare_model)
                        help="batch-norm statistics over the global batch (hvd.SyncBatchNorm; needs CUDA GPUs)")
    parser.add_argument("--fp16-allreduce", action="store_true",  # Horovod: gradient compression
                        help="send gradients as fp16 in the allreduce: half the traffic, some precision lost")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    rank, world_size, args.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()  # Horovod: from hvd.init()
    device = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS; None: none
    if device is not None and (device.type != "cuda" or not hvd.nccl_built()):  # Horovod: NCCL (CUDA, ROCm) or Gloo
        sys.exit(f"this Horovod cannot use {device.type} tensors: on CUDA GPUs build it with `HOROVOD_GPU_OPERATIONS="
                 f"NCCL PYTHON={sys.executable} bash scripts/install_horovod.sh`; elsewhere use step 04")
    if device is not None:  # GPU: there is one
        if args.local_rank >= torch.accelerator.device_count():  # plumbing: more processes than GPUs on this machine
            sys.exit(f"local rank {args.local_rank} has no GPU: start <= {torch.accelerator.device_count()} per node")
        device = torch.device(device.type, args.local_rank)  # DDP: one GPU per process, chosen by its local rank
        torch.accelerator.set_device_index(args.local_rank)  # DDP: its default device from now on
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:  # GPU: no accelerator: say so once and carry on on the CPU
        device = torch.device("cpu")
        if rank == 0:  # plumbing: one line, not one per process
            print("no GPU found: running on the CPU")
    if args.sync_bn and device.type != "cuda":  # Horovod: its SyncBatchNorm runs on CUDA GPUs only
        sys.exit("--sync-bn needs CUDA GPUs (Horovod's SyncBatchNorm has no CPU kernel); drop --sync-bn on CPU")
    verdict = checkpoint.settings(args) if rank == 0 else None  # Horovod: rank 0 alone reads --resume's checkpoint
    # Horovod: collective: its settings, or its error, on every rank (no shared disk needed)
    hvd.broadcast_object(verdict, root_rank=0, name="settings").apply(args)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size  # DDP: this process's rank, and how many there are


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    if args.local_rank == 0:  # DDP: one process per machine downloads; the others wait at the barrier
        data.download(args.data_dir)  # CIFAR-10: downloads it unless a cifar-10-batches-py folder is there
    hvd.barrier()  # Horovod: collective, in place of dist.barrier(): there is no torch process group
    return data.cifar10(args.data_dir, seed=args.seed)


def build_loaders(args, train_set, test_set):
    # DDP: each rank gets a disjoint 1/world_size shard of one random order of the whole set per epoch, from (seed,
    # epoch) alone. EpochSampler: whole optimizer steps; a resumed epoch starts after those already done.
    order = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,  # Horovod: its rank
                               seed=args.seed)
    sampler = data.EpochSampler(order, args.batch_size * args.grad_accum)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              persistent_workers=args.workers > 0,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers, pin_memory=torch.accelerator.is_available(),
                             sampler=range(hvd.rank(), len(test_set), hvd.size()))  # Horovod: its rank and size
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
# --arch chooses one of these; the first is the default.
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device):
    model = model.to(device)  # Horovod: NCHW weights: its broadcast and allreduce refuse channels_last tensors
    # Horovod: --sync-bn: its SyncBatchNorm in place of each batch norm (the same names: checkpoints do not change)
    for name, norm in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)] * args.sync_bn:
        sync = hvd.SyncBatchNorm(norm.num_features, norm.eps, norm.momentum).to(device)
        sync.load_state_dict(norm.state_dict())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, sync)
    return model  # Horovod: no wrapper: DistributedOptimizer averages its gradients; resume() broadcasts it


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    # Horovod: step() waits for gradients averaged over all ranks; hooks start each allreduce as soon as backward has
    # produced that gradient, on every --grad-accum-th pass only. (Horovod's examples also scale lr by hvd.size().)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=args.grad_accum,
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # fp16 only (GPU, step 02)
    return optimizer, scheduler, scaler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(args, model, loader, optimizer, scheduler, scaler, device, amp_dtype, stop, meter):
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # batches as NHWC
    for step, (images, labels) in enumerate(loader):
        meter.batch_in_hand()  # per-rank timing (metrics.Meter): the wait for this batch was data time
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images, labels = (images.to(device, non_blocking=True, memory_format=memory_format),
                          labels.to(device, non_blocking=True))
        last_pass = (step + 1) % args.grad_accum == 0
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / args.grad_accum).backward()  # Horovod: collective on the last pass: its allreduce starts
        if last_pass:  # Horovod: one optimizer step per group
            optimizer.synchronize()  # Horovod: wait for the averaged gradients before the scaler looks at them
            scaler.unscale_(optimizer)  # Horovod: (its AMP pattern)
            with optimizer.skip_synchronize():  # Horovod: and step without a second wait
                scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()  # gradients to None (the default): nothing to zero
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
        meter.batch_done()
        # DDP: collective every 8th step (main's agreement): every rank stops after the same step
        if last_pass and stop.requested((step + 1) // args.grad_accum):
            break
    totals = hvd.allreduce(totals, op=hvd.Sum, name="train_totals")  # Horovod: collective: sums (default: average)
    timing = meter.timing().to(device)  # DDP: this rank's timing in its slots (on the device: NCCL takes no CPU tensor)
    timing = hvd.allreduce(timing, op=hvd.Max, name="timing")  # Horovod: collective
    return meter.row(totals, timing)  # DDP: the row holds every rank's timing


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(args, model, loader, device, amp_dtype):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # as in training
    for images, labels in loader:
        images, labels = (images.to(device, non_blocking=True, memory_format=memory_format),  # GPU: as in training
                          labels.to(device, non_blocking=True))
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")  # Horovod: collective: every shard's sums
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info):
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.state_dict(), optimizer=optimizer, scheduler=scheduler,  # Horovod: no wrapper
                           scaler=scaler, args=args, metrics=row, synthetic=info.synthetic)


def resume(args, model, optimizer, scheduler, scaler):
    # Horovod: only rank 0 reads the checkpoint (only its disk may have it); broadcasts then copy its state.
    found = checkpoint.resume(args, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler) \
        if hvd.rank() == 0 else None
    # Horovod: collective: rank 0's position in the run, schedule and loss scale; its momentum and weights below.
    epoch, global_step, part_done, schedule, scale = hvd.broadcast_object(
        (*(found or (0, 0, {})), scheduler.state_dict(), scaler.state_dict()), root_rank=0, name="resume")
    scheduler.load_state_dict(schedule)  # Horovod:
    if scale:  # Horovod: {}: a disabled (bf16/fp32) scaler
        scaler.load_state_dict(scale)
    if global_step > 0:  # Horovod: collective: momentum (on a fresh optimizer this would take a zero-gradient step)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod: collective: rank 0's weights on every rank
    return epoch, global_step, part_done  # Horovod:


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    hvd.init()  # Horovod: connects to the processes horovodrun started (plain python: a group of one)
    device, amp_dtype, rank, world_size = setup(args)  # Horovod: its rank and size
    # Horovod: collective: a stop signal on any rank stops them all after the same step: its max over ranks, started
    # every 8th step without waiting and read 8 steps later (common/preempt.py)
    stop = preempt.Stop(args.stop_after, agree=lambda flag: functools.partial(hvd.synchronize, hvd.allreduce_async_(
        flag, op=hvd.Max, name="stop")))
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device)
    steps_per_epoch = len(train_loader) // args.grad_accum
    optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device, amp_dtype)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler)
    train_model = torch.compile(model) if args.compile else model  # same weights; checkpoints use `model`
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = {"epoch": epoch, **train_one_epoch(args, train_model, train_loader, optimizer, scheduler, scaler,
                                                 device, amp_dtype, stop, meter)}
        global_step = scheduler.last_epoch  # optimizer steps so far (the schedule counts them)
        hvd.broadcast_parameters(dict(model.named_buffers()), root_rank=0)  # Horovod: collective: rank 0's BN statistics
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(args, train_model, test_loader, device, amp_dtype))
        if rank == 0:  # DDP: one writer; the others would race on the same files
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info)
        log.epoch(row)
        hvd.barrier()  # Horovod: collective: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        # DDP: collective: a stop signal (agreed by all), or --stop-after: continue with --resume auto
        if stop.leave(epoch, start_epoch, args.epochs):
            break

    log.finish(model.state_dict())  # Horovod: every rank its weights-rankN.sha256 of a plain module: equal = equal
    hvd.shutdown()  # Horovod: stop its background thread cleanly so horovodrun sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
