"""Step 07: NVIDIA Apex, honestly: the legacy API where it exists, its native successors everywhere.

What changes from step 04: --amp-backend picks the stack. `apex`: the old tutorials'
amp.initialize, amp.scale_loss and apex.parallel (only NVIDIA Apex <= 25.05 has them); `torch`:
their successors (step 04); `auto` picks and says why. Apex's FusedSGD replaces torch's SGD where
its CUDA extensions exist.

    python -m torch.distributed.launch --nproc_per_node=4 07_cifar10_apex.py --amp-backend apex
"""
import contextlib
import datetime
import gc
import importlib.util
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, check_device, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

# Apex: its legacy API (apex.amp, apex.parallel) exists only up to tag 25.05, built from source on
# a CUDA machine (`pip install apex` gives an unrelated package); setup says why not, if not.
try:
    import apex.amp
    import apex.parallel
    APEX_ERROR = None
except ImportError as error:
    apex, APEX_ERROR = None, error
# Apex: its FusedSGD where its CUDA extensions (amp_C, built with nvcc) exist, else torch's SGD.
try:
    import amp_C  # noqa: F401
    from apex.optimizers import FusedSGD
except ImportError:
    FusedSGD = None

STEP = os.path.splitext(os.path.basename(__file__))[0]
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
# Apex: apex.amp's levels with a fixed loss scale (O1 and O2: dynamic, kept in checkpoints).
FIXED_SCALE = ("O0", "O3")


def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)
    # DDP: torch.distributed.launch passes --local-rank=N (torchrun sets LOCAL_RANK): its GPU.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    parser.add_argument("--local-rank", "--local_rank", type=int, default=local_rank)
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS",
                        help="how long a rank waits for a missing one")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch norm over the global batch (CUDA, XPU)")
    # Apex: --amp-backend picks the stack; --opt-level is apex.amp's precision on the legacy one.
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
    # plumbing: a local rank without a GPU, or --sync-bn without CUDA or XPU: one line, exit 2.
    check_device(args, device)
    if device is not None:
        # DDP: one GPU per process, chosen by its local rank, its default device from now on.
        device = torch.device(device.type, args.local_rank)
        torch.accelerator.set_device_index(args.local_rank)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        # plumbing: one line, not one per process.
        if rank == 0:
            print("no GPU found: running on the CPU")
    # Apex: the stack is chosen before the group forms, so that an impossible one stops every rank.
    legacy_apex = choose_stack(args, device, rank)
    # DDP: join the process group (nccl for CUDA, xccl for XPU, gloo for the CPU); a peer that
    # does not answer within --dist-timeout is an error, not a wait for ever.
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend, device_id=device if backend != "gloo" else None,
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    # DDP: rank 0 reads --resume's settings (or its error) for every rank: no shared disk needed.
    settings = [checkpoint.settings(args) if rank == 0 else None]
    dist.broadcast_object_list(settings, src=0)  # collective
    settings[0].apply(args)
    torch.manual_seed(args.seed)
    # Apex: on the legacy path apex.amp casts (no autocast dtype); setup returns the stack too.
    compute_dtype = None if legacy_apex else amp_dtype(args.amp, device)
    return device, compute_dtype, rank, world_size, legacy_apex


# Apex: the legacy stack (the apex package) where it can run: NVIDIA Apex <= 25.05, a CUDA GPU and
# the precision left to --opt-level; else None, torch's successors. `auto` says which, and why.
def choose_stack(args, device, rank):
    why_not = None
    if device.type != "cuda":
        why_not = "apex.amp needs a CUDA GPU, and none was found"
    if APEX_ERROR is not None:
        why_not = why_apex_does_not_import(APEX_ERROR)
    misfit = args.amp in ("bf16", "off") or args.compile or args.grad_accum > 1
    if args.amp_backend == "apex" and (why_not or misfit):
        sys.exit(apex_refusal(why_not))
    chosen = args.amp_backend != "torch" and not (why_not or misfit)
    if args.amp_backend == "auto" and rank == 0:
        print(auto_choice(args.opt_level, chosen, why_not))
    return apex if chosen else None


# Apex: the line in which --amp-backend auto says which stack it chose, and why.
def auto_choice(opt_level, chosen, why_not):
    if chosen:
        return f"amp backend: apex (auto: apex.amp and a CUDA GPU found; --opt-level {opt_level})"
    reason = why_not or "--amp bf16/off, --compile or --grad-accum was asked for"
    return (f"amp backend: torch (auto: {reason}; "
            "using its native successors torch.autocast + GradScaler + torch DDP)")


# DDP: a stop signal on any rank stops them all after the same step: a max over the ranks, on a
# CPU group of its own, started every 8th step without waiting and read 8 steps later.
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


# Apex: `legacy_apex` is the legacy stack, or None off its path (then as in 04).
def prepare_model(args, model, device, legacy_apex):
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    # Apex: its own --sync-bn converter; amp.initialize must see the bare model, so apex's DDP
    # wraps it after that (build_optimizer).
    if legacy_apex and args.sync_bn:
        return legacy_apex.parallel.convert_syncbn_model(model)
    if legacy_apex:
        return model
    # DDP: --sync-bn: batch-norm statistics over the global batch, not each rank's.
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # DDP: the wrapper copies rank 0's weights to every rank now, and averages the gradients in
    # buckets while backward still runs. The model itself is model.module.
    device_ids = [device.index] if device.type != "cpu" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)  # collective


# Apex: it returns the model too, which the legacy stack patches and wraps.
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype, legacy_apex):
    # Apex: its FusedSGD where its CUDA extensions exist: the same update, in fused kernels.
    sgd = FusedSGD or torch.optim.SGD
    optimizer = sgd(model.parameters(), lr=args.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                    nesterov=True)
    # Apex: the legacy API patches model and optimizer in place (--opt-level), then its DDP wraps
    # the model and broadcasts rank 0's parameters. O2 makes its fp32 master weights at the first
    # zero_grad: now, from rank 0's weights, and before --resume loads into them.
    if legacy_apex:
        model, optimizer = legacy_apex.amp.initialize(model, optimizer, opt_level=args.opt_level)
        model = legacy_apex.parallel.DistributedDataParallel(model)  # collective
        optimizer.zero_grad()
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # Apex: on the legacy path apex.amp owns the loss scale; its state_dict() and load_state_dict()
    # fill the checkpoint's "scaler" slot.
    if legacy_apex:
        return model, optimizer, scheduler, legacy_apex.amp
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return model, optimizer, scheduler, scaler


# Apex: `legacy_apex`: the legacy stack scales the loss, and its DDP leaves the buffers alone.
def train_one_epoch(args, model, loader, optimizer, scheduler, scaler, device, amp_dtype, stop,
                    meter, legacy_apex):
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
            # Apex: the legacy loss scaling: leaving the block unscales the gradients and checks
            # them for overflow; its DDP averages them during backward.
            if legacy_apex:
                with legacy_apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()  # collective
            else:
                scaler.scale(loss / args.grad_accum).backward()  # collective
        # Gradients add up over a group's passes; one optimizer step per group (fp16: if finite).
        if last_pass:
            # Apex: amp patched step() to skip the step if fp16 gradients overflowed.
            if legacy_apex:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        # Apex: O1's patched += refuses fp32 into fp64 (seen on an H100): the sums cast first.
        totals[0] += (loss.detach() * len(labels)).double()
        totals[1] += len(labels)
        meter.batch_done()
        # DDP: a stop signal on any rank ends every rank's epoch after the same optimizer step.
        if last_pass and stop.requested(step // args.grad_accum + 1):  # collective
            break
    # Apex: its DDP never syncs buffers (04's does at every forward): rank 0's batch-norm statistics
    # go to every rank.
    if legacy_apex:
        for buffer in model.module.buffers():
            dist.broadcast(buffer, src=0)  # collective
    # DDP: every rank saw other samples: the sums over the ranks, and every rank's timing.
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
        # Apex: cast before += as in training (O1).
        totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    # DDP: add up every shard's loss sum, hits and count.
    dist.all_reduce(totals)  # collective
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# Apex: O2 keeps fp16 weights in the model and trains fp32 copies, its "master weights", in the
# optimizer: {name: the weight the optimizer trains}; {} off the legacy path.
def master_weights(model, optimizer, legacy_apex):
    if not legacy_apex:
        return {}
    names = [name for name, _ in model.module.named_parameters()]
    return dict(zip(names, legacy_apex.amp.master_params(optimizer)))


# Apex: the common format holds fp32 weights, which 01-04 load as their own: under O2 the masters,
# under O3 the model's fp16 weights cast (they have no masters). A fixed loss scale is not saved.
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info,
                    legacy_apex):
    masters = master_weights(model, optimizer, legacy_apex)
    model_state = dict(model.module.state_dict())
    for name, tensor in model_state.items():
        if tensor.is_floating_point():
            model_state[name] = masters.get(name, tensor).detach().float()
    if legacy_apex and args.opt_level in FIXED_SCALE:
        scaler = None
    # DataParallel: save the model inside the wrapper (no `module.` prefix), as later steps do.
    # Apex: with the fp32 weights above, and the loss scale where it is dynamic.
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch,
                           global_step=global_step, model_state=model_state,
                           optimizer=optimizer, scheduler=scheduler, scaler=scaler, args=args,
                           metrics=row, synthetic=info.synthetic)


# Apex: the weights go into the model (rounded to fp16 under O2) and, exact, into O2's fp32 masters.
def resume(args, model, optimizer, scheduler, scaler, legacy_apex):
    def load_weights(saved):
        model.module.load_state_dict(saved)
        for name, master in master_weights(model, optimizer, legacy_apex).items():
            master.detach().copy_(saved[name])

    # Apex: GradScaler's and apex.amp's states do not fit each other: the other's starts afresh; at
    # O0 and O3 the loss scale is fixed at 1 (a saved dynamic one would stick).
    def load_scale(saved):
        if ("loss_scaler0" in saved) == isinstance(scaler, torch.amp.GradScaler):
            return
        if legacy_apex and args.opt_level in FIXED_SCALE:
            return
        scaler.load_state_dict(saved)

    # DDP: rank 0 reads the checkpoint and sends it to every rank, which loads it into its replica:
    # no shared disk needed. Apex: through the two loaders above.
    rank, world = dist.get_rank(), dist.get_world_size()
    found = [checkpoint.find(args) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # collective
    progress = checkpoint.resume(args, state=found[0], model=load_weights, optimizer=optimizer,
                                 scheduler=scheduler, scaler=load_scale, verbose=rank == 0)
    # DDP: the ranks compare their epoch, step and weights; if one differs, every rank stops.
    mine, positions = checkpoint.position(progress, model.module.state_dict()), [None] * world
    dist.all_gather_object(positions, mine)  # collective
    checkpoint.agree(positions)
    return progress


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    # DDP: no launcher: a group of one.
    if "RANK" not in os.environ:
        be_a_group_of_one()
    # Apex: setup chooses the stack; every function that differs on its path gets it.
    device, amp_dtype, rank, world_size, legacy_apex = setup(args)
    # DDP: SIGTERM or SIGUSR1 on any rank: all finish the same step, save, exit 75 (stop_agreement).
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    stop = preempt.Stop(args.stop_after, agree=stop_agreement(group))
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    # Apex: the legacy stack wraps the model in build_optimizer, which returns it.
    model = prepare_model(args, build_model(args, info), device, legacy_apex)
    steps_per_epoch = sampler.steps
    model, optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device,
                                                          amp_dtype, legacy_apex)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler,
                                                 legacy_apex)  # collective
    # --compile: the compiled model shares the weights; checkpoints save `model`.
    train_model = torch.compile(model) if args.compile else model
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    # Apex: the start line says who casts, and how; rank 0 says which SGD.
    log.start(device, f"apex.amp {args.opt_level}" if legacy_apex else amp_dtype, train_loader)
    if rank == 0 and FusedSGD:
        print("optimizer: apex.optimizers.FusedSGD")
    elif rank == 0:
        print("optimizer: torch.optim.SGD (no Apex CUDA extensions)")

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        # Apex: as every function of the loop, train_one_epoch takes the stack.
        row = train_one_epoch(args, train_model, train_loader, optimizer, scheduler, scaler, device,
                              amp_dtype, stop, meter, legacy_apex)
        row = {"epoch": epoch, **row}
        # The schedule counts optimizer steps. An epoch stopped part-way is saved, not evaluated.
        global_step = scheduler.last_epoch
        if not row.get("partial"):
            row.update(evaluate(args, train_model, test_loader, device, amp_dtype))
        # DDP: rank 0 writes alone; the barrier keeps the others from running ahead meanwhile.
        if rank == 0:
            # Apex: save_checkpoint saves the fp32 weights the stack trains.
            save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row,
                            info, legacy_apex)
        log.epoch(row)
        dist.barrier()  # collective
        if stop.leave(epoch, start_epoch, args.epochs):  # collective
            break

    # DDP: every rank writes weights-rankN.sha256 of its replica: equal files, equal replicas.
    log.finish(model.module.state_dict())
    # DDP: free DDP now (a later garbage collection can hang the exit); leave the group cleanly.
    del model, train_model
    gc.collect()
    dist.destroy_process_group()
    # 75 after a stop signal: a batch script requeues the job.
    return stop.exit_status()


# DDP: no launcher: rank 0 of 1, at a port the OS picks (MASTER_PORT 0).
def be_a_group_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or "0"
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


# plumbing: why Apex's legacy API does not import, as a clause of a sentence: not installed, broken,
# newer than 25.05, or the registry's unrelated package of that name.
def why_apex_does_not_import(error):
    if error.name == "apex":
        return "NVIDIA Apex is not installed"
    if not error.name.startswith("apex."):
        return f"NVIDIA Apex does not import ({error})"
    if importlib.util.find_spec("apex.optimizers"):
        return "the installed NVIDIA Apex is newer than 25.05, without apex.amp and apex.parallel"
    origin = importlib.util.find_spec("apex").origin
    return (f"the apex in {origin} is the unrelated registry package of that name, "
            "not NVIDIA Apex (pip uninstall apex)")


# plumbing: --amp-backend apex where its stack cannot run: why, and the ways out, in one line.
def apex_refusal(why_not):
    if why_not:
        return ("--amp-backend apex needs NVIDIA Apex with apex.amp and a CUDA GPU, "
                f"but {why_not}. "
                "apex.amp was removed upstream in May 2025: "
                "build Apex tag 25.05 or older from source on a CUDA machine, "
                "or use an NGC PyTorch container that still has it (docs/07-apex.md); "
                "or use --amp-backend torch")
    return ("--amp-backend apex takes its precision from --opt-level (O0 = fp32) "
            "and is not combined with --amp bf16/off, --compile or --grad-accum here: "
            "drop those, or use --amp-backend torch")


if __name__ == "__main__":
    sys.exit(main())
