"""Step 08: PyTorch's own sharding, FSDP2 (fully_shard), with Distributed Checkpoints (DCP).

What changes from step 04: instead of a DDP replica per process, fully_shard splits every weight,
its gradient and its optimizer state across the processes (each layer or residual block a unit,
gathered just before it runs), with a MixedPrecisionPolicy in place of autocast; --replicate N
makes it HSDP (N replicas, each sharded). Checkpoints: DCP shards from every rank, written in the
background, and the gathered checkpoint-epochNNNN.pt.

    torchrun --nproc_per_node=4 08_cifar10_fsdp.py
"""
import datetime
import functools
import gc
import glob
import json
import os
import shutil
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
    set_model_state_dict, set_optimizer_state_dict, set_state_dict)
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
    # DDP: torch.distributed.launch passes --local-rank=N (torchrun sets LOCAL_RANK): its GPU.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    parser.add_argument("--local-rank", "--local_rank", type=int, default=local_rank)
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS",
                        help="how long a rank waits for a missing one")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch norm over the global batch (CUDA, XPU)")
    # FSDP: HSDP: N replicas, each sharded over processes/N (several machines: N = their number).
    parser.add_argument("--replicate", type=int, default=1, metavar="N",
                        help="HSDP: N replicas of processes/N shards (1: FSDP)")
    args = parser.parse_args(argv)
    # plumbing: N must divide the processes (the launcher's WORLD_SIZE): one line, exit 2.
    if args.replicate < 1 or int(os.environ.get("WORLD_SIZE", 1)) % args.replicate:
        parser.error(f"--replicate {args.replicate} does not divide the number of processes")
    return args


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
    return device, amp_dtype(args.amp, device), rank, world_size


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


# FSDP: the modules that become units of their own (yours may need others): every child with
# weights, containers opened up (ResNet-18's residual blocks are a unit each).
def units(module):
    for child in module.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            yield from units(child)
        elif list(child.parameters()):
            yield child


# FSDP: batch norm by its public classes (lazy ones subclass them); torch's common base is private.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


# FSDP: amp_dtype for the policy (not autocast); NCHW weights (--channels-last: batches only).
def prepare_model(args, model, device, amp_dtype):
    model = model.to(device)
    # DDP: --sync-bn: batch-norm statistics over the global batch, not each rank's.
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # FSDP: every rank starts from rank 0's weights and buffers (fully_shard keeps each rank's
    # slice of its own initialisation, so a build_model that draws otherwise would diverge).
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, 0)  # collective
    # FSDP: the ranks as --replicate rows of shards: a unit gathers its weights and reduce-scatters
    # its gradients within a row (a machine), and rows all-reduce their gradient shards (HSDP). One
    # row is plain FSDP on a 1-D mesh (on a 2-D one, each unit would all-reduce over one rank).
    shape = (args.replicate, dist.get_world_size() // args.replicate)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))  # collective
    mesh = mesh if args.replicate > 1 else mesh["shard"]
    # FSDP: units gather and compute in amp_dtype, reduce in fp32.
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    # FSDP: batch norm, units of its own: fp32 weights beside fp32 statistics, as kernels take them.
    norms = [m for m in model.modules() if isinstance(m, BATCH_NORMS)]
    for norm in norms:
        fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(output_dtype=amp_dtype))
    # FSDP: then a unit per block (units, above): each gathers its weights only while it computes.
    for unit in units(model):
        if unit not in norms:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
    # FSDP: the root unit holds what is left, and returns fp32 logits.
    root_policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
    return fully_shard(model, mesh=mesh, mp_policy=root_policy)


def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # FSDP: with fp16, the scaler's step agrees across ranks whether any shard overflowed.
    scaler = ShardedGradScaler(device.type, enabled=amp_dtype == torch.float16)
    return optimizer, scheduler, scaler


def train_one_epoch(args, model, loader, optimizer, scheduler, scaler, device, amp_dtype, stop,
                    meter):
    model.train()
    # The loss sum and the sample count stay on the device: no wait for them per step.
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for step, (inputs, labels) in enumerate(loader):
        meter.batch_in_hand()
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        inputs = inputs.to(device, non_blocking=True, memory_format=data.layout(inputs, args))
        labels = labels.to(device, non_blocking=True)
        last_pass = (step + 1) % args.grad_accum == 0 or step + 1 == len(loader)
        # FSDP: gradients reduce-scattered on a group's last pass only. Forward and backward gather
        # each unit's weights just before it runs (the policy casts: no autocast).
        model.set_requires_gradient_sync(last_pass)
        loss = F.cross_entropy(model(inputs), labels)  # collective
        scaler.scale(loss / args.grad_accum).backward()  # collective
        # Gradients add up over a group's passes; one optimizer step per group (fp16: if finite).
        # FSDP: each rank steps its own shards (fp16: all skip alike, see build_optimizer).
        if last_pass:
            scaler.step(optimizer)  # collective (fp16)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        totals[0] += loss.detach() * len(labels)
        totals[1] += len(labels)
        meter.batch_done()
        # DDP: a stop signal on any rank ends every rank's epoch after the same optimizer step.
        if last_pass and stop.requested(step // args.grad_accum + 1):  # collective
            break
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
        # FSDP: the forward gathers the weights as in training; the policy returns fp32 logits.
        logits = model(inputs)  # collective
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    # DDP: add up every shard's loss sum, hits and count.
    dist.all_reduce(totals)  # collective
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# FSDP: whole tensors, gathered from the shards or split into them (GATHER: on rank 0's CPU).
WHOLE = StateDictOptions(full_state_dict=True)
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info,
                    saving):
    # FSDP: the folder, dcp/epochNNNN[-stepSSSSSS].tmp, and the run's position as plain values,
    # which rank 0 puts in it first, for a resume's settings and dcp_to_pt.py.
    done = epoch - bool(row.get("partial"))
    final = os.path.join(args.out_dir, "dcp", f"epoch{done:04d}")
    if done < epoch:
        final += f"-step{row['steps']:06d}"
    position = json.dumps({"step": STEP, "arch": args.arch, "processes": dist.get_world_size(),
                           "args": {k: v for k, v in vars(args).items() if k != "given"},
                           "epoch": done, "global_step": global_step, "metrics": row,
                           "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict(),
                           "synthetic": info.synthetic})
    if dist.get_rank() == 0:
        os.makedirs(final + ".tmp", exist_ok=True)
        with open(os.path.join(final + ".tmp", "position.json"), "w") as f:
            f.write(position)
    # FSDP: EVERY rank stages its shards, the position and the random state (equal on every rank:
    # one copy kept), then writes them in the background (DCP: an exact resume on any mesh) while
    # training goes on; on `saving`, a gloo group, as async_save needs.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "position": position,
             "rng": torch.get_rng_state()}
    writing = dcp.async_save(state, checkpoint_id=final + ".tmp",
                             process_group=saving)  # collective
    # FSDP: rank 0 makes it the newest complete checkpoint the moment it is written (make_newest).
    newest = threading.Event()
    if dist.get_rank() == 0:
        writing.add_done_callback(functools.partial(make_newest, args, final, newest))
    else:
        newest.set()
    return writing, newest


# FSDP: once, when the run ends or stops: the whole state gathered on rank 0, as the
# checkpoint-epochNNNN.pt of 01-07 (scripts/dcp_to_pt.py makes one of any dcp/ folder).
def save_gathered(args, epoch, global_step, row, model, optimizer, scheduler, scaler, info):
    model_state = get_model_state_dict(model, options=GATHER)  # collective
    optim = get_optimizer_state_dict(model, optimizer, options=GATHER)  # collective
    if dist.get_rank() == 0:
        index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch,
                        global_step=global_step, model_state=model_state,
                        optimizer=rekeyed(optim, index), scheduler=scheduler,
                        scaler=scaler, args=args, metrics=row, synthetic=info.synthetic)


# FSDP: on rank 0, once its save is written, every rank's part is (DCP gathers their results
# before rank 0 writes .metadata): the folder is renamed the newest complete one; the newest 3 stay.
def make_newest(args, final, newest, writing):
    try:
        if writing.exception() is None:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(final + ".tmp", final)
            complete = glob.glob(os.path.join(glob.escape(args.out_dir), "dcp", "epoch*[0-9]"))
            for old in sorted(complete)[:-3]:
                shutil.rmtree(old, ignore_errors=True)
    finally:
        newest.set()


# FSDP: wait for the save in flight (and, on rank 0, for its rename).
def finish_save(in_flight):
    if in_flight is None:
        return
    writing, newest = in_flight
    writing.result()
    newest.wait()


def resume(args, model, optimizer, scheduler, scaler):
    # FSDP: a DCP checkpoint (auto: the newest complete one) is resharded to this number of ranks.
    # Rank 0 chooses it for every rank, and each must see its files (they are written per rank).
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = [dcp_folder(args) if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # collective
    folder, seen = folder[0], [None] * world
    if folder:
        here = os.path.isfile(os.path.join(folder, ".metadata"))
        dist.all_gather_object(seen, here)  # collective
        checkpoint.check_seen(seen, folder, "DCP")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "position": "",
                 "rng": torch.get_rng_state()}
        dcp.load(state, checkpoint_id=folder)  # collective
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        position = {**json.loads(state["position"]), "rng": {"torch": state["rng"]}}
        progress = checkpoint.resume(args, state=position, scheduler=scheduler, scaler=scaler,
                                     verbose=rank == 0, says=", sharded")
    else:
        progress = resume_whole(args, model, optimizer, scheduler, scaler)
    # FSDP: the ranks compare their epoch, step and whole weights; if one differs, all stop.
    whole = get_model_state_dict(model, options=WHOLE)  # collective
    mine, positions = checkpoint.position(progress, whole), [None] * world
    dist.all_gather_object(positions, mine)  # collective
    checkpoint.agree(positions)
    return progress


# FSDP: a checkpoint-epochNNNN.pt of any step: rank 0 reads it and sends it to every rank, which
# keeps its shards of it.
def resume_whole(args, model, optimizer, scheduler, scaler):
    def load_model(whole):
        set_model_state_dict(model, whole, options=WHOLE)  # collective
    def load_optimizer(whole):
        by_name = rekeyed(whole, [name for name, _ in model.named_parameters()])
        set_optimizer_state_dict(model, optimizer, by_name, options=WHOLE)  # collective
    found = [checkpoint.find(args) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # collective
    return checkpoint.resume(args, state=found[0], model=load_model, optimizer=load_optimizer,
                             scheduler=scheduler, scaler=scaler, verbose=dist.get_rank() == 0)


# FSDP: the DCP folder --resume names (auto: the newest complete one in --out-dir/dcp; a dcp/
# folder: its newest), or "" (a file, or another folder: checkpoint.resume says what it is).
def dcp_folder(args):
    folder = os.path.join(args.out_dir, "dcp") if args.resume == "auto" else args.resume
    if folder and not os.path.isfile(os.path.join(folder, ".metadata")):
        folder = max(glob.glob(os.path.join(glob.escape(folder), "epoch*[0-9]")), default="")
    return folder if folder and os.path.isfile(os.path.join(folder, ".metadata")) else ""


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        be_a_group_of_one()
    device, amp_dtype, rank, world_size = setup(args)
    # DDP: SIGTERM or SIGUSR1 on any rank: all finish the same step, save, exit 75 (stop_agreement).
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    stop = preempt.Stop(args.stop_after, agree=stop_agreement(group))
    # FSDP: checkpoints are written in the background, on a gloo group of their own.
    saving = dist.new_group(backend="gloo",
                            timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    in_flight = None
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    # FSDP: the model's MixedPrecisionPolicy casts to amp_dtype.
    model = prepare_model(args, build_model(args, info), device, amp_dtype)
    steps_per_epoch = sampler.steps
    optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device, amp_dtype)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler,
                                                 scaler)  # collective
    # --compile: the compiled model shares the weights; checkpoints save `model`.
    train_model = torch.compile(model) if args.compile else model
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = train_one_epoch(args, train_model, train_loader, optimizer, scheduler, scaler, device,
                              amp_dtype, stop, meter)
        row = {"epoch": epoch, **row}
        # FSDP: buffers are never synced (DDP broadcasts them): rank 0's batch-norm statistics.
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)  # collective
        # The schedule counts optimizer steps. An epoch stopped part-way is saved, not evaluated.
        global_step = scheduler.last_epoch
        if not row.get("partial"):
            row.update(evaluate(args, train_model, test_loader, device, amp_dtype))
        # FSDP: every rank saves its shards, in the background, once the save before is done.
        finish_save(in_flight)
        in_flight = save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler,
                                    row, info, saving)  # collective
        last = epoch, global_step, row
        log.epoch(row)
        dist.barrier()  # collective
        if stop.leave(epoch, start_epoch, args.epochs):  # collective
            break

    # FSDP: the gathered checkpoint of the last save (if this run saved); the last save finishes;
    # every rank writes weights-rankN.sha256 of the whole model.
    if in_flight:
        save_gathered(args, *last, model, optimizer, scheduler, scaler, info)  # collective
    finish_save(in_flight)
    log.finish(get_model_state_dict(model, options=WHOLE))  # collective
    # FSDP: free the model before leaving the group, as 04 frees DDP's.
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


# plumbing: an optimizer state with its parameters keyed anew: key[old key] is the new one.
def rekeyed(optim, key):
    state = {key[old]: value for old, value in optim["state"].items()}
    groups = [{**group, "params": [key[old] for old in group["params"]]}
              for group in optim["param_groups"]]
    return {"state": state, "param_groups": groups}


if __name__ == "__main__":
    sys.exit(main())
