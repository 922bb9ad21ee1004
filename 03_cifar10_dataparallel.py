"""Step 03: every GPU of one machine from one process, with nn.DataParallel.

What changes from step 02: the model is wrapped in nn.DataParallel, which splits every batch across the visible GPUs,
runs a copy of the model on each in threads and gathers the outputs on GPU 0. Checkpoints save model.module (no
`module.` prefix). Without GPUs it simply calls the model.

    python 03_cifar10_dataparallel.py                          # all visible GPUs
    CUDA_VISIBLE_DEVICES=0,1 python 03_cifar10_dataparallel.py # only GPUs 0 and 1
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)  # the flags of every step
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    device = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS; None: none
    if device is not None:  # GPU: there is one
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:  # GPU: no accelerator: say so once and carry on on the CPU
        device = torch.device("cpu")
        print("no GPU found: running on the CPU")
    checkpoint.settings(args).apply(args)  # --resume: that run's settings (those not typed); --out-dir: refusals
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device)  # GPU: auto = bf16 if native (Ampere on), else fp16


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    data.download(args.data_dir)  # CIFAR-10: downloads it unless a cifar-10-batches-py folder is there
    return data.cifar10(args.data_dir, seed=args.seed)


def build_loaders(args, train_set, test_set):
    # A new random order of the whole set each epoch, from (seed, epoch) alone: the sampler that step 04 splits across
    # processes, here with one. EpochSampler: whole optimizer steps; a resumed epoch starts after those already done.
    order = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
    sampler = data.EpochSampler(order, args.batch_size * args.grad_accum)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              persistent_workers=args.workers > 0,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers,  # GPU: pinned too
                             pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
# --arch chooses one of these; the first is the default.
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device):
    model = model.to(device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    # DataParallel: each forward pass scatters the batch over all visible GPUs, replicates the model, gathers on GPU 0.
    print(f"DataParallel over {torch.accelerator.device_count()} GPU(s) (fewer than 2, or MPS: a passthrough)")
    return nn.DataParallel(model)  # DataParallel: the wrapper; the model itself is model.module


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # fp16 only (GPU, step 02)
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
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / args.grad_accum).backward()  # gradients add up over the passes of a group
        if last_pass:  # one optimizer step per group
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()  # gradients to None (the default): nothing to zero
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
        meter.batch_done()
        if last_pass and stop.requested((step + 1) // args.grad_accum):  # a stop signal: leave after this step
            break
    return meter.row(totals)


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
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info):
    # DataParallel: save the model inside the wrapper (no `module.` prefix), as every later step does too.
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.module.state_dict(), optimizer=optimizer, scheduler=scheduler,
                           scaler=scaler, args=args, metrics=row, synthetic=info.synthetic)


def resume(args, model, optimizer, scheduler, scaler):
    # --resume's checkpoint into the objects; (epochs done, steps done, {epoch: its part done} if it stopped part-way)
    return checkpoint.resume(args, model=model.module, optimizer=optimizer, scheduler=scheduler, scaler=scaler)


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    device, amp_dtype = setup(args)
    stop = preempt.Stop(args.stop_after)  # SIGTERM/SIGUSR1: finish the step, save, exit 75 (common/preempt.py)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device)
    steps_per_epoch = len(train_loader) // args.grad_accum
    optimizer, scheduler, scaler = build_optimizer(args, model, steps_per_epoch, device, amp_dtype)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler)
    if amp_dtype is not None:  # DataParallel: replica threads start at the default autocast dtype (GPUs: fp16): ours
        model.module.register_forward_pre_hook(lambda module, inputs: torch.set_autocast_dtype(device.type, amp_dtype))
    train_model = torch.compile(model) if args.compile else model  # same weights; checkpoints use `model`
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, steps_per_epoch)
    log.start(device, amp_dtype, train_loader)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = {"epoch": epoch, **train_one_epoch(args, train_model, train_loader, optimizer, scheduler, scaler,
                                                 device, amp_dtype, stop, meter)}
        global_step = scheduler.last_epoch  # optimizer steps so far (the schedule counts them)
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(args, train_model, test_loader, device, amp_dtype))
        save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info)
        log.epoch(row)
        if stop.leave(epoch, start_epoch, args.epochs):  # a stop signal, or --stop-after: continue with --resume auto
            break

    log.finish(model.module.state_dict())  # training_curves.png, weights-rank0.sha256
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
