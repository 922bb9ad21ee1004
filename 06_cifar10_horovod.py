"""Step 06: one process per GPU with Horovod, on one machine or many.

What changes from step 04: Horovod takes the place of torch.distributed and DDP. horovodrun starts
the processes, hvd.init() connects them, the model stays a plain module, hvd.DistributedOptimizer
averages the gradients with allreduce, and broadcasts copy rank 0's weights and optimizer state.

    horovodrun -np 4 -H localhost:4 python 06_cifar10_horovod.py
    horovodrun -np 8 -H host1:4,host2:4 python 06_cifar10_horovod.py   # 2 machines x 4 (ssh, same paths)
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, horovod_support, metrics, models, preempt
from common.cli import UserError, amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
hvd = exits_cleanly(horovod_support.load)()  # Horovod: import horovod.torch, or say how to build it


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser("Step 06: training with Horovod, one process per GPU.", STEP, ARCHS)
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch-norm statistics over the global batch (SyncBatchNorm; needs CUDA GPUs)")
    parser.add_argument("--fp16-allreduce", action="store_true",  # Horovod: gradient compression
                        help="send gradients as fp16 in the allreduce: half the traffic, some precision lost")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    rank, world_size, args.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()  # Horovod: from hvd.init()
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS
    if accelerator is not None and accelerator.type != "cuda":  # Horovod: NCCL (CUDA, ROCm) or Gloo (CPU) only
        raise UserError(f"Horovod has no {accelerator.type} support: use step 04 (DDP) on this machine")
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
    if args.sync_bn and device.type != "cuda":  # Horovod: its SyncBatchNorm runs on CUDA GPUs only
        raise UserError("--sync-bn needs CUDA GPUs (Horovod's SyncBatchNorm has no CPU kernel); drop --sync-bn on CPU")
    horovod_support.share_cores(hvd)  # Horovod: horovodrun does not set OMP_NUM_THREADS (torchrun does)
    checkpoint.continue_run(args, horovod_support.share(hvd))  # --resume: that run's settings (Horovod: broadcast)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    if args.local_rank == 0:  # DDP: one process per machine downloads; the others wait at the barrier
        data.prepare_cifar10(args.data_dir)  # CIFAR-10: downloads unless a cifar-10-batches-py folder is there
    hvd.barrier()  # Horovod: in place of dist.barrier(): there is no torch process group
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    return train_set, test_set, data.Info(num_classes=10, synthetic=data.is_synthetic(args.data_dir))


def build_loaders(args, train_set, test_set):
    # DDP: each rank draws a disjoint 1/world_size shard of one shared permutation (seed + epoch).
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, sampler=range(hvd.rank(), len(test_set), hvd.size()),
                             num_workers=args.workers, pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn}  # --arch choices (the first is the default)


def build_model(args, num_classes):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=num_classes, mean=data.MEAN, std=data.STD)


def prepare_model(args, model, device):
    model = model.to(device)
    # Horovod: NCHW weights: its broadcast and allreduce refuse channels_last tensors (--channels-last: NHWC batches).
    model = horovod_support.sync_batchnorm(hvd, model) if args.sync_bn else model  # Horovod: its own SyncBatchNorm
    # Horovod: no wrapper: the plain module (DistributedOptimizer averages its gradients; resume() broadcasts it).
    return model


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    # Horovod: step() waits for gradients averaged over all ranks; hooks start each allreduce as soon as backward
    # has produced that gradient, on every --grad-accum-th pass only. (Horovod's examples also scale lr by hvd.size().)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=args.grad_accum,
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
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
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / batches.grad_accum).backward()  # Horovod: its allreduce starts on the group's last pass itself
        if last_pass:
            optimizer.synchronize()  # Horovod: wait for the averaged gradients before the scaler looks at them
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():  # Horovod: and step without a second wait (its AMP pattern)
                scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()  # gradients to None (the default): nothing to zero
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
    totals = hvd.allreduce(totals, op=hvd.Sum, name="train_totals")  # Horovod: sum over ranks (default: average)
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
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")  # Horovod: add up every shard's sums and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic):
    # DataParallel: save the model inside the wrapper (no `module.` prefix), as every later step does too.
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.state_dict(), optimizer=optimizer, scheduler=scheduler,  # Horovod
                           scaler=scaler, args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler, scaler):
    # Horovod: only rank 0 reads the checkpoint (only its disk has them); broadcasts then copy its state.
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch) if hvd.rank() == 0 else None
    epoch, global_step, part_done = 0, 0, {}
    if state is not None:
        epoch, global_step = checkpoint.restore(state, model=model, optimizer=optimizer, scheduler=scheduler,
                                                scaler=scaler)
        print(f"resumed from {checkpoint.describe(state)}")
        part_done = preempt.part_done(state)  # {epoch: its part done} if it stopped part-way
    # Horovod: rank 0's position in the run, schedule and loss scale; its momentum and weights below.
    epoch, global_step, part_done = horovod_support.broadcast_run(hvd, epoch, global_step, part_done, scheduler, scaler)
    if global_step > 0:  # Horovod: momentum (on a fresh optimizer this would take a zero-gradient step first)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod: rank 0's weights: identical replicas
    return epoch, global_step, part_done


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    hvd.init()  # Horovod: connects to the processes horovodrun started (plain python: a group of one); no process group
    device, amp_dtype, rank, world_size = setup(args)
    stop = preempt.Stop(horovod_support.agree(hvd), args.stop_after)  # Horovod: ranks agree to stop by its allreduce
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
        hvd.broadcast_parameters(dict(model.named_buffers()), root_rank=0)  # Horovod: rank 0's BN statistics (as DDP)
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(train_model, test_loader, device, amp_dtype, memory_format))
        if rank == 0:  # DDP: one writer; the others would race on the same files
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info.synthetic)
            print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        hvd.barrier()  # Horovod: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        if stop.leave(epoch, start_epoch, args.epochs):  # a stop signal, or --stop-after: continue with --resume auto
            break

    if rank == 0:  # plumbing: one rank prints and draws
        metrics.plot(args.out_dir, f"{STEP} ({args.arch}, {world_size} processes)")
    checkpoint.write_digest(args.out_dir, rank, model.state_dict())  # Horovod: a plain module's weights
    hvd.shutdown()  # Horovod: stop its background thread cleanly so horovodrun sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
