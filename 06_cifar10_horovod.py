"""Step 06: one process per GPU with Horovod, on one machine or many.

What changes from step 04: Horovod takes the place of torch.distributed and DDP. `horovodrun`
starts one process per GPU (or CPU slot), `hvd.init()` connects them, and the model stays a
plain module: `hvd.DistributedOptimizer` wraps the optimizer and averages every gradient with an
allreduce (started by hooks during backward) before each step. `hvd.broadcast_parameters` copies
rank 0's weights to every rank at the start; after a resume `hvd.broadcast_optimizer_state` also
copies its optimizer state (only rank 0 reads the checkpoint). --batch-size is PER PROCESS, and
--lr is the peak learning rate of the global batch, as in every step (Horovod's own examples
multiply it by hvd.size(); see docs/06-horovod.md). Only rank 0 writes checkpoints; evaluation is
sharded and summed exactly.

    horovodrun -np 4 -H localhost:4 python 06_cifar10_horovod.py             # 4 processes, this machine
    horovodrun -np 2 python 06_cifar10_horovod.py                            # 2 processes, this machine
    horovodrun -np 8 -H host1:4,host2:4 python 06_cifar10_horovod.py         # 2 machines x 4 (ssh, same paths)
    python 06_cifar10_horovod.py                                             # one process, size 1

Horovod is built from source for the installed torch: bash scripts/install_horovod.sh
"""
import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from common import checkpoint, data, metrics, models
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int
from common.schedule import warmup_cosine

try:
    import horovod.torch as hvd
except ImportError as error:  # Horovod: built from source (scripts/install_horovod.sh), so it may be missing
    hvd, HOROVOD_IMPORT_ERROR = None, error

STEP = "06_cifar10_horovod"
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
LOG_EVERY = 20  # steps between progress-bar loss updates


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Step 06: CIFAR-10 with Horovod, one process per GPU.")
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
                        help="NHWC batches, faster convolutions on tensor cores and CPUs (default on; "
                             "the weights stay NCHW under Horovod)")  # Horovod: see build_model
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (first epoch pays a one-time compile, 30-60 s on CPU)")
    # Horovod: the options of data-parallel training. horovodrun passes nothing on the command line
    # (ranks come from hvd.init()), so 04's --local-rank, --spawn and --dist-timeout are gone.
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="forward/backward passes per optimizer step; gradients are allreduced only on the last "
                             "(backward_passes_per_step)")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as fp16 in the allreduce: half the traffic, a little precision lost "
                             "(hvd.Compression.fp16)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch-norm statistics over the global batch (hvd.SyncBatchNorm; needs CUDA GPUs)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    torch.manual_seed(args.seed)
    # Horovod: connects to the other processes horovodrun started (under plain python: a group of one).
    hvd.init()
    rank, world_size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    if "OMP_NUM_THREADS" not in os.environ:  # Horovod: horovodrun does not set it (torchrun does): share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    if world_size == 1:  # Horovod: say so, a forgotten horovodrun would otherwise go unnoticed
        print("not started by horovodrun (or -np 1): running as a single process (size 1)")
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                            f"start at most {torch.cuda.device_count()} processes per host (-H host:slots)")
        if not hvd.cuda_built():  # Horovod: a CPU-only build cannot allreduce GPU tensors
            raise UserError("this Horovod was built without GPU support: rebuild it with `HOROVOD_GPU_OPERATIONS=NCCL "
                            f"PYTHON={sys.executable} bash scripts/install_horovod.sh` (CUDA torch installed first)")
        device = torch.device("cuda", local_rank)  # Horovod: one GPU per process, chosen by local rank
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:
        device = torch.device("cpu")
        if rank == 0:
            print("no CUDA GPU found: running on the CPU (Gloo allreduce, bf16 autocast instead of fp16)")
    # Horovod: no process group to create: hvd.init() connected the ranks. Horovod moves GPU tensors with
    # NCCL (as built by install_horovod.sh), CPU tensors with Gloo; a dead peer ends the job (see main).
    # GPU: fp16 needs a GradScaler (its range is small); bf16 has fp32's range and does not.
    amp = {"auto": "fp16" if device.type == "cuda" else "bf16"}.get(args.amp, args.amp)
    if amp == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; on the CPU use --amp bf16 or --amp off")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (hvd.SyncBatchNorm has no CPU path); drop --sync-bn on CPU")
    return device, amp_dtype, rank, world_size, local_rank


# ----------------------------------------------------------------------------- data
def build_data(args, rank, world_size, local_rank):
    # DDP: one process per machine downloads; the others wait at the barrier, then all read it.
    if local_rank == 0:
        data.prepare_cifar10(args.data_dir)  # downloads unless a cifar-10-batches-py folder is there
    hvd.barrier()  # Horovod: instead of dist.barrier(): there is no torch process group
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    # Horovod: each rank draws a disjoint 1/size shard of one shared permutation (seed + epoch); with no
    # process group the sampler must be told num_replicas and rank (hvd.size(), hvd.rank()).
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    # Horovod: workers are started by a fresh forkserver, not forked from this process, whose Horovod
    # threads (and, with MPI/InfiniBand, memory registrations) are not fork-safe; as in Horovod's examples.
    context = "forkserver" if args.workers > 0 else None
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.cuda.is_available(),  # GPU: page-locked batches copy asynchronously
                              multiprocessing_context=context)
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, sampler=range(rank, len(test_set), world_size),
                             num_workers=args.workers, pin_memory=torch.cuda.is_available(),
                             multiprocessing_context=context)
    if len(train_loader) < args.grad_accum:
        raise UserError(f"{world_size} process(es) x --batch-size {args.batch_size} x --grad-accum {args.grad_accum} "
                        f"needs more than the {len(train_set)} training images: lower them")
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
def sync_batchnorm(module):
    """Horovod: hvd.SyncBatchNorm in place of every batch norm (Horovod has no convert_sync_batchnorm)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        sync = hvd.SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        sync.load_state_dict(module.state_dict())  # same parameter and buffer names: checkpoints do not change
        return sync
    for name, child in module.named_children():
        setattr(module, name, sync_batchnorm(child))
    return module


def build_model(args, device):
    model = models.build_model(args.arch).to(device)
    if args.sync_bn:
        model = sync_batchnorm(model).to(device)  # Horovod: BN statistics over the global batch
    # Horovod: with --channels-last only the batches are NHWC (convolutions still pick NHWC kernels); the
    # weights keep the default layout: Horovod refuses non-contiguous tensors such as channels_last weights
    # and their gradients in broadcast and allreduce ("Tensor is required to be contiguous", horovod#3491).
    # Horovod: no wrapper. The model stays a plain module (no `module.` prefix); DistributedOptimizer
    # averages its gradients and resume() broadcasts rank 0's weights, which keeps the replicas equal.
    return model


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    # --lr is for the global batch, as in every step. Horovod's examples write lr=args.lr * hvd.size()
    # (linear scaling: more processes, bigger global batch, bigger lr); here you choose it with --lr.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    # Horovod: step() now waits for the gradients averaged over all ranks. Hooks start each tensor's
    # allreduce as soon as backward has produced it (overlapping communication with the rest of backward),
    # on every --grad-accum-th backward pass only; fp16 compression halves the bytes sent.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.grad_accum)
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
        # Horovod: no no_sync(): DistributedOptimizer counts the backward passes (backward_passes_per_step)
        # and allreduces on the last of each group. It sums the passes and does not divide: hence / grad_accum.
        last_pass = (step + 1) % grad_accum == 0
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / grad_accum).backward()
        if last_pass:
            # Horovod: wait for the averaged gradients first. Otherwise the scaler would unscale and check for
            # inf the local gradients while their allreduce still runs, and step() would then put the still-
            # scaled average in their place. Then step without a second synchronize (the documented AMP pattern).
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)  # GPU: skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()  # Horovod: its zero_grad() takes no set_to_none (None is torch's default)
        loss_sum += loss.detach() * len(labels)  # stays on the device: no wait per step
        seen += len(labels)
        if not bar.disable and step % LOG_EVERY == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    # Horovod: allreduce averages by default. Every rank saw as many images, so the mean of the ranks'
    # mean losses is the mean over all images; the throughput counts every rank's images.
    train_loss = hvd.allreduce(loss_sum.double() / seen, name="train_loss").item()
    seen *= hvd.size()
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
    # Horovod: op=Sum, not the default Average: the shards differ in size, and exact evaluation adds up
    # every shard's loss sum, hits and count.
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic):
    # DDP: called on rank 0 only; all replicas are identical, so one copy is the whole model.
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.state_dict(), optimizer=optimizer, scheduler=scheduler,  # Horovod: unwrapped
                           scaler=scaler, args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler, scaler, rank):
    # Horovod: only rank 0 reads the checkpoint (only rank 0 writes them, so on several machines only
    # its disk has them); everything below then copies rank 0's state to the other ranks.
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch) if rank == 0 else None
    epoch, global_step = 0, 0
    if state is None:
        if args.resume == "auto" and rank == 0:
            print(f"no checkpoint in {args.out_dir}: starting from scratch")
    else:
        epoch, global_step = checkpoint.restore(state, model=model, optimizer=optimizer, scheduler=scheduler,
                                                scaler=scaler)
        print(f"resumed from epoch {epoch} (written by {state['step']})")
    # Horovod: what the two broadcasts below do not carry: the position in the run and the schedule.
    epoch, global_step, schedule, scale = hvd.broadcast_object(
        (epoch, global_step, scheduler.state_dict(), scaler.state_dict()), root_rank=0, name="resume")
    scheduler.load_state_dict(schedule)
    if scale:  # {} = a disabled (bf16/fp32) scaler
        scaler.load_state_dict(scale)
    # Horovod: rank 0's momentum buffers and learning rates. Only after a resume: on an empty optimizer
    # this call first takes a zero-gradient step to create the state, and with weight decay that step
    # moves the weights. The other ranks take that step here, so the weights are broadcast after it.
    if epoch > 0:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Horovod: rank 0's weights (fresh or resumed) to every rank: all replicas start identical.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
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
        # Horovod: batch-norm running statistics are buffers, which DistributedOptimizer never averages, so each
        # rank's follow its own shard. DDP broadcasts rank 0's before every forward; once before evaluating is
        # enough (training normalises with batch statistics): every rank then evaluates and saves the same model.
        hvd.broadcast_parameters(dict(model.named_buffers()), root_rank=0)
        row.update(evaluate(train_model, test_loader, device, amp_dtype, memory_format))
        if rank == 0:  # DDP: one writer; the others would race on the same files
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic)
            print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        hvd.barrier()  # Horovod: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        if args.stop_after and epoch - start_epoch >= args.stop_after and epoch < args.epochs:
            if rank == 0:
                print(f"stopping after {args.stop_after} epoch(s) as asked; continue with --resume auto")
            break

    if rank == 0:
        metrics.plot(args.out_dir, f"{STEP} ({args.arch}, {world_size} processes)")
    # DDP: every rank writes a fingerprint of its weights: equal files prove the replicas never diverged.
    checkpoint.write_digest(args.out_dir, rank, model.state_dict())
    hvd.shutdown()  # Horovod: stop its background thread cleanly so horovodrun sees a clean exit


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if hvd is None:  # Horovod: one line with the fix instead of an ImportError
        reason = str(HOROVOD_IMPORT_ERROR).strip().splitlines()[0][:120]
        raise UserError(f"Horovod is not importable by {sys.executable} ({reason}): build it for this torch with "
                        f"`PYTHON={sys.executable} bash scripts/install_horovod.sh`, then run with that python")
    try:
        train(args)
    except hvd.HorovodInternalError:
        # Horovod: another rank failed mid-collective (its own error is in the log); one line, not a traceback.
        raise UserError("another rank stopped, so Horovod shut down (that rank's own error is above); "
                        "horovodrun ends the job") from None


if __name__ == "__main__":
    main()
