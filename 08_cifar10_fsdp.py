"""Step 08: PyTorch's own sharding, FSDP2 (fully_shard), with Distributed Checkpoints (DCP).

What changes from step 04: instead of a DDP replica per process, fully_shard splits every weight,
its gradient and its optimizer state across the processes (each layer or residual block a unit,
gathered just before it runs), with a MixedPrecisionPolicy in place of autocast; --replicate N
makes it HSDP (N replicas, each sharded). Checkpoints: DCP shards from every rank, written in the
background (scripts/dcp_to_pt.py makes the checkpoint-epochNNNN.pt of 01-07 of one).

    torchrun --nproc_per_node=4 08_cifar10_fsdp.py
"""
import datetime
import gc
import os
import sys
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict,
    set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, check_device, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)
    # DDP: torch.distributed.launch passes --local-rank=N, torchrun sets LOCAL_RANK (its GPU).
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    parser.add_argument("--local-rank", "--local_rank", type=int, default=local_rank)
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS",
                        help="how long a rank waits for a missing one")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch norm over the global batch (CUDA, XPU)")
    # FSDP: --replicate N makes it HSDP.
    parser.add_argument("--replicate", type=int, default=1, metavar="N",
                        help="HSDP: N replicas of processes/N shards (1: FSDP)")
    args = parser.parse_args(argv)
    # plumbing: an N that does not divide the processes stops in one line.
    if args.replicate < 1 or int(os.environ.get("WORLD_SIZE", 1)) % args.replicate:
        parser.error(f"--replicate {args.replicate} does not divide the number of processes")
    return args


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
    # DDP: join the group (nccl, xccl or gloo); a peer silent for --dist-timeout is an error.
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend, device_id=device if backend != "gloo" else None,
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    # FSDP: rank 0 reads --resume's settings (a DCP folder's position.json too) and sends them.
    settings = [checkpoint.settings(args, own="dcp") if rank == 0 else None]
    dist.broadcast_object_list(settings, src=0)  # collective
    settings[0].apply(args)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size


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


# FSDP: each unit costs an all-gather, a reduce-scatter and host time per step however small, and
# is whole only while it runs: so few units, each 1/UNITS of the weights (docs/08-fsdp.md).
UNITS = 4


# FSDP: runs of consecutive layers with weights of their own, batch norms apart.
def units(model, norms):
    def size(modules):
        return sum(p.numel() for module in modules for p in module.parameters())
    runs = [[]]
    for layer in model.modules():
        if list(layer.parameters(recurse=False)) and layer not in norms:
            if size(runs[-1]) * UNITS >= size([model]):
                runs.append([])
            runs[-1].append(layer)
    if len(runs) > 1 and size(runs[-1]) * UNITS < size([model]):
        last = runs.pop()
        runs[-1] += last
    return runs


# FSDP: batch norm by its public classes (their common base is private).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


# FSDP: amp_dtype is for the policy, not autocast; the weights stay NCHW.
def prepare_model(args, model, device, amp_dtype):
    model = model.to(device)
    # DDP: with --sync-bn, batch norm takes its statistics over the global batch, not each rank's.
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # FSDP: all ranks take rank 0's weights and buffers; fully_shard shards each rank's own as is.
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, 0)  # collective
    # FSDP: units gather and reduce-scatter within a mesh row (a machine), rows all-reduce (HSDP);
    # one row is sliced to 1-D, else each unit all-reduces over one rank.
    shape = (args.replicate, dist.get_world_size() // args.replicate)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))  # collective
    mesh = mesh if args.replicate > 1 else mesh["shard"]
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    # FSDP: batch norms are one fp32 unit (their kernels want fp32 weights with fp32 statistics).
    norms = [m for m in model.modules() if isinstance(m, BATCH_NORMS)]
    if norms:
        fully_shard(norms, mesh=mesh, mp_policy=MixedPrecisionPolicy(output_dtype=amp_dtype))
    for unit in units(model, norms):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    # FSDP: the root unit holds any weights left.
    root_policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
    return fully_shard(model, mesh=mesh, mp_policy=root_policy)


def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # FSDP: with fp16 the ranks agree whether any shard overflowed.
    scaler = ShardedGradScaler(device.type, enabled=amp_dtype == torch.float16)
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
        # FSDP: gradients reduce-scatter on a group's last pass only.
        model.set_requires_gradient_sync(last_pass)
        loss = F.cross_entropy(model(inputs), labels)  # collective
        scaler.scale(loss / args.grad_accum).backward()  # collective
        # Gradients add up over a group's passes; one optimizer step per group (fp16: if finite).
        if last_pass:
            scaler.step(optimizer)  # collective (fp16)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        totals[0] += loss.detach() * len(labels)
        totals[1] += len(labels)
        meter.batch_done(loss)
        # DDP: a stop signal on any rank ends every rank's epoch after the same optimizer step.
        if last_pass and stop.requested(step // args.grad_accum + 1):  # collective
            break
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
        # FSDP: the forward gathers as in training, returning fp32 logits.
        logits = model(inputs)  # collective
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    # DDP: add up every shard's loss sum, hits and count.
    dist.all_reduce(totals)  # collective
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# FSDP: whole tensors, gathered from shards or split into them.
WHOLE = StateDictOptions(full_state_dict=True)


# FSDP: every rank saves, on the group `saving`.
def save_checkpoint(args, training, row, info, saving):
    # FSDP: rank 0 saves the run's position, read before any model exists, as position.json.
    state = {"step": STEP, "scheduler": training.scheduler.state_dict(),
             "scaler": training.scaler.state_dict(), "global_step": training.scheduler.last_epoch,
             "synthetic": info.synthetic}
    if dist.get_rank() == 0:
        checkpoint.save_position(args, row, state)
    # FSDP: each rank writes its shards in the background (async_save returns once they are copied
    # to memory). Rank 0's .metadata, written last, completes the folder.
    model_state, optim_state = get_state_dict(training.model, training.optimizer)
    return dcp.async_save({"model": model_state, "optim": optim_state},
                          checkpoint_id=checkpoint.own_path(args.out_dir, row),
                          process_group=saving)  # collective


def resume(args, training):
    # FSDP: rank 0 picks a DCP folder (auto, the newest complete) or any step's .pt.
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler, scaler = training[:4]
    found = [checkpoint.find(args, own="dcp") if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # collective
    state, seen = found[0], [None] * world
    if state.get("folder"):
        # FSDP: each rank must see the folder to read its shards, whichever mesh wrote them.
        here = os.path.isfile(os.path.join(state["folder"], ".metadata"))
        dist.all_gather_object(seen, here)  # collective
        checkpoint.check_seen(seen, state["folder"], "DCP")
        model_state, optim_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optim": optim_state}
        dcp.load(shards, checkpoint_id=state["folder"])  # collective
        set_state_dict(model, optimizer, model_state_dict=shards["model"],
                       optim_state_dict=shards["optim"])

    # FSDP: of a .pt's whole weights and momentum, each rank keeps its shards.
    def load_model(whole):
        set_model_state_dict(model, whole, options=WHOLE)  # collective
    def load_optimizer(whole):
        by_name = rekeyed(whole, [name for name, _ in model.named_parameters()])
        set_optimizer_state_dict(model, optimizer, by_name, options=WHOLE)  # collective
    progress = checkpoint.resume(state, load_model, load_optimizer, scheduler, scaler,
                                 verbose=rank == 0)  # collective
    # FSDP: the ranks compare epoch, step and whole weights; a difference stops all.
    whole = get_model_state_dict(model, options=WHOLE)  # collective
    mine, positions = checkpoint.position(progress, whole), [None] * world
    dist.all_gather_object(positions, mine)  # collective
    checkpoint.agree(positions)
    return progress


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        be_a_group_of_one()
    device, amp_dtype, rank, world_size = setup(args)  # collective
    # DDP: after SIGTERM or SIGUSR1 on any rank, all finish the same step, save and exit 75.
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    stop = preempt.Stop(args.stop_after, agree=stop_agreement(group))
    # FSDP: async_save's thread needs a gloo group of its own, apart from training's.
    saving = dist.new_group(backend="gloo",
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    writing = None
    train_set, test_set, info = build_data(args)  # collective
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    # FSDP: the model's MixedPrecisionPolicy casts to amp_dtype.
    model = prepare_model(args, build_model(args, info), device, amp_dtype)  # collective
    steps_per_epoch = sampler.steps
    optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device, amp_dtype)
    training = Training(model, optimizer, scheduler, scaler, device, amp_dtype)
    start_epoch, _, part_done = resume(args, training)  # collective
    # --compile: the model's forward, compiled in place (its weights and their names stay).
    if args.compile:
        model.compile()
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = train_one_epoch(args, training, train_loader, stop, meter)  # collective
        row = {"epoch": epoch, **row}
        # FSDP: all take rank 0's batch-norm statistics (DDP broadcasts buffers, FSDP never).
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)  # collective
        # An epoch stopped part-way is saved, not evaluated.
        if not row.get("partial"):
            row.update(evaluate(args, model, test_loader, device, amp_dtype))  # collective
        # FSDP: one background save at a time.
        if writing:
            writing.result()
        writing = save_checkpoint(args, training, row, info, saving)  # collective
        log.epoch(row)
        dist.barrier()  # collective
        if stop.leave(epoch, start_epoch, args.epochs):  # collective
            break

    # FSDP: the last save finishes; each rank hashes the whole model.
    if writing:
        writing.result()
    log.finish(get_model_state_dict(model, options=WHOLE))  # collective
    # FSDP: free the model before leaving the group.
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


# FSDP: a .pt keys optimizer state by index, set_optimizer_state_dict by name (key[index]).
def rekeyed(optim, key):
    state = {key[old]: value for old, value in optim["state"].items()}
    groups = [{**group, "params": [key[old] for old in group["params"]]}
              for group in optim["param_groups"]]
    return {"state": state, "param_groups": groups}


if __name__ == "__main__":
    sys.exit(main())
