"""Step 08: PyTorch's own sharding, FSDP2 (fully_shard), with Distributed Checkpoints (DCP).

What changes from step 04: instead of a DDP replica per process, fully_shard splits every weight, its gradient and
optimizer state across the processes (each layer and residual block a unit, gathered just before it runs), with a
MixedPrecisionPolicy in place of autocast. Checkpoints: DCP shards per rank, and the gathered checkpoint-epochNNNN.pt.

    torchrun --nproc_per_node=4 08_cifar10_fsdp.py
"""
import datetime
import gc
import glob
import os
import pickle
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)  # the flags of every step
    # DDP: torch.distributed.launch passes --local-rank=N (torchrun sets LOCAL_RANK instead); the GPU it uses
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS", help="wait for a missing rank")  # DDP:
    parser.add_argument("--sync-bn", action="store_true", help="batch norm over the global batch (CUDA, XPU)")  # DDP:
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
    backend = dist.get_default_backend_for_device(device)  # DDP: nccl for CUDA, xccl for XPU, gloo for CPU (and MPS)
    dist.init_process_group(backend, device_id=None if backend == "gloo" else device,  # DDP: rank, size from the env
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # DDP: a dead peer = an error
    verdict = [checkpoint.settings(args) if rank == 0 else None]  # DDP: rank 0 alone reads --resume's checkpoint
    dist.broadcast_object_list(verdict, src=0)  # DDP: collective: its settings on every rank (no shared disk needed)
    verdict[0].apply(args)  # DDP: that run's settings (those not typed), or the error, on every rank
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size  # DDP: this process's rank, and how many there are


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
    # FSDP: as 04's, in batches of at most 512 that give every rank as many: every forward gathers each unit's weights
    shard = -(-len(test_set) // dist.get_world_size())  # FSDP: the larger shard (they differ by one at most)
    test_loader = DataLoader(test_set, batch_size=-(-shard // -(-shard // 512)), num_workers=args.workers,  # FSDP:
                             sampler=range(dist.get_rank(), len(test_set), dist.get_world_size()),
                             pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
# --arch chooses one of these; the first is the default.
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device, amp_dtype):  # FSDP: the policy casts (amp_dtype), not autocast
    model = model.to(device)  # FSDP: NCHW weights (--channels-last: NHWC batches only)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model  # DDP: BN over the global batch
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # FSDP: collective: shard over every rank
    # FSDP: 16-bit weights for compute and all-gathers, fp32 shards for the optimizer and fp32 gradient reductions;
    # batch norm, in units of its own, fp32 weights beside its fp32 statistics (what torch's kernels take)
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    norms = [module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]  # FSDP:
    for norm in norms:  # FSDP: collective (every fully_shard): each rank keeps its shard of the weights
        fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(output_dtype=amp_dtype))
    # FSDP: the units, all-gathered just before they run: the model's layers that hold weights, nn.Sequential opened up
    # (ResNet-18: the stem convolution, each residual block, the classifier; the cnn: each layer)
    layers = [layer for child in model.children() for layer in (child if isinstance(child, nn.Sequential) else [child])]
    for unit in [layer for layer in layers if layer not in norms and any(True for _ in layer.parameters())]:  # FSDP:
        fully_shard(unit, mesh=mesh, mp_policy=policy)  # FSDP: collective
    # FSDP: collective: the root unit (what is left) returns fp32 logits
    return fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(amp_dtype, torch.float32, torch.float32))


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS))
    # FSDP: each rank sees only its shards' gradients: ShardedGradScaler all-reduces "overflow", so all skip alike
    scaler = ShardedGradScaler(device.type, enabled=amp_dtype == torch.float16)  # fp16 only (GPU, step 02)
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
        model.set_requires_gradient_sync(last_pass)  # FSDP: reduce-scatter the gradients on the last pass only
        # FSDP: collective: the forward all-gathers each unit's weights just before it runs (the policy casts: no autocast)
        loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / args.grad_accum).backward()  # FSDP: collective: gathers again, reduce-scatters gradients
        if last_pass:  # FSDP: each rank holds the averaged gradient of its shard now; one optimizer step per group
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
        logits = model(images)  # FSDP: collective: as in training; fp32 logits
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # DDP: collective: add up every shard's loss sum, hits and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
WHOLE = StateDictOptions(full_state_dict=True)  # FSDP: whole tensors, gathered from (or split into) the shards
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # FSDP: whole tensors on rank 0's CPU


def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info):
    # FSDP: collective: EVERY rank writes its shards into a DCP checkpoint (exact resume on any number of processes),
    # with our position in the run, atomically: into dcp/epochNNNN.tmp, renamed once every rank is done.
    done = epoch - bool(row.get("partial"))
    # FSDP: dcp/epochNNNN, or epochNNNN-stepSSSSSS for a part-way epoch
    final = os.path.join(args.out_dir, "dcp", f"epoch{done:04d}" + (f"-step{row['steps']:06d}" if done < epoch else ""))
    model_state, optim_state = get_state_dict(model, optimizer)  # FSDP: this rank's shards (DTensors)
    position = {"step": STEP, "epoch": done, "global_step": global_step, "metrics": row, "scaler": scaler.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": {"torch": torch.get_rng_state()}}  # FSDP: (see above)
    dcp.save({"model": model_state, "optim": optim_state, "position": pickle.dumps(position)},  # FSDP: collective
             checkpoint_id=final + ".tmp")
    dist.barrier()  # FSDP: collective: every rank's shards are written
    if dist.get_rank() == 0:  # FSDP: one writer: in place, and the newest 3 kept
        shutil.rmtree(final, ignore_errors=True)
        os.replace(final + ".tmp", final)
        for old in sorted(glob.glob(os.path.join(args.out_dir, "dcp", "epoch*[0-9]")))[:-3]:
            shutil.rmtree(old, ignore_errors=True)
    model_state = get_model_state_dict(model, options=GATHER)  # FSDP: collective: the format of 01-07, on rank 0
    optim = get_optimizer_state_dict(model, optimizer, options=GATHER)  # FSDP: collective
    if dist.get_rank() == 0:  # FSDP: one writer; the optimizer's state keyed by index, as torch.optim's own is
        index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        optim = {"state": {index[name]: value for name, value in optim["state"].items()},
                 "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in optim["param_groups"]]}
        return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                               model_state=model_state, optimizer=optim, scheduler=scheduler,
                               scaler=scaler, args=args, metrics=row, synthetic=info.synthetic)


def resume(args, model, optimizer, scheduler, scaler):
    # FSDP: collective: a DCP checkpoint (--resume auto: the newest complete one in dcp/, or its folder) is read shard
    # by shard, resharded to this number of processes; a checkpoint-epochNNNN.pt of any step is read whole by every
    # rank, and each keeps its shards.
    folder = max(glob.glob(os.path.join(args.out_dir, "dcp", "epoch*[0-9]")), default="") if args.resume == "auto" \
        else args.resume or ""
    if os.path.isdir(folder):  # FSDP: a DCP checkpoint
        model_state, optim_state = get_state_dict(model, optimizer)  # FSDP: what to fill: this rank's shards
        state = {"model": model_state, "optim": optim_state, "position": b""}
        dcp.load(state, checkpoint_id=folder)  # FSDP: collective
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # FSDP:
        return checkpoint.resume(args, state=pickle.loads(state["position"]), scheduler=scheduler, scaler=scaler,
                                 verbose=dist.get_rank() == 0, says=", sharded")  # FSDP: our position in the run
    names = [name for name, _ in model.named_parameters()]  # FSDP: indices to names
    return checkpoint.resume(  # FSDP: collective: whole tensors in, this rank's shards kept
        args, model=lambda whole: set_model_state_dict(model, whole, options=WHOLE), scheduler=scheduler, scaler=scaler,
        optimizer=lambda whole: set_optimizer_state_dict(model, optimizer, {
            "state": {names[i]: value for i, value in whole["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in whole["param_groups"]]},
            options=WHOLE), verbose=dist.get_rank() == 0)  # plumbing: every rank reads it; one says so


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:  # DDP: started without a launcher: be a group of one
        os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),  # DDP: where the ranks meet, at a
                          MASTER_PORT=os.environ.get("MASTER_PORT", "0"),  # free
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # port (0: the OS picks one when no one else meets)
    device, amp_dtype, rank, world_size = setup(args)  # DDP: joins the process group
    group = dist.new_group(backend="gloo")  # DDP: collective: a CPU group of its own for the stop flag
    # DDP: collective: a stop signal on any rank stops them all after the same step: a max over ranks, started every
    # 8th step without waiting and read 8 steps later (common/preempt.py)
    stop = preempt.Stop(args.stop_after, agree=lambda flag: dist.all_reduce(flag, dist.ReduceOp.MAX, group=group,
                                                                             async_op=True).wait)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device, amp_dtype)  # FSDP: its policy
    steps_per_epoch = len(train_loader) // args.grad_accum
    optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device, amp_dtype)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler)
    train_model = torch.compile(model) if args.compile else model  # same weights; checkpoints use `model`
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader)
    amp_dtype = None  # FSDP: no autocast in the loop: the MixedPrecisionPolicy of prepare_model casts

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = {"epoch": epoch, **train_one_epoch(args, train_model, train_loader, optimizer, scheduler, scaler,
                                                 device, amp_dtype, stop, meter)}
        global_step = scheduler.last_epoch  # optimizer steps so far (the schedule counts them)
        for buffer in model.buffers():  # FSDP: collective: never synced (DDP broadcasts them): rank 0's BN statistics
            dist.broadcast(buffer, 0)  # FSDP: collective
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(args, train_model, test_loader, device, amp_dtype))
        save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info)  # FSDP: collective
        log.epoch(row)
        dist.barrier()  # DDP: collective: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        # DDP: collective: a stop signal (agreed by all), or --stop-after: continue with --resume auto
        if stop.leave(epoch, start_epoch, args.epochs):
            break

    log.finish(get_model_state_dict(model, options=WHOLE))  # FSDP: collective: the whole model, on every rank
    del model, train_model  # plumbing: free DDP now, not in a random later gc (it can hang the exit; docs/04-ddp.md)
    gc.collect()  # plumbing: (see above)
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
