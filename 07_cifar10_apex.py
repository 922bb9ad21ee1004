"""Step 07: NVIDIA Apex, honestly: the legacy API where it exists, its native successors everywhere.

What changes from step 04: --amp-backend chooses the mixed-precision and DDP stack. Old tutorials
teach Apex: `amp.initialize(model, optimizer, opt_level="O1")`, `with amp.scale_loss(loss, optimizer)`,
apex.parallel.DistributedDataParallel and convert_syncbn_model. Upstream removed apex.amp and
apex.parallel in May 2025 (NVIDIA/apex#1896): only Apex tags up to 25.05, built from source on a CUDA
machine, still have them, and `pip install apex` installs an unrelated package of the same name.
`apex` runs that legacy path when it is really there; `torch` runs its native successors
(torch.autocast + torch.amp.GradScaler, torch DDP, torch.nn.SyncBatchNorm), which is step 04; `auto`
takes apex when it can and says in one line why it did or did not. Where a current Apex has its
CUDA extensions, apex.optimizers.FusedSGD replaces torch.optim.SGD (same hyper-parameters) on both paths.

    torchrun --nproc_per_node=4 07_cifar10_apex.py                                     # auto
    python -m torch.distributed.launch --nproc_per_node=4 07_cifar10_apex.py --amp-backend apex --opt-level O1
    torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=4 07_cifar10_apex.py
    python 07_cifar10_apex.py --spawn 4 --amp-backend torch                            # no launcher: mp.spawn
    python 07_cifar10_apex.py                                                          # one process, world size 1
"""
import argparse
import contextlib
import datetime
import importlib.util
import io
import gc
import itertools
import os
import pickle
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

STEP = "07_cifar10_apex"
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
LOG_EVERY = 20  # steps between progress-bar loss updates


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Step 07: CIFAR-10 with NVIDIA Apex's legacy API or its successors.")
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
                        help="batch-norm statistics over the global batch (torch.nn.SyncBatchNorm, or Apex's with "
                             "--amp-backend apex; needs CUDA GPUs)")
    parser.add_argument("--spawn", type=positive_int, metavar="N",
                        help="start N processes with torch.multiprocessing.spawn instead of a launcher")
    parser.add_argument("--dist-timeout", type=positive_int, default=600, metavar="SECONDS",
                        help="how long a collective waits for a missing rank before failing (default 600)")
    # Apex: which stack trains, and the legacy API's own precision knob.
    parser.add_argument("--amp-backend", choices=["auto", "apex", "torch"], default="auto",
                        help="apex = apex.amp + apex.parallel (Apex <= 25.05 and a CUDA GPU); torch = torch.autocast + "
                             "GradScaler + torch DDP; auto = apex where it works, else torch (default auto)")
    parser.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default="O1",
                        help="apex.amp level, apex path only: O0 fp32, O1 fp16 casts per function, O2 fp16 model with "
                             "fp32 master weights, O3 pure fp16 (default O1)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def find_apex(device):
    """Apex: what NVIDIA Apex offers here: (apex with .amp and .parallel or None, FusedSGD or None, why no apex.amp)."""
    spec = importlib.util.find_spec("apex")
    if spec is None:
        return None, None, "NVIDIA Apex is not installed"
    folders = list(spec.submodule_search_locations or [])  # empty for a single-file module
    # Apex: `pip install apex` gives an unrelated package of that name; NVIDIA's has amp/ (<= 25.05) or optimizers/.
    if not any(os.path.isdir(os.path.join(folder, sub)) for folder in folders for sub in ("amp", "optimizers")):
        return None, None, (f"the apex in {folders[0] if folders else spec.origin} is the unrelated registry package "
                            "of that name, not NVIDIA Apex (pip uninstall apex)")
    fused_sgd = None
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # Apex: FusedSGD needs the CUDA extensions (amp_C), built with nvcc
            import amp_C  # noqa: F401
            from apex.optimizers import FusedSGD as fused_sgd
    if not any(os.path.isdir(os.path.join(folder, "amp")) for folder in folders):
        return None, fused_sgd, "the installed NVIDIA Apex is newer than 25.05, without apex.amp and apex.parallel"
    try:
        import apex.amp
        import apex.parallel
    except Exception as error:  # e.g. an old Apex that still imports torch._six, which torch 2.0 removed
        return None, fused_sgd, f"NVIDIA Apex does not import ({type(error).__name__}: {str(error)[:120]})"
    if device.type != "cuda":
        return None, fused_sgd, "apex.amp is installed but needs a CUDA GPU, and none was found"
    return apex, fused_sgd, None


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
    # Apex: choose the stack before joining the group, so a missing Apex stops every rank at once, in one line.
    apex, fused_sgd, missing = find_apex(device)
    legacy_misfit = args.amp in ("bf16", "off") or args.compile or args.grad_accum > 1  # not on the apex path here
    if args.amp_backend == "apex" and apex is None:
        raise UserError(f"--amp-backend apex needs NVIDIA Apex with apex.amp and a CUDA GPU, but {missing}. "
                        "apex.amp was removed upstream in May 2025: build Apex tag 25.05 or older from source on a "
                        "CUDA machine, or use an NGC PyTorch container that still has it (README, step 07); "
                        "or use --amp-backend torch")
    if args.amp_backend == "apex" and legacy_misfit:
        raise UserError("--amp-backend apex takes its precision from --opt-level (O0 = fp32) and is not combined with "
                        "--amp bf16/off, --compile or --grad-accum here: drop those, or use --amp-backend torch")
    if args.amp_backend == "auto" and rank == 0:
        why = missing or ("--amp bf16/off, --compile or --grad-accum was asked for" if legacy_misfit else None)
        print(f"amp backend: torch (auto: {why}; using its native successors torch.autocast + GradScaler + torch DDP)"
              if why else f"amp backend: apex (auto: apex.amp and a CUDA GPU found; --opt-level {args.opt_level})")
    if args.amp_backend == "torch" or legacy_misfit:
        apex = None
    # DDP: nccl moves GPU tensors, gloo CPU tensors. The timeout bounds every collective, so a
    # dead peer turns into an error instead of a hang.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.dist_timeout),
                            device_id=device if device.type == "cuda" else None)
    # GPU: fp16 needs a GradScaler (its range is small); bf16 has fp32's range and does not.
    amp = {"auto": "fp16" if device.type == "cuda" else "bf16"}.get(args.amp, args.amp)
    if amp == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; on the CPU use --amp bf16 or --amp off")
    # Apex: on the legacy path apex.amp does the casting (--opt-level), so torch.autocast stays off.
    amp_dtype = None if apex else {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch's SyncBatchNorm has no CPU kernel); drop --sync-bn on CPU")
    return device, amp_dtype, rank, world_size, local_rank, apex, fused_sgd  # Apex: the chosen stack


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
def build_model(args, device, apex):
    model = models.build_model(args.arch).to(device)
    if args.sync_bn:  # DDP: BN statistics over the global batch (Apex: the legacy converter, or torch's successor)
        model = apex.parallel.convert_syncbn_model(model) if apex else nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)  # GPU: NHWC weights for NHWC batches
    if apex:
        return model  # Apex: amp.initialize must see the bare model; build_optimizer wraps it in apex's DDP after that
    # DDP: broadcasts rank 0's weights to all ranks now, then all-reduces (averages) gradients in
    # buckets during backward, overlapping communication with the rest of the backward pass.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype, apex, fused_sgd):
    # Apex: with its CUDA extensions built, FusedSGD updates all parameters in a few fused kernels; same settings.
    optimizer = (fused_sgd or torch.optim.SGD)(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                               weight_decay=WEIGHT_DECAY, nesterov=True)
    if apex:
        # Apex: the legacy API patches model and optimizer in place (O1 casts per function, O2 keeps an fp16 model and
        # fp32 master weights in the optimizer, O3 is pure fp16), then apex's DDP wraps the patched model.
        model, optimizer = apex.amp.initialize(model, optimizer, opt_level=args.opt_level)
        model = apex.parallel.DistributedDataParallel(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.epochs * steps_per_epoch, WARMUP_EPOCHS * steps_per_epoch))
    # GPU: scales the fp16 loss so small gradients do not flush to zero; a no-op for bf16/fp32.
    # Apex: on the legacy path apex.amp owns the loss scale; its state_dict()/load_state_dict() fill the "scaler" slot.
    scaler = apex.amp if apex else torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return model, optimizer, scheduler, scaler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, amp_dtype, memory_format, epoch,
                    grad_accum, rank, apex):
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
            if apex:  # Apex: the legacy loss scaling; leaving the block unscales the gradients and checks for overflow
                with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                scaler.scale(loss / grad_accum).backward()
        if last_pass:  # DDP: gradients are averaged across ranks now; step once per accumulation group
            if apex:
                optimizer.step()  # Apex: amp patched step() to skip the step if fp16 gradients overflowed
            else:
                scaler.step(optimizer)  # GPU: skips the step if fp16 gradients overflowed
                scaler.update()
            scheduler.step()
            # DDP: only after the step: no_sync passes accumulate into .grad. Apex: O2 patches zero_grad() without
            # arguments; torch's default already sets the gradients to None.
            optimizer.zero_grad()
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
def weights_only_loadable(state):
    """Apex: True if torch.load(weights_only=True) takes `state` back, i.e. it is plain data (numbers in dicts)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
        return True
    except pickle.UnpicklingError:
        return False


def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic):
    # DDP: called on rank 0 only; all replicas are identical, so one copy is the whole model.
    # Apex: O2/O3 keep fp16 weights in the model; the common format holds fp32 ones, which 01-04 load as their own.
    model_state = {name: t.float() if t.is_floating_point() else t for name, t in model.module.state_dict().items()}
    if not weights_only_loadable(scaler.state_dict()):  # Apex: amp.state_dict() goes in only as plain data
        print("warning: the loss-scaler state is not plain data; this checkpoint holds none", file=sys.stderr)
        scaler = None
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model_state, optimizer=optimizer, scheduler=scheduler,
                           scaler=scaler, args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler, scaler, rank):
    # DDP: every rank reads the same file, so all replicas and optimizers restart identical.
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch)
    if state is None:
        if args.resume == "auto" and rank == 0:
            print(f"no checkpoint in {args.out_dir}: starting from scratch")
        return 0, 0
    # Apex: torch's GradScaler state and apex.amp's loss scalers ("loss_scaler0") do not fit each other: start afresh.
    saved_by_apex = any(key.startswith("loss_scaler") for key in state["scaler"] or {})
    if saved_by_apex != (not isinstance(scaler, torch.amp.GradScaler)):
        state["scaler"] = None
    epoch, global_step = checkpoint.restore(state, model=model.module, optimizer=optimizer, scheduler=scheduler,
                                            scaler=scaler)
    if rank == 0:  # DDP: one line, not one per process
        print(f"resumed from epoch {epoch} (written by {state['step']})")
    return epoch, global_step


# ----------------------------------------------------------------------------- main
def train(args):
    device, amp_dtype, rank, world_size, local_rank, apex, fused_sgd = setup(args)
    checkpoint.make_out_dir(args.out_dir)
    train_loader, test_loader, sampler = build_data(args, rank, world_size, local_rank)
    synthetic = data.is_synthetic(args.data_dir)
    model = build_model(args, device, apex)
    model, optimizer, scheduler, scaler = build_optimizer(args, model, len(train_loader) // args.grad_accum, device,
                                                          amp_dtype, apex, fused_sgd)  # Apex: wraps the model late
    start_epoch, global_step = resume(args, model, optimizer, scheduler, scaler, rank)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # GPU: batches as NHWC
    train_model = torch.compile(model) if args.compile else model  # GPU: same weights; checkpoints use `model`
    log = metrics.MetricsLog(args.out_dir, start_epoch, synthetic) if rank == 0 else None
    if rank == 0:
        precision = f"apex.amp {args.opt_level}" if apex else amp_dtype  # Apex: who casts, and how
        print(f"{STEP}: {args.arch} on {world_size} x {device.type}, amp {precision}, batch {args.batch_size} per process "
              f"x {world_size} processes x {args.grad_accum} accumulation = {args.batch_size * world_size * args.grad_accum} "
              f"global, {len(train_loader.dataset)} training images, {len(train_loader) // args.grad_accum} steps/epoch"
              + ("  [SYNTHETIC DATA, not CIFAR-10]" if synthetic else ""))
        # Apex: which optimizer runs: FusedSGD where Apex's CUDA extensions are built, torch.optim.SGD otherwise.
        print("optimizer: " + ("apex.optimizers.FusedSGD (Apex CUDA extensions found)" if fused_sgd else
                               "torch.optim.SGD (no Apex CUDA extensions here)"))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # DDP: a new shared permutation each epoch (without it: same order every epoch)
        train_loader.dataset.set_epoch(epoch)
        row = {"epoch": epoch, **train_one_epoch(train_model, train_loader, optimizer, scheduler, scaler, device,
                                                 amp_dtype, memory_format, epoch, args.grad_accum, rank, apex)}
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
