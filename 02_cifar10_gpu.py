"""Step 02: the same training on one GPU.

What changes from step 01: pick the device (a GPU if there is one, else the CPU, said in one
line), let cuDNN pick its fastest convolutions, and copy batches from pinned memory without
blocking. --amp auto: bf16 on GPUs that compute it natively (Ampere on), fp16 on older ones, where
the GradScaler of step 01 starts to act.

    python 02_cifar10_gpu.py                          # GPU 0 (CUDA_VISIBLE_DEVICES picks another)
    python 02_cifar10_gpu.py --amp fp16               # fp16 with loss scaling (GradScaler)
    python 02_cifar10_gpu.py --arch cnn --epochs 3    # runs on the CPU too (bf16 autocast)
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]  # this script's name: the label of its outputs
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = shared_parser("Step 02: training on one GPU (CPU fallback).", STEP, ARCHS)  # flags of every step
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    device = torch.accelerator.current_accelerator(check_available=True)  # GPU: CUDA, ROCm, XPU or MPS; None: none
    if device is not None:
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:  # GPU: no accelerator: say so once and carry on on the CPU
        device = torch.device("cpu")
        print("no GPU found: running on the CPU")
    checkpoint.continue_run(args)  # --resume: that run's settings (those not typed); --out-dir: this run's (refusals)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device)  # GPU: auto = bf16 if native (Ampere on), else fp16


# ----------------------------------------------------------------------------- data
def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (image, label). Yours: see the README (template)."""
    data.prepare_cifar10(args.data_dir)  # CIFAR-10: downloads unless a cifar-10-batches-py folder is there
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    return train_set, test_set, data.Info(num_classes=10, synthetic=data.is_synthetic(args.data_dir))


def build_loaders(args, train_set, test_set):
    sampler = preempt.ShuffledSampler(train_set, seed=args.seed)  # an order that depends on (seed, epoch) alone
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.accelerator.is_available())  # GPU: page-locked batches copy asynchronously
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers, pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


# ----------------------------------------------------------------------------- model
ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn}  # --arch choices (the first is the default)


def build_model(args, num_classes):
    """The network, for batches as build_data's sets give them (ours: uint8 images, normalised inside the model)."""
    return ARCHS[args.arch](num_classes=num_classes, mean=data.MEAN, std=data.STD)


def prepare_model(args, model, device):
    return model.to(device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # fp16 only (GPU, step 02)
    return optimizer, scheduler, scaler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(model, batches, optimizer, scheduler, scaler, device, amp_dtype):
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    for step, (images, labels) in enumerate(batches):  # whole accumulation groups (batches: see main)
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images = images.to(device, non_blocking=True, memory_format=batches.memory_format)
        labels = labels.to(device, non_blocking=True)
        last_pass = (step + 1) % batches.grad_accum == 0
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / batches.grad_accum).backward()  # gradients add up over the passes of a group
        if last_pass:  # one optimizer step per group
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()  # gradients to None (the default): nothing to zero
        totals[0] += loss.detach() * len(labels)  # stays on the device: no wait per step
        totals[1] += len(labels)
    return metrics.train_row(totals, batches)


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, memory_format):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=memory_format)  # GPU: as in training
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic):
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.state_dict(), optimizer=optimizer, scheduler=scheduler,
                           scaler=scaler, args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler, scaler):
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch)  # None: start from scratch
    if state is None:
        return 0, 0, {}
    epoch, global_step = checkpoint.restore(state, model=model, optimizer=optimizer, scheduler=scheduler,
                                            scaler=scaler)
    print(f"resumed from {checkpoint.describe(state)}")
    return epoch, global_step, preempt.part_done(state)  # {epoch: its part done} if it stopped part-way


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    device, amp_dtype = setup(args)
    stop = preempt.Stop(stop_after=args.stop_after)  # SIGTERM/SIGUSR1: finish the step, save, exit 75 (docstring)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info.num_classes), device)
    optimizer, scheduler, scaler = build_optimizer(args, model, len(train_loader) // args.grad_accum, device, amp_dtype)
    start_epoch, global_step, part_done = resume(args, model, optimizer, scheduler, scaler)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # batches as NHWC
    batches = preempt.Batches(train_loader, args.grad_accum, memory_format, stop, part_done, metrics.Profile(args))
    train_model = torch.compile(model) if args.compile else model  # same weights; checkpoints use `model`
    log = metrics.MetricsLog(args.out_dir, start_epoch, info.synthetic)
    print(metrics.start_line(STEP, args, device, amp_dtype, train_loader, info.synthetic))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new order each epoch
        row = {"epoch": epoch, **train_one_epoch(train_model, batches.epoch(epoch), optimizer, scheduler, scaler,
                                                 device, amp_dtype)}
        global_step = scheduler.last_epoch  # optimizer steps so far (the schedule counts them)
        if not row.get("partial"):  # stopped part-way: saved as checkpoint-epochNNNN-stepSSSSSS.pt, not evaluated
            row.update(evaluate(train_model, test_loader, device, amp_dtype, memory_format))
        save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, info.synthetic)
        print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        if stop.leave(epoch, start_epoch, args.epochs):  # a stop signal, or --stop-after: continue with --resume auto
            break

    metrics.plot(args.out_dir, f"{STEP} ({args.arch})")
    checkpoint.write_digest(args.out_dir, 0, model.state_dict())
    return stop.exit_status()  # 75 after a stop signal: a batch script requeues the job


if __name__ == "__main__":
    sys.exit(main())
