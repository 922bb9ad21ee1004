"""Step 04: one process per GPU with DistributedDataParallel (DDP), on one machine or many.

What changes from step 03: instead of one process driving all GPUs, a launcher starts one
process per GPU. Each process joins a process group (nccl on GPU, gloo on CPU), trains a full
replica on its own shard of every epoch (DistributedSampler, re-shuffled with set_epoch), and
DDP averages the gradients across processes during backward, so all replicas take the same step.
--batch-size is now PER PROCESS: the global batch is batch x processes (x --grad-accum).
Only rank 0 prints and saves; evaluation is sharded and summed exactly with all_reduce.

    torchrun --nproc_per_node=4 04_cifar10_ddp.py
    python -m torch.distributed.launch --nproc_per_node=4 04_cifar10_ddp.py   # legacy launcher
    torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=4 04_cifar10_ddp.py
    python 04_cifar10_ddp.py --spawn 4                                         # no launcher: mp.spawn
    python 04_cifar10_ddp.py                                                   # one process, world size 1
"""
import argparse
import contextlib
import datetime
import gc
import itertools
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from common import checkpoint, data, metrics, models
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int
from common.schedule import warmup_cosine

STEP = "04_cifar10_ddp"
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
LOG_EVERY = 20  # steps between progress-bar loss updates


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Step 04: CIFAR-10 with DistributedDataParallel, one process per GPU.")
    parser.add_argument("--data-dir", default="./data",
                        help="CIFAR-10 root holding cifar-10-batches-py/ (downloaded if missing; default ./data)")
    parser.add_argument("--out-dir", default=f"runs/{STEP}",
                        help=f"checkpoints, metrics.jsonl, training_curves.png (default runs/{STEP})")
    parser.add_argument("--epochs", type=positive_int, default=30, help="total epochs (default 30)")
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="images per PROCESS per forward pass; global batch = this x processes x --grad-accum "
                             "(default 128)")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="peak learning rate of SGD (default 0.1)")
    parser.add_argument("--arch", choices=sorted(models.ARCHS), default="resnet18",
                        help="resnet18 (default) or cnn (small and fast, for smoke runs)")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for weights, order and augmentation")
    parser.add_argument("--resume", metavar="PATH|auto",
                        help="checkpoint to continue from; 'auto' = newest in --out-dir (fresh start if none)")
    parser.add_argument("--stop-after", type=positive_int, metavar="N",
                        help="leave after N epochs of this run (time-limited jobs); continue with --resume auto")
    # GPU: the speed knobs of a single device.
    parser.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
                        help="mixed precision: auto = fp16 on GPU, bf16 on CPU (default auto)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                        help="NHWC memory layout, faster convolutions on tensor cores and CPUs (default on)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (first epoch pays a one-time compile, 30-60 s on CPU)")
    # DDP: what the launchers pass, and the options of data-parallel training.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by torch.distributed.launch (torchrun sets the LOCAL_RANK variable instead)")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="forward/backward passes per optimizer step; gradients sync only on the last (no_sync)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch-norm statistics over the global batch (SyncBatchNorm; needs CUDA GPUs)")
    parser.add_argument("--spawn", type=positive_int, metavar="N",
                        help="start N processes with torch.multiprocessing.spawn instead of a launcher")
    parser.add_argument("--dist-timeout", type=positive_int, default=600, metavar="SECONDS",
                        help="how long a collective waits for a missing rank before failing (default 600)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    torch.manual_seed(args.seed)
    # DDP: the launcher tells each process who it is through environment variables.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                            f"start at most {torch.cuda.device_count()} processes per node (--nproc_per_node)")
        device = torch.device("cuda", local_rank)  # DDP: one GPU per process, chosen by local rank
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:
        device = torch.device("cpu")
        if rank == 0:
            print("no CUDA GPU found: running on the CPU (gloo backend, bf16 autocast instead of fp16)")
    # DDP: nccl moves GPU tensors, gloo CPU tensors. The timeout bounds every collective, so a
    # dead peer turns into an error instead of a hang.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.dist_timeout),
                            device_id=device if device.type == "cuda" else None)
    # GPU: fp16 needs a GradScaler (its range is small); bf16 has fp32's range and does not.
    amp = {"auto": "fp16" if device.type == "cuda" else "bf16"}.get(args.amp, args.amp)
    if amp == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; on the CPU use --amp bf16 or --amp off")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch's SyncBatchNorm has no CPU kernel); drop --sync-bn on CPU")
    return device, amp_dtype, rank, world_size, local_rank


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
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)  # GPU: NHWC weights for NHWC batches
    # DDP: broadcasts rank 0's weights to all ranks now, then all-reduces (averages) gradients in
    # buckets during backward, overlapping communication with the rest of the backward pass.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.epochs * steps_per_epoch, WARMUP_EPOCHS * steps_per_epoch))
    # GPU: scales the fp16 loss so small gradients do not flush to zero; a no-op for bf16/fp32.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return optimizer, scheduler, scaler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, amp_dtype, memory_format, epoch,
                    grad_accum, rank):
    model.train()
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
        # DDP: with --grad-accum, skip the gradient all-reduce (no_sync) on all but the last pass.
        last_pass = (step + 1) % grad_accum == 0
        with contextlib.nullcontext() if last_pass else model.no_sync():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            scaler.scale(loss / grad_accum).backward()
        if last_pass:  # DDP: gradients are averaged across ranks now; step once per accumulation group
            scaler.step(optimizer)  # GPU: skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)  # DDP: only after the step: no_sync passes accumulate into .grad
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
def evaluate(model, loader, device, amp_dtype, memory_format):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        # GPU: the same device, memory layout and precision as in training.
        images = images.to(device, non_blocking=True, memory_format=memory_format)
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
    # DDP: called on rank 0 only; all replicas are identical, so one copy is the whole model.
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.module.state_dict(), optimizer=optimizer, scheduler=scheduler,
                           scaler=scaler, args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler, scaler, rank):
    # DDP: every rank reads the same file, so all replicas and optimizers restart identical.
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch)
    if state is None:
        if args.resume == "auto" and rank == 0:
            print(f"no checkpoint in {args.out_dir}: starting from scratch")
        return 0, 0
    epoch, global_step = checkpoint.restore(state, model=model.module, optimizer=optimizer, scheduler=scheduler,
                                            scaler=scaler)
    if rank == 0:  # DDP: one line, not one per process
        print(f"resumed from epoch {epoch} (written by {state['step']})")
    return epoch, global_step


# ----------------------------------------------------------------------------- main
def train(args):
    device, amp_dtype, rank, world_size, local_rank = setup(args)
    checkpoint.make_out_dir(args.out_dir)
    train_loader, test_loader, sampler = build_data(args, rank, world_size, local_rank)
    synthetic = data.is_synthetic(args.data_dir)
    model = build_model(args, device)
    optimizer, scheduler, scaler = build_optimizer(args, model, len(train_loader) // args.grad_accum, device, amp_dtype)
    start_epoch, global_step = resume(args, model, optimizer, scheduler, scaler, rank)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # GPU: batches as NHWC
    train_model = torch.compile(model) if args.compile else model  # GPU: same weights; checkpoints use `model`
    log = metrics.MetricsLog(args.out_dir, start_epoch, synthetic) if rank == 0 else None
    if rank == 0:
        print(f"{STEP}: {args.arch} on {world_size} x {device.type}, amp {amp_dtype}, batch {args.batch_size} per process "
              f"x {world_size} processes x {args.grad_accum} accumulation = {args.batch_size * world_size * args.grad_accum} "
              f"global, {len(train_loader.dataset)} training images, {len(train_loader) // args.grad_accum} steps/epoch"
              + ("  [SYNTHETIC DATA, not CIFAR-10]" if synthetic else ""))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # DDP: a new shared permutation each epoch (without it: same order every epoch)
        train_loader.dataset.set_epoch(epoch)
        row = {"epoch": epoch, **train_one_epoch(train_model, train_loader, optimizer, scheduler, scaler, device,
                                                 amp_dtype, memory_format, epoch, args.grad_accum, rank)}
        global_step += len(train_loader) // args.grad_accum
        row.update(evaluate(train_model, test_loader, device, amp_dtype, memory_format))
        if rank == 0:  # DDP: one writer; the others would race on the same files
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic)
            print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        dist.barrier()  # DDP: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        if args.stop_after and epoch - start_epoch >= args.stop_after and epoch < args.epochs:
            if rank == 0:
                print(f"stopping after {args.stop_after} epoch(s) as asked; continue with --resume auto")
            break

    if rank == 0:
        metrics.plot(args.out_dir, f"{STEP} ({args.arch}, {world_size} processes)")
    # DDP: every rank writes a fingerprint of its weights: equal files prove the replicas never diverged.
    checkpoint.write_digest(args.out_dir, rank, model.module.state_dict())
    # DDP: free the wrapper before leaving the group. It sits in a reference cycle; left to the
    # garbage collector, it would shut gloo's threads down at a random later moment while holding
    # the GIL, which can deadlock the exit (seen here under load; see README, troubleshooting).
    del model, train_model
    gc.collect()
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit


@exits_cleanly
def spawned(local_rank, args):
    # DDP: mp.spawn passes the process index; set what a launcher would have set, then train.
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.spawn))
    if "OMP_NUM_THREADS" not in os.environ:  # DDP: as torchrun does, so N processes do not fight over the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.spawn))
    train(args)


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ or args.spawn:
        # DDP: no launcher. Pick a rendezvous address on this machine for the processes we start.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if args.spawn:
        try:
            mp.spawn(spawned, args=(args,), nprocs=args.spawn)
        except mp.ProcessExitedException as error:
            raise UserError(f"rank {error.error_index} of {args.spawn} exited with status {error.exit_code}") from None
        return
    if "RANK" not in os.environ:
        print("not started by a launcher: running as a single process (world size 1)")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    train(args)


if __name__ == "__main__":
    main()
