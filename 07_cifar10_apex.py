"""Step 07: NVIDIA Apex, honestly: the legacy API where it exists, its native successors everywhere.

What changes from step 04: --amp-backend apex runs the old tutorials' amp.initialize,
amp.scale_loss and apex.parallel (NVIDIA Apex <= 25.05 only), torch their successors (step 04's
code), auto picks and says why. Apex's FusedSGD replaces torch's SGD where its CUDA build exists.

    python -m torch.distributed.launch --nproc_per_node=4 07_cifar10_apex.py --amp-backend apex
"""
import contextlib
import datetime
import gc
import importlib.util
import os
import sys
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, check_device, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

# Apex: the legacy API ends at Apex 25.05; FusedSGD needs Apex's CUDA build.
try:
    import apex.amp
    import apex.parallel
    LEGACY_API, LEGACY_ERROR = True, None
except ImportError as error:
    LEGACY_API, LEGACY_ERROR = False, error
try:
    import amp_C  # noqa: F401
    from apex.optimizers import FusedSGD
except ImportError:
    FusedSGD = None

STEP = os.path.splitext(os.path.basename(__file__))[0]
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
# Apex: opt levels with a fixed loss scale, never saved.
FIXED_SCALE = ("O0", "O3")


def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)
    # DDP: torch.distributed.launch passes --local-rank=N, torchrun sets LOCAL_RANK (its GPU).
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    parser.add_argument("--local-rank", "--local_rank", type=int, default=local_rank)
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS",
                        help="how long a rank waits for a missing one")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch norm over the global batch (CUDA, XPU)")
    # Apex: the stack, and apex.amp's precision on it.
    parser.add_argument("--amp-backend", choices=["auto", "apex", "torch"], default="auto",
                        help="apex = apex.amp + apex.parallel (Apex <= 25.05, CUDA); "
                        "torch = autocast + GradScaler + DDP")
    parser.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default="O1",
                        help="apex.amp: O0 fp32, O1 casts per function, "
                        "O2 fp16 model + fp32 masters, O3 pure fp16")
    return parser.parse_args(argv)


def setup(args):
    # DDP: the launcher tells each process its rank and how many there are.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # GPU: the machine's GPU (CUDA, ROCm, XPU or MPS), else the CPU; cuDNN times its kernels once.
    device = torch.accelerator.current_accelerator(check_available=True)
    # plumbing: a local rank without a GPU, or --sync-bn without CUDA or XPU, stops in one line.
    check_device(args, device)
    if device is not None:
        # DDP: one GPU per process, chosen by its local rank, its default device from now on.
        device = torch.device(device.type, args.local_rank)
        torch.accelerator.set_device_index(args.local_rank)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        # DDP: every process gets here; rank 0 speaks for them all.
        if rank == 0:
            print("no GPU found: running on the CPU")
    # Apex: chosen before joining, so an impossible stack exits everywhere.
    legacy = choose_stack(args, device, rank)
    # DDP: join the group (nccl, xccl or gloo); a peer silent for --dist-timeout is an error.
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend, device_id=device if backend != "gloo" else None,
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    # DDP: rank 0 reads --resume's settings (or its error) and sends them, so no disk is shared.
    settings = [checkpoint.settings(args) if rank == 0 else None]
    dist.broadcast_object_list(settings, src=0)  # collective
    settings[0].apply(args)
    torch.manual_seed(args.seed)
    # Apex: apex.amp casts and scales in place of autocast and GradScaler.
    compute_dtype = None if legacy else amp_dtype(args.amp, device)
    return device, compute_dtype, rank, world_size, legacy


# Apex: the legacy stack where it runs; `apex` insists on it.
def choose_stack(args, device, rank):
    why_not = why_not_apex(args, device)
    if args.amp_backend == "apex" and why_not:
        sys.exit("--amp-backend apex needs NVIDIA Apex 25.05 or older (built from source on a CUDA "
                 "machine, or in an NGC PyTorch container: docs/07-apex.md) and a CUDA GPU, and "
                 f"takes its precision from --opt-level, but {why_not}; or use --amp-backend torch")
    if args.amp_backend == "auto" and rank == 0:
        reason = why_not or "apex.amp and a CUDA GPU found"
        print(f"amp backend: {'torch' if why_not else 'apex'} (auto: {reason})")
    return args.amp_backend != "torch" and why_not is None


# DDP: a stop signal on any rank stops them all after the same step (an async max, read 8 later).
def stop_agreement(group):
    def agree(flag):
        work = dist.all_reduce(flag, dist.ReduceOp.MAX, group=group, async_op=True)  # collective
        return work.wait
    return agree


def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (input, label). Yours: README."""
    # DDP: one process per machine downloads; the others wait for it at the barrier.
    if args.local_rank == 0:
        data.download(args.data_dir)
    dist.barrier()  # collective
    return data.cifar10(args.data_dir, seed=args.seed)


def build_loaders(args, train_set, test_set):
    # DDP: workers start from a forkserver, as forking a process with gloo's threads is unsafe.
    data.workers_from_a_forkserver()
    # DDP: each rank trains a disjoint shard of one random order of the whole set per epoch, from
    # (seed, epoch) alone. A resumed epoch starts after the steps already done.
    order = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    sampler = data.EpochSampler(order, args.batch_size * args.grad_accum, args.drop_last)
    # GPU: batches in page-locked memory copy to the GPU without blocking the process.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0,
                              pin_memory=torch.accelerator.is_available())
    # DDP: evaluation shards the test set without padding, in as many batches on every rank.
    batches = data.eval_batches(len(test_set), dist.get_rank(), dist.get_world_size())
    test_loader = DataLoader(test_set, batch_sampler=batches, num_workers=args.workers,
                             persistent_workers=args.workers > 0,
                             pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8, normalised inside)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device, legacy):
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    # Apex: amp.initialize needs the bare model; build_optimizer wraps it.
    if legacy and args.sync_bn:
        return apex.parallel.convert_syncbn_model(model)
    if legacy:
        return model
    # DDP: with --sync-bn, batch norm takes its statistics over the global batch, not each rank's.
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # DDP: the wrapper copies rank 0's weights to every rank now, and averages the gradients in
    # buckets while backward still runs. The model itself is model.module.
    device_ids = [device.index] if device.type != "cpu" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)  # collective


def build_optimizer(args, model, steps_per_epoch, device, amp_dtype, legacy):
    # Apex: the same update, in fused kernels.
    sgd = FusedSGD or torch.optim.SGD
    optimizer = sgd(model.parameters(), lr=args.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                    nesterov=True)
    # Apex: its DDP sends rank 0's weights; the first zero_grad makes O2's masters, before --resume.
    if legacy:
        model, optimizer = apex.amp.initialize(model, optimizer, opt_level=args.opt_level)
        model = apex.parallel.DistributedDataParallel(model)  # collective
        optimizer.zero_grad()
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if legacy:
        return model, optimizer, scheduler, None
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return model, optimizer, scheduler, scaler


# The model and what trains it, on which device and in which precision: what the loop works with.
# Apex: and on which stack.
Training = namedtuple("Training", "model optimizer scheduler scaler device amp_dtype legacy")


def train_one_epoch(args, training, loader, stop, meter):
    model, optimizer, scheduler, scaler, device, amp_dtype, legacy = training
    model.train()
    # The loss sum and the sample count stay on the device: no wait for them per step.
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for step, (inputs, labels) in enumerate(loader):
        meter.batch_in_hand()
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        inputs = inputs.to(device, non_blocking=True, memory_format=data.layout(inputs, args))
        labels = labels.to(device, non_blocking=True)
        last_pass = (step + 1) % args.grad_accum == 0 or step + 1 == len(loader)
        # DDP: the gradients are averaged across ranks on a group's last pass only (no_sync before).
        # A forward that follows a synced backward also broadcasts rank 0's buffers (batch norm).
        with contextlib.nullcontext() if last_pass else model.no_sync():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(inputs), labels)  # collective
            # Apex: leaving the block unscales and checks the gradients.
            if legacy:
                with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()  # collective
            else:
                scaler.scale(loss / args.grad_accum).backward()  # collective
        # Gradients add up over a group's passes; one optimizer step per group (fp16: if finite).
        if last_pass:
            # Apex: amp's step skips itself on overflow.
            if legacy:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        # Apex: O1's patched += refuses fp32 into fp64.
        totals[0] += (loss.detach() * len(labels)).double()
        totals[1] += len(labels)
        meter.batch_done(loss)
        # DDP: a stop signal on any rank ends every rank's epoch after the same optimizer step.
        if last_pass and stop.requested(step // args.grad_accum + 1):  # collective
            break
    # Apex: its DDP never syncs buffers; rank 0's are sent here.
    if legacy:
        for buffer in model.module.buffers():
            dist.broadcast(buffer, src=0)  # collective
    # DDP: each rank saw other samples, so the sums add up across ranks; the timing is the slowest.
    dist.all_reduce(totals)  # collective
    timing = meter.timing().to(device)
    dist.all_reduce(timing, op=dist.ReduceOp.MAX)  # collective
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
        # Apex: cast as in training.
        totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    # DDP: add up every shard's loss sum, hits and count.
    dist.all_reduce(totals)  # collective
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# Apex: O2's fp32 masters of the fp16 weights, by name.
def master_weights(training):
    if not training.legacy:
        return {}
    names = [name for name, _ in training.model.module.named_parameters()]
    return dict(zip(names, apex.amp.master_params(training.optimizer)))


# Apex: fp32 weights (O2's masters), which 01-04 load.
def save_checkpoint(args, training, row, info):
    masters, weights = master_weights(training), training.model.module.state_dict()
    for name, tensor in weights.items():
        if tensor.is_floating_point():
            weights[name] = masters.get(name, tensor).detach().float()
    scale = None
    if not training.legacy:
        scale = training.scaler.state_dict()
    elif args.opt_level not in FIXED_SCALE:
        scale = apex.amp.state_dict()
    # DataParallel: save the model inside the wrapper (no `module.` prefix), as later steps do.
    # Apex: with those weights and scale.
    state = {"step": STEP, "model": weights, "optimizer": training.optimizer.state_dict(),
             "scheduler": training.scheduler.state_dict(), "scaler": scale,
             "global_step": training.scheduler.last_epoch, "synthetic": info.synthetic}
    return checkpoint.save(args, row, state)


def resume(args, training):
    # Apex: exact into O2's masters, rounded into its fp16 model.
    def load_weights(saved):
        training.model.module.load_state_dict(saved)
        for name, master in master_weights(training).items():
            master.detach().copy_(saved[name])

    # Apex: skip the other stack's scale; O0's and O3's stays fixed.
    def load_scale(saved):
        legacy, scaler = training.legacy, training.scaler
        if not saved or ("loss_scaler0" in saved) != legacy:
            return
        if not legacy:
            scaler.load_state_dict(saved)
        elif args.opt_level not in FIXED_SCALE:
            apex.amp.load_state_dict(saved)

    # DDP: rank 0 reads the checkpoint and sends it; every rank loads it (no disk is shared).
    rank, world, model = dist.get_rank(), dist.get_world_size(), training.model.module
    found = [checkpoint.find(args) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # collective
    progress = checkpoint.resume(found[0], load_weights, training.optimizer, training.scheduler,
                                 load_scale, verbose=rank == 0)
    # DDP: the ranks compare their epoch, step and weights; if one differs, every rank stops.
    mine, positions = checkpoint.position(progress, model.state_dict()), [None] * world
    dist.all_gather_object(positions, mine)  # collective
    checkpoint.agree(positions)
    return progress


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    # DDP: without a launcher, a group of one.
    if "RANK" not in os.environ:
        be_a_group_of_one()
    # Apex: setup picks the stack.
    device, amp_dtype, rank, world_size, legacy = setup(args)  # collective
    # DDP: after SIGTERM or SIGUSR1 on any rank, all finish the same step, save and exit 75.
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    stop = preempt.Stop(args.stop_after, agree=stop_agreement(group))
    train_set, test_set, info = build_data(args)  # collective
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    # Apex: build_optimizer wraps the legacy stack's model.
    model = prepare_model(args, build_model(args, info), device, legacy)  # collective
    model, optimizer, scheduler, scaler = build_optimizer(args, model, sampler.steps, device,
                                                          amp_dtype, legacy)  # collective
    training = Training(model, optimizer, scheduler, scaler, device, amp_dtype, legacy)
    start_epoch, _, part_done = resume(args, training)  # collective
    # --compile: the model's forward, compiled in place (its weights and their names stay).
    if args.compile:
        model.compile()
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, sampler.steps)
    # Apex: say who casts and which SGD.
    log.start(device, f"apex.amp {args.opt_level}" if legacy else amp_dtype, train_loader)
    if rank == 0 and FusedSGD:
        print("optimizer: apex.optimizers.FusedSGD")
    elif rank == 0:
        print("optimizer: torch.optim.SGD (no Apex CUDA extensions)")

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = train_one_epoch(args, training, train_loader, stop, meter)  # collective
        row = {"epoch": epoch, **row}
        # An epoch stopped part-way is saved, not evaluated.
        if not row.get("partial"):
            row.update(evaluate(args, model, test_loader, device, amp_dtype))  # collective
        # DDP: rank 0 writes alone; the barrier keeps the others from running ahead meanwhile.
        if rank == 0:
            save_checkpoint(args, training, row, info)
        log.epoch(row)
        dist.barrier()  # collective
        if stop.leave(epoch, start_epoch, args.epochs):  # collective
            break

    # DDP: every rank writes weights-rankN.sha256 of its replica; equal files mean equal replicas.
    log.finish(model.module.state_dict())
    # DDP: free DDP now (a later garbage collection can hang the exit); leave the group cleanly.
    del model, training
    gc.collect()
    dist.destroy_process_group()
    # 75 after a stop signal: a batch script requeues the job.
    return stop.exit_status()


# DDP: without a launcher, this process is rank 0 of 1, at a port the OS picks (MASTER_PORT 0).
def be_a_group_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or "0"
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


# plumbing: why the legacy stack cannot run, or None.
def why_not_apex(args, device):
    if importlib.util.find_spec("apex") is None:
        return "NVIDIA Apex is not installed"
    if not LEGACY_API:
        return (f"apex.amp does not import ({LEGACY_ERROR}): Apex newer than 25.05, a build for "
                "another torch, or the unrelated registry package (pip uninstall apex)")
    if device.type != "cuda":
        return "no CUDA GPU was found"
    if args.amp in ("bf16", "off") or args.compile or args.grad_accum > 1:
        return "--amp bf16/off, --compile or --grad-accum was asked for"
    return None


if __name__ == "__main__":
    sys.exit(main())
