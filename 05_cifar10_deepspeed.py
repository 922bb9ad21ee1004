"""Step 05: DeepSpeed: one engine owns optimizer, precision and accumulation; ZeRO shards the state.

What changes from step 04: deepspeed.initialize builds an engine around the model from its config
and the command line; the loop calls engine(inputs), engine.backward(loss), engine.step(). ZeRO 1
shards the optimizer state, 2 also the gradients, 3 also the weights; each rank saves its shard in
the engine's checkpoint (scripts/ds_to_pt.py makes the checkpoint-epochNNNN.pt of 01-07 of one).

    deepspeed --num_gpus 4 05_cifar10_deepspeed.py --deepspeed_config ds_config.json --zero-stage 3
"""
import datetime
import functools
import gc
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, check_device, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

# plumbing: DeepSpeed picks its accelerator on import, so a CPU is named first (else ranks warn).
if not torch.accelerator.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed
except ImportError as error:
    print(f"error: DeepSpeed is not importable by {sys.executable} ({error}): install it with "
          f"`{sys.executable} -m pip install deepspeed==0.19.8`", file=sys.stderr)
    sys.exit(2)

STEP = os.path.splitext(os.path.basename(__file__))[0]
# DeepSpeed: SGD's momentum and weight decay are in its config, ds_config.json next to this script.
WARMUP_EPOCHS, CONFIG = 1, str(Path(os.path.abspath(__file__)).with_name("ds_config.json"))


def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)
    # DeepSpeed: its launcher passes --local_rank=N, as torch.distributed.launch does, for the GPU.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    parser.add_argument("--local-rank", "--local_rank", type=int, default=local_rank)
    parser.add_argument("--dist-timeout", type=int, default=600, metavar="SECONDS",
                        help="how long a rank waits for a missing one")
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch norm over the global batch (CUDA, XPU)")
    # DeepSpeed: its config (ds_config.json here unless given), and a ZeRO stage that overrides it.
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=CONFIG,
                        metavar="JSON", help="its config")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="0 none, 1 optimizer state, 2 + gradients, 3 + weights")
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
        # DeepSpeed: on a CPU, no 30-90 s compile of an op that training never uses.
        skip_shm_op_build()
        # DDP: every process gets here; rank 0 speaks for them all.
        if rank == 0:
            print("no GPU found: running on the CPU")
    # plumbing: no DeepSpeed warnings about what this step does on purpose.
    quiet_deepspeed()
    # DeepSpeed: join the process group (nccl for CUDA, xccl for XPU, gloo for the CPU); a peer that
    # does not answer within --dist-timeout is an error, not a wait for ever.
    backend = dist.get_default_backend_for_device(device)
    deepspeed.init_distributed(backend,
                               timeout=datetime.timedelta(seconds=args.dist_timeout))  # collective
    # DeepSpeed: rank 0 reads --resume's settings (a folder's position.json too) and sends them.
    settings = [checkpoint.settings(args, own="ds_checkpoints") if rank == 0 else None]
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
    data.workers_from_a_forkserver("deepspeed")
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


def prepare_model(args, model, device):
    # DeepSpeed: no wrapper (the engine comes later); NCHW weights, which ZeRO's flat buffers need.
    model = model.to(device)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model


# DeepSpeed: its config file, with the command line written in.
def build_config(args, amp_dtype):
    config = json.loads(Path(args.deepspeed_config).read_text())
    config.update(train_micro_batch_size_per_gpu=args.batch_size,
                  gradient_accumulation_steps=args.grad_accum)
    config.pop("train_batch_size", None)
    config.setdefault("optimizer", {"type": "SGD"}).setdefault("params", {})["lr"] = args.lr
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    # DeepSpeed: --amp picks 16-bit weights with fp32 masters and 16-bit buffers, or fp32.
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16", None: "fp32"}[amp_dtype]
    for key in ("bf16", "fp16"):
        config.setdefault(key, {})["enabled"] = precision == key
    config.setdefault("data_types", {})["buffer_dtype"] = None if amp_dtype is None else precision
    return config


# DeepSpeed: our schedule for the engine's SGD from step start_step (so LambdaLR needs initial_lr).
def build_scheduler(args, steps_per_epoch, start_step, optimizer):
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule, last_epoch=start_step - 1)


# DeepSpeed: the engine builds SGD and our schedule, owns precision, averaging, clipping and ZeRO,
# and copies rank 0's weights to all.
def build_optimizer(model, config, scheduler):
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config, lr_scheduler=scheduler)  # collective
    except (AssertionError, ValueError) as error:
        sys.exit(f"deepspeed.initialize refused the config: {' '.join(str(error).split())[:300]}")
    return engine


# DeepSpeed: the engine in place of model, optimizer, scheduler and scaler; it casts (no autocast).
def train_one_epoch(args, engine, loader, device, stop, meter):
    engine.train()
    # The loss sum and the sample count stay on the device: no wait for them per step.
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for step, (inputs, labels) in enumerate(loader):
        meter.batch_in_hand()
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        inputs = inputs.to(device, non_blocking=True, memory_format=data.layout(inputs, args))
        labels = labels.to(device, non_blocking=True)
        last_pass = (step + 1) % args.grad_accum == 0 or step + 1 == len(loader)
        # DeepSpeed: float batches in the engine's precision (normalise them first, as bf16 keeps 3
        # digits); the engine's group ends where ours does, then it averages, clips and steps.
        if inputs.is_floating_point():
            inputs = inputs.to(engine.get_data_types()[0])
        engine.set_gradient_accumulation_boundary(last_pass)
        loss = F.cross_entropy(engine(inputs).float(), labels)  # collective (ZeRO-3)
        engine.backward(loss)  # collective
        engine.step()  # collective
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


# DeepSpeed: the engine in place of the model, in its precision (no autocast).
@torch.no_grad()
def evaluate(args, engine, loader, device):
    engine.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for inputs, labels in loader:
        # GPU: as in training.
        inputs = inputs.to(device, non_blocking=True, memory_format=data.layout(inputs, args))
        labels = labels.to(device, non_blocking=True)
        # DeepSpeed: as in training.
        if inputs.is_floating_point():
            inputs = inputs.to(engine.get_data_types()[0])
        logits = engine(inputs).float()  # collective (ZeRO-3)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    # DDP: add up every shard's loss sum, hits and count.
    dist.all_reduce(totals)  # collective
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# DeepSpeed: every rank's copy of the whole weights in fp32 (ZeRO 1-3 gathers them), and buffers.
def full_weights(engine):
    masters, state = zero0_fp32_masters(engine.optimizer), {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            full = deepspeed.utils.safe_get_full_fp32_param(tensor)  # collective
            tensor = masters.get(id(tensor), tensor) if full is None else full
        tensor = tensor.detach().cpu()
        state[name] = tensor.float() if tensor.is_floating_point() else tensor
    return state


# DeepSpeed: every rank saves its shard into the epoch's folder, which rank 0 clears first (the
# engine removes no file, and its save starts with a barrier) and completes with the run's position.
def save_checkpoint(args, engine, row, info):
    folder = checkpoint.own_path(args.out_dir, row, "ds_checkpoints")
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    engine.save_checkpoint(*os.path.split(folder))  # collective
    if dist.get_rank() == 0:
        state = {"step": STEP, "global_step": engine.global_steps, "synthetic": info.synthetic}
        checkpoint.save_position(args, row, state, "ds_checkpoints")


# DeepSpeed: every rank loads its shard from the folder rank 0 chose; then all compare epoch, step
# and whole weights.
def resume(engine, state, progress):
    rank, seen = dist.get_rank(), [None] * dist.get_world_size()
    if state.get("folder"):
        dist.all_gather_object(seen, os.path.isdir(state["folder"]))  # collective
        checkpoint.check_seen(seen, state["folder"], "DeepSpeed")
        refuse_other_process_counts(state["folder"])
        engine.load_checkpoint(*os.path.split(state["folder"]))  # collective
        progress = checkpoint.resume(state, verbose=rank == 0)
    mine = checkpoint.position(progress, full_weights(engine))  # collective
    positions = [None] * len(seen)
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
    # DeepSpeed: a signal to its launcher's own process stops every rank too (the ranks watch it).
    stop = preempt.Stop(args.stop_after, agree=stop_agreement(group), watch=launcher_pid())
    train_set, test_set, info = build_data(args)  # collective
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device)
    steps_per_epoch = sampler.steps
    # DeepSpeed: rank 0 picks an engine folder or any step's .pt and sends it; a .pt's weights go
    # into the model before ZeRO shards them.
    found = [checkpoint.find(args, own="ds_checkpoints") if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # collective
    found = found[0]
    progress = checkpoint.resume({} if found.get("folder") else found, model, verbose=rank == 0)
    start_epoch, _, part_done = progress
    # DeepSpeed: the schedule and step count start after the steps done.
    start_step = start_epoch * steps_per_epoch + sampler.steps_done(part_done.get(start_epoch + 1))
    config = build_config(args, amp_dtype)
    if rank == 0:
        print(f"DeepSpeed config: {json.dumps(config, separators=(',', ':'))}")
    scheduler = functools.partial(build_scheduler, args, steps_per_epoch, start_step)
    engine = build_optimizer(model, config, scheduler)  # collective
    engine.global_steps = start_step
    start_epoch, _, part_done = resume(engine, found, progress)  # collective
    if args.compile:
        engine.compile()
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader,
              prefix=f"ZeRO stage {engine.zero_optimization_stage()}, ")

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        # DeepSpeed: the engine trains; it never syncs buffers, so every rank takes rank 0's.
        row = train_one_epoch(args, engine, train_loader, device, stop, meter)  # collective
        row = {"epoch": epoch, **row}
        for buffer in engine.module.buffers():
            dist.broadcast(buffer, 0)  # collective
        if not row.get("partial"):
            row.update(evaluate(args, engine, test_loader, device))  # collective
        save_checkpoint(args, engine, row, info)  # collective
        log.epoch(row)
        dist.barrier()  # collective
        if stop.leave(epoch, start_epoch, args.epochs):  # collective
            break

    # DeepSpeed: every rank's digest of the gathered weights; free the engine now, as DDP in 04.
    log.finish(full_weights(engine))  # collective
    del engine, model
    gc.collect()
    dist.destroy_process_group()
    # 75 after a stop signal: a batch script requeues the job.
    return stop.exit_status()


# DDP: without a launcher, this process is rank 0 of 1, at a port the OS picks (MASTER_PORT 0).
def be_a_group_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or "0"
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


# DeepSpeed: it cannot re-partition SGD's state for another number of processes.
def refuse_other_process_counts(folder):
    shards = [name for name in os.listdir(folder) if name.endswith("optim_states.pt")]
    if shards and len(shards) != dist.get_world_size():
        sys.exit(f"the DeepSpeed checkpoint {folder} holds the optimizer state of {len(shards)} "
                 f"processes, this run has {dist.get_world_size()}; start {len(shards)}, or "
                 "continue from its weights (momentum starts again): `python scripts/ds_to_pt.py "
                 f"{folder}` makes the checkpoint-epochNNNN.pt to --resume")


# DeepSpeed: ZeRO 0's fp32 weights in 16 bits, which no public call gives (safe_get_full_fp32_param
# answers None there).
def zero0_fp32_masters(optimizer):
    pairs = zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", []))
    return {id(low): high for lows, highs in pairs for low, high in zip(lows, highs)}


# DeepSpeed: no run-time switch skips its CPU op for inference (DS_BUILD_SHM_COMM acts at install).
def skip_shm_op_build():
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# plumbing: no torch deprecation warnings from ZeRO, no "untested" SGD warning.
def quiet_deepspeed():
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    def not_about_sgd(record):
        return "untested optimizer" not in record.getMessage()
    deepspeed.utils.logger.addFilter(not_about_sgd)


# plumbing: the deepspeed runner's process id (launch.py's parent), or None.
def launcher_pid():
    parent = psutil.Process(os.getppid())
    if "deepspeed.launcher.launch" in " ".join(parent.cmdline()):
        return parent.ppid()
    return None


if __name__ == "__main__":
    sys.exit(main())
