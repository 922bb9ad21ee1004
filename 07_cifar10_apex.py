"""Step 07: NVIDIA Apex, honestly: the legacy API where it exists, its native successors everywhere.

What changes from step 04: --amp-backend picks the stack. `apex`: the old tutorials' amp.initialize, amp.scale_loss and
apex.parallel (only NVIDIA Apex <= 25.05 has them); `torch`: their successors (step 04); `auto` picks and says why.
Apex's FusedSGD replaces torch's SGD where its CUDA extensions exist.

    python -m torch.distributed.launch --nproc_per_node=4 07_cifar10_apex.py --amp-backend apex --opt-level O1
"""
import contextlib
import datetime
import gc
import importlib.util
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.utils.distributed import get_free_port  # DDP: --spawn's port
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

# Apex: its legacy API (apex.amp, apex.parallel) exists only up to tag 25.05, built from source on a CUDA machine; what
# `pip install apex` gives is an unrelated package. Its FusedSGD needs its CUDA extensions (amp_C).
try:
    import apex.amp  # Apex:
    import apex.parallel  # Apex:
    WHY_NOT = None  # Apex: it is there
except ImportError as error:  # Apex: why not (not installed, newer than 25.05, the unrelated package, torch 2 broke it)
    apex, WHY_NOT = None, (
        "NVIDIA Apex is not installed" if error.name == "apex" else
        f"NVIDIA Apex does not import ({error})" if not error.name.startswith("apex.") else
        "the installed NVIDIA Apex is newer than 25.05, without apex.amp and apex.parallel"
        if importlib.util.find_spec("apex.optimizers") else f"the apex in {importlib.util.find_spec('apex').origin} is "
        "the unrelated registry package of that name, not NVIDIA Apex (pip uninstall apex)")  # Apex:
try:  # Apex: FusedSGD, with its CUDA extensions (amp_C, built with nvcc)
    import amp_C  # noqa: F401
    from apex.optimizers import FusedSGD
except ImportError:  # Apex: torch's SGD
    FusedSGD = None

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
FIXED_SCALE = ("O0", "O3")  # Apex: apex.amp's levels with a fixed loss scale (O1, O2: dynamic, kept in checkpoints)


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)  # the flags of every step
    # DDP: torch.distributed.launch passes --local-rank=N (torchrun sets LOCAL_RANK instead); the GPU it uses
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="no launcher: start N processes")  # DDP: main
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS", help="wait for a missing rank")  # DDP:
    parser.add_argument("--sync-bn", action="store_true", help="batch norm over the global batch (CUDA, XPU)")  # DDP:
    parser.add_argument("--amp-backend", choices=["auto", "apex", "torch"], default="auto",  # Apex: the stack
                        help="apex = apex.amp + apex.parallel (Apex <= 25.05, CUDA); torch = autocast + GradScaler + DDP")
    parser.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default="O1",  # Apex: apex.amp's
                        help="apex.amp: O0 fp32, O1 casts per function, O2 fp16 model + fp32 masters, O3 pure fp16")
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
        if rank == 0:  # plumbing: one line, not one per process
            print("no GPU found: running on the CPU")
    if args.sync_bn and device.type not in ("cuda", "xpu"):  # DDP: torch's SyncBatchNorm has kernels for these only
        sys.exit(f"--sync-bn needs CUDA or XPU GPUs (torch's SyncBatchNorm has no {device.type} kernel); drop it")
    why_not = WHY_NOT or (None if device.type == "cuda" else "apex.amp needs a CUDA GPU, and none was found")  # Apex:
    misfit = args.amp in ("bf16", "off") or args.compile or args.grad_accum > 1  # Apex: not on its path here
    if args.amp_backend == "apex" and (why_not or misfit):  # Apex: impossible: every rank stops before the group forms
        sys.exit(f"--amp-backend apex needs NVIDIA Apex with apex.amp and a CUDA GPU, but {why_not}. apex.amp was "
                 "removed upstream in May 2025: build Apex tag 25.05 or older from source on a CUDA machine, or use an "
                 "NGC PyTorch container that still has it (docs/07-apex.md); or use --amp-backend torch" if why_not else
                 "--amp-backend apex takes its precision from --opt-level (O0 = fp32) and is not combined with --amp "
                 "bf16/off, --compile or --grad-accum here: drop those, or use --amp-backend torch")
    use_apex = args.amp_backend == "apex" or args.amp_backend == "auto" and not (why_not or misfit)  # Apex:
    if args.amp_backend == "auto" and rank == 0:  # Apex: what auto chose, and why
        print(f"amp backend: apex (auto: apex.amp and a CUDA GPU found; --opt-level {args.opt_level})" if use_apex else
              f"amp backend: torch (auto: {why_not or '--amp bf16/off, --compile or --grad-accum was asked for'}; "
              "using its native successors torch.autocast + GradScaler + torch DDP)")
    backend = dist.get_default_backend_for_device(device)  # DDP: nccl for CUDA, xccl for XPU, gloo for CPU (and MPS)
    dist.init_process_group(backend, device_id=None if backend == "gloo" else device,  # DDP: rank, size from the env
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # DDP: a dead peer = an error
    verdict = [checkpoint.settings(args) if rank == 0 else None]  # DDP: rank 0 alone reads --resume's checkpoint
    dist.broadcast_object_list(verdict, src=0)  # DDP: collective: its settings on every rank (no shared disk needed)
    verdict[0].apply(args)  # DDP: that run's settings (those not typed), or the error, on every rank
    torch.manual_seed(args.seed)
    # Apex: on its path apex.amp casts (no autocast), and `apex` names the stack
    return device, None if use_apex else amp_dtype(args.amp, device), rank, world_size, apex if use_apex else None


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
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers, pin_memory=torch.accelerator.is_available(),
                             sampler=range(dist.get_rank(), len(test_set), dist.get_world_size()))
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
# --arch chooses one of these; the first is the default.
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device, apex):  # Apex: `apex`: the legacy stack, or None
    model = model.to(device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if args.sync_bn:  # Apex: BN statistics over the global batch by the legacy converter, or torch's successor
        model = apex.parallel.convert_syncbn_model(model) if apex else nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if apex:  # Apex: amp.initialize must see the bare model; build_optimizer wraps it in apex's DDP after that
        return model
    # DDP: collective: copies rank 0's weights to all ranks now; averages gradients in buckets while backward still runs.
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type != "cpu" else None)


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype, apex):  # Apex: it returns the model too
    optimizer = (FusedSGD or torch.optim.SGD)(model.parameters(), lr=args.lr, momentum=MOMENTUM,  # Apex: FusedSGD
                                              weight_decay=WEIGHT_DECAY, nesterov=True)  # where its kernels exist
    if apex:  # Apex: the legacy API patches model and optimizer in place (--opt-level); then its DDP wraps the model
        model, optimizer = apex.amp.initialize(model, optimizer, opt_level=args.opt_level)
        model = apex.parallel.DistributedDataParallel(model)  # Apex: collective: broadcasts rank 0's parameters
        optimizer.zero_grad()  # Apex: O2 makes its fp32 master weights now (not at the first step): from rank 0's
        # weights, and before --resume loads into them
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS))
    # Apex: on the legacy path apex.amp owns the loss scale; its state_dict()/load_state_dict() fill the "scaler" slot.
    scaler = apex.amp if apex else torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return model, optimizer, scheduler, scaler  # Apex:


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(args, model, loader, optimizer, scheduler, scaler, device, amp_dtype, stop, meter, apex):  # Apex:
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # batches as NHWC
    for step, (images, labels) in enumerate(loader):
        meter.batch_in_hand()  # per-rank timing (metrics.Meter): the wait for this batch was data time
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images, labels = (images.to(device, non_blocking=True, memory_format=memory_format),
                          labels.to(device, non_blocking=True))
        last_pass = (step + 1) % args.grad_accum == 0
        with contextlib.nullcontext() if last_pass else model.no_sync():  # DDP: all-reduce on the last pass only
            # DDP: collective: the forward broadcasts rank 0's buffers (batch-norm statistics) to every replica
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            if apex:  # Apex: the legacy loss scaling; leaving the block unscales the gradients and checks for overflow
                with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()  # Apex: collective: its DDP averages the gradients
            else:  # Apex: its successors, as in 04
                scaler.scale(loss / args.grad_accum).backward()  # DDP: collective on the last pass: averages gradients
        if last_pass:  # DDP: gradients are averaged across ranks now; one optimizer step per group
            if apex:  # Apex: amp patched step() to skip the step if fp16 gradients overflowed
                optimizer.step()
            else:  # Apex: as in 04
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
    for buffer in model.module.buffers() if apex else ():  # Apex: its DDP never syncs buffers (04's: every forward)
        dist.broadcast(buffer, src=0)  # Apex: collective: rank 0's batch-norm statistics to every rank
    dist.all_reduce(totals)  # DDP: collective: every rank saw different images; the sums over ranks
    timing = meter.timing().to(device)  # DDP: this rank's timing in its slots (on the device: NCCL takes no CPU tensor)
    dist.all_reduce(timing, op=dist.ReduceOp.MAX)  # DDP: collective
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
    dist.all_reduce(totals)  # DDP: collective: add up every shard's loss sum, hits and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def master_weights(model, optimizer, apex):  # Apex:
    # Apex: O2 keeps fp16 weights in the model and trains fp32 copies of them, its "master weights", in the optimizer:
    # {name: the weight the optimizer trains}; off the legacy path {} (there the model's own weights are trained)
    names = [name for name, _ in model.module.named_parameters()]  # Apex: in the optimizer's order
    return dict(zip(names, apex.amp.master_params(optimizer))) if apex else {}  # Apex:


def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info, apex):  # Apex:
    # Apex: the common format holds fp32 weights, which 01-04 load as their own: under O2 the masters, under O3 the
    # model's fp16 weights cast (they have no masters).
    masters = master_weights(model, optimizer, apex)  # Apex:
    model_state = {name: masters.get(name, t).detach().float() if t.is_floating_point() else t  # Apex: masters.get
                   for name, t in model.module.state_dict().items()}
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model_state, optimizer=optimizer, scheduler=scheduler,  # Apex: (see above)
                           scaler=None if apex and args.opt_level in FIXED_SCALE else scaler,  # Apex: nothing to keep
                           args=args, metrics=row, synthetic=info.synthetic)


def resume(args, model, optimizer, scheduler, scaler, apex):  # Apex:
    # --resume's checkpoint into the objects; (epochs done, steps done, {epoch: its part done} if it stopped part-way)
    def load_weights(saved):  # Apex: into the model (rounded to fp16 under O2) and, exact, into O2's fp32 masters
        model.module.load_state_dict(saved)  # Apex: the model, as 04 loads it
        for name, master in master_weights(model, optimizer, apex).items():  # Apex:
            master.detach().copy_(saved[name])  # Apex: (the optimizer's state then loads in fp32, as they are)

    return checkpoint.resume(args, model=load_weights, optimizer=optimizer, scheduler=scheduler,  # Apex: load_weights
                             # Apex: GradScaler's and apex.amp's states do not fit each other: the other's starts
                             # afresh; at O0 and O3 the loss scale is fixed at 1 (a saved dynamic one would stick)
                             scaler=lambda saved: ("loss_scaler0" in saved) != isinstance(scaler, torch.amp.GradScaler)
                             and not (apex and args.opt_level in FIXED_SCALE) and scaler.load_state_dict(saved),
                             verbose=dist.get_rank() == 0)  # plumbing: every rank reads it; one says so


# ----------------------------------------------------------------------------- main
# DDP: --spawn: each process that mp.spawn starts gets what a launcher would set for it, then trains.
def run_as_rank(local_rank, argv, world_size):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))  # DDP: see above
    sys.exit(main(argv))  # DDP: its exit status is the process's (mp.spawn reports a rank that failed)


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:  # DDP: started without a launcher: be a group of one
        os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),  # DDP: where the ranks meet, at a
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(get_free_port() if args.spawn else 0),  # free
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # port (0: the OS picks one when no one else meets)
        if args.spawn:  # DDP: or --spawn N: mp.spawn starts N processes, each runs main() as a rank (run_as_rank)
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() // args.spawn)))  # as torchrun does
            try:
                return mp.spawn(run_as_rank, args=(argv, args.spawn), nprocs=args.spawn) or 0
            except mp.ProcessExitedException as error:  # a rank failed (its own error is above)
                sys.exit(f"rank {error.error_index} of {args.spawn} exited with status {error.exit_code}")
    device, amp_dtype, rank, world_size, apex = setup(args)  # Apex: and the stack
    group = dist.new_group(backend="gloo")  # DDP: collective: a CPU group of its own for the stop flag
    # DDP: collective: a stop signal on any rank stops them all after the same step: a max over ranks, started every
    # 8th step without waiting and read 8 steps later (common/preempt.py)
    stop = preempt.Stop(args.stop_after, agree=lambda flag: dist.all_reduce(flag, dist.ReduceOp.MAX, group=group,
                                                                             async_op=True).wait)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device, apex)  # Apex:
    steps_per_epoch = len(train_loader) // args.grad_accum
    model, optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device, amp_dtype, apex)  # Apex:
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler, apex)  # Apex:
    train_model = torch.compile(model) if args.compile else model  # same weights; checkpoints use `model`
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, f"apex.amp {args.opt_level}" if apex else amp_dtype, train_loader)  # Apex: who casts, and how
    if rank == 0:  # Apex: which SGD
        print(f"optimizer: {'apex.optimizers.FusedSGD' if FusedSGD else 'torch.optim.SGD (no Apex CUDA extensions)'}")

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = {"epoch": epoch, **train_one_epoch(args, train_model, train_loader, optimizer, scheduler, scaler,
                                                 device, amp_dtype, stop, meter, apex)}  # Apex: the stack
        global_step = scheduler.last_epoch  # optimizer steps so far (the schedule counts them)
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(args, train_model, test_loader, device, amp_dtype))
        if rank == 0:  # DDP: one writer; the others would race on the same files
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info, apex)  # Apex:
        log.epoch(row)
        dist.barrier()  # DDP: collective: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        # DDP: collective: a stop signal (agreed by all), or --stop-after: continue with --resume auto
        if stop.leave(epoch, start_epoch, args.epochs):
            break

    log.finish(model.module.state_dict())  # DDP: every rank its weights-rankN.sha256: equal files = equal replicas
    del model, train_model  # plumbing: free DDP now, not in a random later gc (it can hang the exit; docs/04-ddp.md)
    gc.collect()  # plumbing: (see above)
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
