"""Step 05: DeepSpeed: one engine owns the optimizer, precision and accumulation; ZeRO shards the state.

What changes from step 04: deepspeed.initialize wraps model, optimizer and schedule in an engine built
from ds_config.json (the command line sets batch, lr, precision); the loop calls engine(images),
engine.backward(loss), engine.step(). ZeRO 1 partitions the optimizer state across the processes, 2
also the gradients, 3 also the weights. Checkpoints: the engine's (a shard per rank; exact resume)
and checkpoint-epochNNNN.pt (fp32 weights gathered from the shards), which every other step loads.

    deepspeed --num_gpus 4 05_cifar10_deepspeed.py --deepspeed_config ds_config.json --zero-stage 3
    deepspeed --hostfile hostfile 05_cifar10_deepspeed.py          # several machines (docs/05-deepspeed.md)
"""
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, deepspeed_support, distributed, metrics, models, preempt
from common.cli import UserError, amp_dtype, brief, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
WARMUP_EPOCHS = 1  # DeepSpeed: SGD's momentum and weight decay are in ds_config.json
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")  # DeepSpeed: the default config
deepspeed = exits_cleanly(deepspeed_support.load)()  # DeepSpeed: import it quietly, or say how to install it


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser("Step 05: training with DeepSpeed (ZeRO 0-3), one process per GPU.", STEP, ARCHS)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by deepspeed and torch.distributed.launch (torchrun sets LOCAL_RANK)")  # DeepSpeed: too
    parser.add_argument("--sync-bn", action="store_true",
                        help="batch-norm statistics over the global batch (SyncBatchNorm; needs CUDA GPUs)")
    distributed.add_arguments(parser, spawn=False)  # plumbing: --dist-timeout SECONDS
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=CONFIG, metavar="JSON",  # DeepSpeed: its config
                        help="the DeepSpeed config (default: ds_config.json next to this script)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="0 = none, 1 = optimizer state, 2 = + gradients, 3 = + weights (default: the config's)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # DDP: set by the launcher
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS
    if accelerator is not None:
        if args.local_rank >= torch.accelerator.device_count():  # plumbing: more processes than GPUs on this machine
            raise UserError(f"local rank {args.local_rank} has no GPU: start <= {torch.accelerator.device_count()} per node")
        device = torch.device(accelerator.type, args.local_rank)  # DDP: one GPU per process, chosen by local rank
        torch.accelerator.set_device_index(args.local_rank)
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:
        device = torch.device("cpu")
        if rank == 0:  # plumbing: one line, not one per process
            print("no GPU found: running on the CPU")
    if args.sync_bn and device.type not in ("cuda", "xpu"):  # DDP: torch's SyncBatchNorm has kernels for these only
        raise UserError(f"--sync-bn needs CUDA or XPU GPUs (torch's SyncBatchNorm has no {device.type} kernel); drop it")
    # DeepSpeed: joins the group as init_process_group does (nccl for CUDA, gloo for CPUs), from the same variables.
    deepspeed.init_distributed(dist.get_default_backend_for_device(device),
                               timeout=args.dist_timeout)  # DeepSpeed: as in 04, a dead peer = an error, not a hang
    checkpoint.continue_run(args)  # --resume: that run's settings (those not typed); --out-dir: this run's (refusals)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device), rank, world_size


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    if args.local_rank == 0:  # DDP: one process per machine downloads; the others wait at the barrier
        data.prepare_cifar10(args.data_dir)  # CIFAR-10: downloads unless a cifar-10-batches-py folder is there
    dist.barrier()
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    return train_set, test_set, data.Info(num_classes=10, synthetic=data.is_synthetic(args.data_dir))


def build_loaders(args, train_set, test_set):
    # DDP: each rank draws a disjoint 1/world_size shard of one shared permutation (seed + epoch).
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    # DDP: evaluation shards the test set without padding, so no image is counted twice.
    test_loader = DataLoader(test_set, batch_size=512, sampler=range(dist.get_rank(), len(test_set), dist.get_world_size()),
                             num_workers=args.workers, pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn}  # --arch choices (the first is the default)


def build_model(args, num_classes):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=num_classes, mean=data.MEAN, std=data.STD)


def prepare_model(args, model, device):
    model = model.to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model  # DDP: BN over the global batch
    # DeepSpeed: no wrapper (deepspeed.initialize builds the engine) and NCHW weights (ZeRO's flat buffers need them).
    return model


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, amp_dtype):
    # DeepSpeed: ds_config.json with the command line's batch, accumulation, lr, ZeRO stage and precision written in
    # (bf16/fp16: 16-bit weights with fp32 masters in the engine, not autocast).
    config = deepspeed_support.config(args, CONFIG, amp_dtype)
    # DeepSpeed: builds SGD from the config, steps our schedule; owns precision, gradient averaging, clipping, ZeRO.
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))
    except (AssertionError, ValueError) as error:  # a config DeepSpeed refuses, in one line
        raise UserError(f"deepspeed.initialize refused the config: {brief(error, 300)}") from None
    return engine


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(engine, batches, device):
    engine.train()  # DeepSpeed: the engine is an nn.Module around the model
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    for images, labels in batches:  # DeepSpeed: whole accumulation groups, as the engine counts them
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images = images.to(device, non_blocking=True, memory_format=batches.memory_format)
        labels = labels.to(device, non_blocking=True)
        # DeepSpeed: the engine runs the model in its precision; under ZeRO-3 it gathers each layer's weights first.
        loss = F.cross_entropy(engine(images).float(), labels)
        engine.backward(loss)  # DeepSpeed: / grad_accum; on a group's last pass also averages gradients across ranks
        engine.step()  # DeepSpeed: on a group's last pass: clip, step optimizer and schedule, zero the gradients
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
    dist.all_reduce(totals)  # DDP: every rank saw different images; sum over ranks for the loss and throughput
    return metrics.train_row(totals, batches)


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(engine, loader, device, memory_format):
    engine.eval()  # DeepSpeed: as in train_one_epoch
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=memory_format)  # GPU: as in training
        labels = labels.to(device, non_blocking=True)
        logits = engine(images).float()  # DeepSpeed: through the engine (its precision; ZeRO-3 gathers the weights)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # DDP: add up every shard's loss sum, hits and count
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, engine, row, synthetic):
    # DeepSpeed: EVERY rank writes its shard of the engine state (exact resume); rank 0 then the common format.
    folder = os.path.join(args.out_dir, deepspeed_support.ENGINE_DIR)
    engine.save_checkpoint(folder, tag=checkpoint.tag(epoch, row), client_state={
        "step": STEP, "epoch": checkpoint.epochs_done(epoch, row), "global_step": global_step, "metrics": row,
        "rng": checkpoint.rng_states()})
    model_state = deepspeed_support.export_weights(engine)  # DeepSpeed: a collective: every rank takes part
    if dist.get_rank() == 0:
        deepspeed_support.prune(folder)  # DeepSpeed: keep 3 engine checkpoints, like checkpoint-epoch*.pt
        return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                               model_state=model_state, args=args, metrics=row, synthetic=synthetic)


def resume(args, engine, start_epoch, steps_per_epoch):
    found = deepspeed_support.engine_checkpoint(args.resume, args.out_dir)
    if found is None:  # DeepSpeed: fresh, or weights only: the schedule goes to where that epoch ended
        checkpoint.place_schedule(engine.lr_scheduler, start_epoch * steps_per_epoch)
        engine.global_steps = start_epoch * steps_per_epoch  # DeepSpeed: its step count, saved in its checkpoints
        return start_epoch, engine.global_steps, {}
    folder, client = deepspeed_support.load_engine(engine, found, args.resume, STEP)  # DeepSpeed: each rank its shard
    if dist.get_rank() == 0:
        print(f"resumed from {checkpoint.describe(client)}, DeepSpeed checkpoint {folder}")
    return client["epoch"], client["global_step"], preempt.part_done(client)


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:  # plumbing: no launcher: a group of one (start more with deepspeed or torchrun)
        return distributed.without_launcher(main, argv)
    device, amp_dtype, rank, world_size = setup(args)
    stop = preempt.Stop(stop_after=args.stop_after)  # SIGTERM/SIGUSR1: finish the step, save, exit 75 (docstring)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info.num_classes), device)
    start_epoch = deepspeed_support.load_weights(args, model)  # DeepSpeed: any step's checkpoint-epochNNNN.pt: weights
    engine = build_optimizer(args, model, len(train_loader) // args.grad_accum, amp_dtype)
    start_epoch, global_step, part_done = resume(args, engine, start_epoch, len(train_loader) // args.grad_accum)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # batches as NHWC
    batches = preempt.Batches(train_loader, args.grad_accum, memory_format, stop, part_done, metrics.Profile(args))
    if args.compile:
        engine.compile()  # DeepSpeed: compiles the module inside the engine; the checkpoints do not change
    log = metrics.MetricsLog(args.out_dir, start_epoch, info.synthetic) if rank == 0 else None  # DDP: rank 0 writes
    if rank == 0:  # plumbing: one rank prints and draws
        print(metrics.start_line(STEP, args, device, amp_dtype, train_loader, info.synthetic, processes=world_size,
                                 prefix=f"ZeRO stage {engine.zero_optimization_stage()}, "))  # DeepSpeed: as resolved

    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # DDP: a new shared permutation each epoch (without it: same order every epoch)
        row = {"epoch": epoch, **train_one_epoch(engine, batches.epoch(epoch), device)}
        global_step = engine.global_steps  # DeepSpeed: optimizer steps, also those skipped on fp16 overflow (unscheduled)
        for buffer in engine.module.buffers():  # DeepSpeed: never synced by the engine (DDP does): take rank 0's
            dist.broadcast(buffer, 0)
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(engine, test_loader, device, memory_format))
        save_checkpoint(args, epoch, global_step, engine, row, info.synthetic)  # DeepSpeed: on every rank
        if rank == 0:  # DDP: one writer; the others would race on the same files
            print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        dist.barrier()  # DDP: nobody runs ahead while rank 0 writes (a stop after this epoch is then safe)
        if stop.leave(epoch, start_epoch, args.epochs):  # a stop signal, or --stop-after: continue with --resume auto
            break

    if rank == 0:  # plumbing: one rank prints and draws
        metrics.plot(args.out_dir, f"{STEP} ({args.arch}, {world_size} processes)")
    checkpoint.write_digest(args.out_dir, rank, deepspeed_support.export_weights(engine))  # DeepSpeed: as exported
    del engine, model  # DeepSpeed: as in 04 (under ZeRO 1-3 autograd hooks would also keep the engine alive)
    gc.collect()
    dist.destroy_process_group()  # DDP: leave the group cleanly so the launcher sees a clean exit
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
