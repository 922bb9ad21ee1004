"""Step 06: one process per GPU with Horovod, on one machine or many.

What changes from step 04: Horovod replaces torch.distributed and DDP. horovodrun starts the
processes, hvd.init() connects them, the model stays a plain module, hvd.DistributedOptimizer
averages gradients by allreduce; broadcasts copy rank 0's weights, optimizer state and progress.

    horovodrun -np 4 -H localhost:4 python 06_cifar10_horovod.py
    horovodrun -np 8 -H host1:4,host2:4 python 06_cifar10_horovod.py   # 2 machines x 4, over ssh
"""
import functools
import os
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, check_device, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

# plumbing: without Horovod, one line with the fix and exit status 2, before anything is written.
try:
    import horovod.torch as hvd
except ImportError as error:
    print(f"error: Horovod is not importable by {sys.executable} ({error}): build it for this "
          f"torch with `PYTHON={sys.executable} bash scripts/install_horovod.sh`", file=sys.stderr)
    sys.exit(2)

STEP = os.path.splitext(os.path.basename(__file__))[0]
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)
    # Horovod: --sync-bn swaps in its SyncBatchNorm; --fp16-allreduce compresses what it sends.
    parser.add_argument("--sync-bn", action="store_true", help="batch-norm statistics over the "
                        "global batch (hvd.SyncBatchNorm; needs CUDA GPUs)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as fp16 in "
                        "the allreduce: half the traffic, some precision lost")
    return parser.parse_args(argv)


def setup(args):
    # Horovod: join horovodrun's processes (under plain python, a group of one).
    hvd.init()  # collective
    rank, world_size, args.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    # GPU: the machine's GPU (CUDA, ROCm, XPU or MPS), else the CPU; cuDNN times its kernels once.
    device = torch.accelerator.current_accelerator(check_available=True)
    # Horovod: NCCL moves CUDA tensors, Gloo CPU ones; its SyncBatchNorm needs CUDA (see below).
    check_horovod_device(args, device)
    # plumbing: a local rank without a GPU, or --sync-bn without CUDA or XPU, stops in one line.
    check_device(args, device)
    if device is not None:
        # DDP: one GPU per process, chosen by its local rank, its default device from now on.
        device = torch.device(device.type, args.local_rank)
        torch.accelerator.set_device_index(args.local_rank)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        if rank == 0:
            print("no GPU found: running on the CPU")
    # Horovod: rank 0 reads --resume's settings (or its error) and sends them; no disk is shared.
    settings = checkpoint.settings(args) if rank == 0 else None
    settings = hvd.broadcast_object(settings, root_rank=0, name="settings")  # collective
    settings.apply(args)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size


# Horovod: a stop signal on any rank stops all after the same step (an async max, read 8 later).
def stop_agreement(flag):
    handle = hvd.allreduce_async_(flag, op=hvd.Max, name="stop")  # collective
    return functools.partial(hvd.synchronize, handle)


def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (input, label). Yours: README."""
    # Horovod: one process per machine downloads; the others wait for it at Horovod's barrier.
    if args.local_rank == 0:
        data.download(args.data_dir)
    hvd.barrier()  # collective
    return data.cifar10(args.data_dir, seed=args.seed)


def build_loaders(args, train_set, test_set):
    # Horovod: workers start from a forkserver that loads Horovod too (its threads fork no safer).
    data.workers_from_a_forkserver("horovod.torch")
    # Horovod: the sampler takes its rank and size; each rank trains a disjoint shard of one random
    # order per epoch, from (seed, epoch) alone. A resumed epoch starts after the steps done.
    order = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                               seed=args.seed)
    sampler = data.EpochSampler(order, args.batch_size * args.grad_accum, args.drop_last)
    # GPU: batches in page-locked memory copy to the GPU without blocking the process.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0,
                              pin_memory=torch.accelerator.is_available())
    # Horovod: the test set sharded by its rank and size, without padding (no sample counts twice),
    # in as many batches on every rank.
    batches = data.eval_batches(len(test_set), hvd.rank(), hvd.size())
    test_loader = DataLoader(test_set, batch_sampler=batches, num_workers=args.workers,
                             persistent_workers=args.workers > 0,
                             pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8, normalised inside)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device):
    # Horovod: the weights stay NCHW, as its broadcast and allreduce refuse channels_last tensors.
    model = model.to(device)
    # Horovod: with --sync-bn, its SyncBatchNorm replaces each batch norm under the same name.
    if args.sync_bn:
        norms = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
        for name, norm in norms:
            sync = hvd.SyncBatchNorm(norm.num_features, norm.eps, norm.momentum).to(device)
            sync.load_state_dict(norm.state_dict())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, sync)
    # Horovod: no wrapper; DistributedOptimizer averages gradients and resume() broadcasts weights.
    return model


def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    # Horovod: gradients averaged by allreduce (fp16 with --fp16-allreduce) on a group's last pass.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=args.grad_accum)
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return optimizer, scheduler, scaler


# The model and what trains it, on which device and in which precision: what the loop works with.
Training = namedtuple("Training", "model optimizer scheduler scaler device amp_dtype")


def train_one_epoch(args, training, loader, stop, meter):
    model, optimizer, scheduler, scaler, device, amp_dtype = training
    model.train()
    # The loss sum and the sample count stay on the device: no wait for them per step.
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for step, (inputs, labels) in enumerate(loader):
        meter.batch_in_hand()
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        inputs = inputs.to(device, non_blocking=True, memory_format=data.layout(inputs, args))
        labels = labels.to(device, non_blocking=True)
        last_pass = (step + 1) % args.grad_accum == 0 or step + 1 == len(loader)
        # Horovod: the forward meets the other ranks with --sync-bn; on a group's last pass backward
        # starts each gradient's allreduce, and the scaler unscales them once all have arrived.
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(inputs), labels)  # collective
        scaler.scale(loss / args.grad_accum).backward()  # collective
        if last_pass:
            optimizer.synchronize()  # collective
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        totals[0] += loss.detach() * len(labels)
        totals[1] += len(labels)
        meter.batch_done(loss)
        # DDP: a stop signal on any rank ends every rank's epoch after the same optimizer step.
        if last_pass and stop.requested(step // args.grad_accum + 1):  # collective
            break
    # Horovod: sums over the ranks (its allreduce averages by default), and every rank's timing.
    totals = hvd.allreduce(totals, op=hvd.Sum, name="train_totals")  # collective
    timing = meter.timing().to(device)
    timing = hvd.allreduce(timing, op=hvd.Max, name="timing")  # collective
    return meter.row(totals, timing)


@torch.no_grad()
def evaluate(args, model, loader, device, amp_dtype):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for inputs, labels in loader:
        # GPU: as in training.
        inputs = inputs.to(device, non_blocking=True, memory_format=data.layout(inputs, args))
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    # Horovod: add up every shard's loss sum, hits and count.
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")  # collective
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


def save_checkpoint(args, training, row, info):
    # Horovod: no wrapper, so the model's own state, as every step saves it.
    state = {"step": STEP, "model": training.model.state_dict(),
             "optimizer": training.optimizer.state_dict(),
             "scheduler": training.scheduler.state_dict(), "scaler": training.scaler.state_dict(),
             "global_step": training.scheduler.last_epoch, "synthetic": info.synthetic}
    return checkpoint.save(args, row, state)


def resume(args, training):
    # Horovod: rank 0 alone reads the checkpoint, then broadcasts its progress, schedule and scale.
    model, optimizer, scheduler, scaler = training[:4]
    found = (0, 0, {})
    if hvd.rank() == 0:
        found = checkpoint.resume(checkpoint.find(args), model, optimizer, scheduler, scaler)
    state = (*found, scheduler.state_dict(), scaler.state_dict(), bool(optimizer.state))
    epoch, global_step, part_done, schedule, scale, momentum = hvd.broadcast_object(
        state, root_rank=0, name="resume")  # collective
    scheduler.load_state_dict(schedule)
    if scale:
        scaler.load_state_dict(scale)
    # Horovod: then its momentum (if the checkpoint had any, else a zero-gradient step) and weights.
    if momentum:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # collective
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # collective
    # Horovod: the ranks compare their epoch, step and weights; if one differs, every rank stops.
    mine = checkpoint.position((epoch, global_step), model.state_dict())
    checkpoint.agree(hvd.allgather_object(mine, name="position"))  # collective
    return epoch, global_step, part_done


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    device, amp_dtype, rank, world_size = setup(args)  # collective
    # Horovod: after SIGTERM or SIGUSR1 on any rank, all finish the same step, save and exit 75.
    stop = preempt.Stop(args.stop_after, agree=stop_agreement)
    train_set, test_set, info = build_data(args)  # collective
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device)
    optimizer, scheduler, scaler = build_optimizer(args, model, sampler.steps, device, amp_dtype)
    training = Training(model, optimizer, scheduler, scaler, device, amp_dtype)
    start_epoch, _, part_done = resume(args, training)  # collective
    # --compile: the model's forward, compiled in place (its weights and their names stay).
    if args.compile:
        model.compile()
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, sampler.steps)
    log.start(device, amp_dtype, train_loader)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = train_one_epoch(args, training, train_loader, stop, meter)  # collective
        row = {"epoch": epoch, **row}
        # Horovod: rank 0's batch-norm statistics on every rank (its optimizer averages gradients).
        hvd.broadcast_parameters(dict(model.named_buffers()), root_rank=0)  # collective
        # An epoch stopped part-way is saved, not evaluated.
        if not row.get("partial"):
            row.update(evaluate(args, model, test_loader, device, amp_dtype))  # collective
        # Horovod: rank 0 writes alone; its barrier keeps the others from running ahead meanwhile.
        if rank == 0:
            save_checkpoint(args, training, row, info)
        log.epoch(row)
        hvd.barrier()  # collective
        if stop.leave(epoch, start_epoch, args.epochs):  # collective
            break

    # Horovod: each rank's weights-rankN.sha256 (equal files, equal replicas); its thread stops.
    log.finish(model.state_dict())
    hvd.shutdown()
    # 75 after a stop signal: a batch script requeues the job.
    return stop.exit_status()


# plumbing: what this Horovod cannot run, as one line with the fix (exit status 2).
def check_horovod_device(args, device):
    if device is not None and (device.type != "cuda" or not hvd.nccl_built()):
        sys.exit(f"this Horovod cannot use {device.type} tensors: on CUDA GPUs build it with "
                 f"`HOROVOD_GPU_OPERATIONS=NCCL PYTHON={sys.executable} bash "
                 "scripts/install_horovod.sh`; elsewhere use step 04")
    # Horovod: its SyncBatchNorm runs on CUDA GPUs only (the device is CUDA or none by now).
    if args.sync_bn and device is None:
        sys.exit("--sync-bn needs CUDA GPUs (Horovod's SyncBatchNorm has no CPU kernel); "
                 "drop --sync-bn on CPU")


if __name__ == "__main__":
    sys.exit(main())
