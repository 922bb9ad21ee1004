"""Step 04: one process per GPU with DistributedDataParallel (DDP), on one machine or many.

What changes from step 03: a launcher starts one process per GPU. Each joins a process group,
trains a replica on its own shard of every epoch (DistributedSampler) and DDP averages the
gradients during backward. Only rank 0 prints and saves. No launcher: --spawn N, or one process.

    torchrun --nproc_per_node=4 04_cifar10_ddp.py
    python -m torch.distributed.launch --nproc_per_node=4 04_cifar10_ddp.py   # legacy launcher
"""
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, distributed, metrics, models, preempt
from common.cli import UserError, amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser("Step 04: training with DistributedDataParallel, one process per GPU.", STEP, ARCHS)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by torch.distributed.launch (torchrun sets LOCAL_RANK)")  # DDP: launcher argument
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch-norm statistics over the global batch (SyncBatchNorm; needs CUDA GPUs)")
    distributed.add_arguments(parser)  # plumbing: --spawn N (no launcher), --dist-timeout SECONDS
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # DDP: set by the launcher
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS
    if accelerator is not None:
        if args.local_rank >= torch.accelerator.device_count():  # plumbing: more processes than GPUs on this machine
            raise UserError(f"local rank {args.local_rank} has no GPU: start <= {torch.accelerator.device_count()} per node")
        device = torch.device(accelerator.type, args.local_rank)  # DDP: one GPU per process, chosen by local rank
        torch.accelerator.set_device_index(args.local_rank)
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:
        device = torch.device("cpu")
        if rank == 0:  # plumbing: one line, not one per process
            print("no GPU found: running on the CPU")
    if args.sync_bn and device.type not in ("cuda", "xpu"):  # DDP: torch's SyncBatchNorm has kernels for these only
        raise UserError(f"--sync-bn needs CUDA or XPU GPUs (torch's SyncBatchNorm has no {device.type} kernel); drop it")
    backend = dist.get_default_backend_for_device(device)  # DDP: nccl for CUDA, xccl for XPU, gloo for CPU (and MPS)
    dist.init_process_group(backend, device_id=None if backend == "gloo" else device,  # DDP: rank, size from the env
                            timeout=args.dist_timeout)  # DDP: a dead peer = an error, not a hang
    checkpoint.continue_run(args)  # --resume: that run's settings (those not typed); --out-dir: this run's (refusals)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    if args.local_rank == 0:  # DDP: one process per machine downloads; the others wait at the barrier
        data.prepare_cifar10(args.data_dir)  # CIFAR-10: downloads unless a cifar-10-batches-py folder is there
    dist.barrier()
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    return train_set, test_set, data.Info(num_classes=10, synthetic=data.is_synthetic(args.data_dir))


def build_loaders(args, train_set, test_set):
    # DDP: each rank draws a disjoint 1/world_size shard of one shared permutation (seed + epoch).
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, sampler=range(dist.get_rank(), len(test_set), dist.get_world_size()),
                             num_workers=args.workers, pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn}  # --arch choices (the first is the default)


def build_model(args, num_classes):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=num_classes, mean=data.MEAN, std=data.STD)


def prepare_model(args, model, device):
    model = model.to(device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model  # DDP: BN over the global batch
    # DDP: copies rank 0's weights to all ranks now; averages gradients in buckets while backward still runs.
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type != "cpu" else None)


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # fp16 only (GPU, step 02)
    return optimizer, scheduler, scaler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(model, batches, optimizer, scheduler, scaler, device, amp_dtype):
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    for step, (images, labels) in enumerate(batches):  # whole accumulation groups (batches: see main)
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images = images.to(device, non_blocking=True, memory_format=batches.memory_format)
        labels = labels.to(device, non_blocking=True)
        last_pass = (step + 1) % batches.grad_accum == 0
        with contextlib.nullcontext() if last_pass else model.no_sync():  # DDP: all-reduce on the last pass only
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            scaler.scale(loss / batches.grad_accum).backward()  # gradients add up over the passes of a group
        if last_pass:  # DDP: gradients are averaged across ranks now; one optimizer step per group
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()  # gradients to None (the default): nothing to zero
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
    dist.all_reduce(totals)  # DDP: every rank saw different images; sum over ranks for the loss and throughput
    return metrics.train_row(totals, batches)


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, memory_format):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=memory_format)  # GPU: as in training
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # DDP: add up every shard's loss sum, hits and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic):
    # DataParallel: save the model inside the wrapper (no `module.` prefix), as every later step does too.
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.module.state_dict(), optimizer=optimizer, scheduler=scheduler,
                           scaler=scaler, args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler, scaler):
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch, verbose=dist.get_rank() == 0)
    if state is None:
        return 0, 0, {}
    epoch, global_step = checkpoint.restore(state, model=model.module, optimizer=optimizer, scheduler=scheduler,
                                            scaler=scaler)
    if dist.get_rank() == 0:  # plumbing: every rank read the same file; one of them says so
        print(f"resumed from {checkpoint.describe(state)}")
    return epoch, global_step, preempt.part_done(state)  # {epoch: its part done} if it stopped part-way


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:  # plumbing: no launcher: start --spawn N processes here (mp.spawn), or a group of one
        return distributed.without_launcher(main, argv, args.spawn)
    device, amp_dtype, rank, world_size = setup(args)
    stop = preempt.Stop(stop_after=args.stop_after)  # SIGTERM/SIGUSR1: finish the step, save, exit 75 (docstring)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info.num_classes), device)
    optimizer, scheduler, scaler = build_optimizer(args, model, len(train_loader) // args.grad_accum, device, amp_dtype)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # batches as NHWC
    batches = preempt.Batches(train_loader, args.grad_accum, memory_format, stop, part_done, metrics.Profile(args))
    train_model = torch.compile(model) if args.compile else model  # same weights; checkpoints use `model`
    log = metrics.MetricsLog(args.out_dir, start_epoch, info.synthetic) if rank == 0 else None  # DDP: rank 0 writes
    if rank == 0:  # plumbing: one rank prints and draws
        print(metrics.start_line(STEP, args, device, amp_dtype, train_loader, info.synthetic, processes=world_size))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # DDP: a new shared permutation each epoch (without it: same order every epoch)
        row = {"epoch": epoch, **train_one_epoch(train_model, batches.epoch(epoch), optimizer, scheduler, scaler,
                                                 device, amp_dtype)}
        global_step = scheduler.last_epoch  # optimizer steps so far (the schedule counts them)
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(train_model, test_loader, device, amp_dtype, memory_format))
        if rank == 0:  # DDP: one writer; the others would race on the same files
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info.synthetic)
            print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        dist.barrier()  # DDP: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        if stop.leave(epoch, start_epoch, args.epochs):  # a stop signal, or --stop-after: continue with --resume auto
            break

    if rank == 0:  # plumbing: one rank prints and draws
        metrics.plot(args.out_dir, f"{STEP} ({args.arch}, {world_size} processes)")
    checkpoint.write_digest(args.out_dir, rank, model.module.state_dict())  # DDP: equal files = equal replicas
    del model, train_model  # plumbing: free DDP now, not in a random later gc (it can hang the exit; docs/04-ddp.md)
    gc.collect()
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
