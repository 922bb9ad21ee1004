"""Step 02: the same training on one GPU.

What changes from step 01: the device (the machine's GPU, else the CPU, said once), cuDNN's fastest
convolutions, batches copied from pinned memory without blocking. --amp auto: bf16 on GPUs that
compute it natively (Ampere on), else fp16, where step 01's GradScaler acts.

    python 02_cifar10_gpu.py                          # GPU 0 (CUDA_VISIBLE_DEVICES picks another)
    python 02_cifar10_gpu.py --amp fp16               # fp16 with loss scaling (GradScaler)
    python 02_cifar10_gpu.py --arch cnn --epochs 3    # runs on the CPU too
"""
import os
import sys
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common import checkpoint, data, metrics, models, preempt
from common.cli import amp_dtype, exits_cleanly, shared_parser
from common.schedule import warmup_cosine

STEP = os.path.splitext(os.path.basename(__file__))[0]
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1


def parse_args(argv=None):
    parser = shared_parser(__doc__.splitlines()[0], STEP, ARCHS)
    return parser.parse_args(argv)


def setup(args):
    # GPU: the machine's GPU (CUDA, ROCm, XPU or MPS), else the CPU; cuDNN times its kernels once.
    device = torch.accelerator.current_accelerator(check_available=True)
    if device is not None:
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        print("no GPU found: running on the CPU")
    # --resume continues a run with its settings (those not typed again).
    checkpoint.settings(args).apply(args)
    torch.manual_seed(args.seed)
    return device, amp_dtype(args.amp, device)


def build_data(args):
    """(train set, test set, data.Info): map-style data sets of (input, label). Yours: README."""
    data.download(args.data_dir)
    return data.cifar10(args.data_dir, seed=args.seed)


def build_loaders(args, train_set, test_set):
    # A new order of the whole set each epoch, from (seed, epoch) alone: the sampler that step 04
    # splits across processes, here with one. A resumed epoch starts after the steps already done.
    order = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
    sampler = data.EpochSampler(order, args.batch_size * args.grad_accum, args.drop_last)
    # GPU: batches in page-locked memory copy to the GPU without blocking the process.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, persistent_workers=args.workers > 0,
                              pin_memory=torch.accelerator.is_available())
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers,
                             persistent_workers=args.workers > 0,
                             pin_memory=torch.accelerator.is_available())
    return train_loader, test_loader, sampler


ARCHS = {"resnet18": models.resnet18, "cnn": models.cnn, "cnn_bn": models.cnn_bn}


def build_model(args, info):
    """The network, for batches as build_data's sets give them (ours: uint8, normalised inside)."""
    return ARCHS[args.arch](num_classes=info.num_classes, mean=info.mean, std=info.std)


def prepare_model(args, model, device):
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    return model.to(device, memory_format=memory_format)


def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    schedule = warmup_cosine(args.epochs, steps_per_epoch, WARMUP_EPOCHS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
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
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(inputs), labels)
        # Gradients add up over a group's passes; one optimizer step per group (fp16: if finite).
        scaler.scale(loss / args.grad_accum).backward()
        if last_pass:
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        totals[0] += loss.detach() * len(labels)
        totals[1] += len(labels)
        meter.batch_done(loss)
        # A stop signal (SIGTERM, SIGUSR1) ends the epoch after a whole optimizer step.
        if last_pass and stop.requested(step // args.grad_accum + 1):
            break
    return meter.row(totals)


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
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


def save_checkpoint(args, training, row, info):
    state = {"step": STEP, "model": training.model.state_dict(),
             "optimizer": training.optimizer.state_dict(),
             "scheduler": training.scheduler.state_dict(), "scaler": training.scaler.state_dict(),
             "global_step": training.scheduler.last_epoch, "synthetic": info.synthetic}
    return checkpoint.save(args, row, state)


def resume(args, training):
    return checkpoint.resume(checkpoint.find(args), training.model, training.optimizer,
                             training.scheduler, training.scaler)


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    device, amp_dtype = setup(args)
    # SIGTERM or SIGUSR1: finish the optimizer step, save, exit with status 75.
    stop = preempt.Stop(args.stop_after)
    train_set, test_set, info = build_data(args)
    train_loader, test_loader, sampler = build_loaders(args, train_set, test_set)
    model = prepare_model(args, build_model(args, info), device)
    optimizer, scheduler, scaler = build_optimizer(args, model, sampler.steps, device, amp_dtype)
    training = Training(model, optimizer, scheduler, scaler, device, amp_dtype)
    start_epoch, _, part_done = resume(args, training)
    # --compile: the model's forward, compiled in place (its weights and their names stay).
    if args.compile:
        model.compile()
    log, meter = metrics.Log(STEP, args, start_epoch, info), metrics.Meter(args, sampler.steps)
    log.start(device, amp_dtype, train_loader)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        # A new order each epoch; after a stop part-way through it, only the steps not done yet.
        meter.start(part_done.get(epoch), sampler.set_epoch(epoch, part_done.get(epoch)))
        row = train_one_epoch(args, training, train_loader, stop, meter)
        row = {"epoch": epoch, **row}
        # An epoch stopped part-way is saved, not evaluated.
        if not row.get("partial"):
            row.update(evaluate(args, model, test_loader, device, amp_dtype))
        save_checkpoint(args, training, row, info)
        log.epoch(row)
        if stop.leave(epoch, start_epoch, args.epochs):
            break

    log.finish(model.state_dict())
    # 75 after a stop signal: a batch script requeues the job.
    return stop.exit_status()


if __name__ == "__main__":
    sys.exit(main())
