"""Step 02: the same training on one GPU.

What changes from step 01: pick the device (a GPU if there is one, else the CPU, said in one
line), move the model and every batch to it (pinned memory + non_blocking copies), store images
and activations channels_last, and train in mixed precision with torch.autocast (fp16 with a
GradScaler on GPU, bf16 on CPU). cudnn.benchmark picks the fastest convolution algorithms.

    python 02_cifar10_gpu.py                          # GPU 0 (CUDA_VISIBLE_DEVICES picks another)
    python 02_cifar10_gpu.py --amp bf16               # bf16 on Ampere or newer: no loss scaling needed
    python 02_cifar10_gpu.py --arch cnn --epochs 3    # runs on the CPU too (bf16 autocast)
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler
from tqdm import tqdm

from common import checkpoint, data, metrics, models
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int
from common.schedule import warmup_cosine

STEP = "02_cifar10_gpu"
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
LOG_EVERY = 20  # steps between progress-bar loss updates


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Step 02: CIFAR-10 on one GPU (CPU fallback).")
    parser.add_argument("--data-dir", default="./data",
                        help="CIFAR-10 root holding cifar-10-batches-py/ (downloaded if missing; default ./data)")
    parser.add_argument("--out-dir", default=f"runs/{STEP}",
                        help=f"checkpoints, metrics.jsonl, training_curves.png (default runs/{STEP})")
    parser.add_argument("--epochs", type=positive_int, default=30, help="total epochs (default 30)")
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="images per optimizer step (default 128)")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="peak learning rate of SGD (default 0.1)")
    parser.add_argument("--arch", choices=sorted(models.ARCHS), default="resnet18",
                        help="resnet18 (default) or cnn (small and fast, for smoke runs)")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for weights, order and augmentation")
    parser.add_argument("--resume", metavar="PATH|auto",
                        help="checkpoint to continue from; 'auto' = newest in --out-dir (fresh start if none)")
    parser.add_argument("--stop-after", type=positive_int, metavar="N",
                        help="leave after N epochs of this run (time-limited jobs); continue with --resume auto")
    # GPU: the speed knobs of a single device.
    parser.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
                        help="mixed precision: auto = fp16 on GPU, bf16 on CPU (default auto)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                        help="NHWC memory layout, faster convolutions on tensor cores and CPUs (default on)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (first epoch pays a one-time compile, 30-60 s on CPU)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    torch.manual_seed(args.seed)
    # GPU: use one if there is one; otherwise say so once and carry on on the CPU.
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.backends.cudnn.benchmark = True  # GPU: fixed input shapes, so let cuDNN time its algorithms once
    else:
        device = torch.device("cpu")
        print("no CUDA GPU found: running on the CPU (bf16 autocast instead of fp16)")
    # GPU: fp16 needs a GradScaler (its range is small); bf16 has fp32's range and does not.
    amp = {"auto": "fp16" if device.type == "cuda" else "bf16"}.get(args.amp, args.amp)
    if amp == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; on the CPU use --amp bf16 or --amp off")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    return device, amp_dtype


# ----------------------------------------------------------------------------- data
def build_data(args):
    data.prepare_cifar10(args.data_dir)  # downloads unless a cifar-10-batches-py folder is there
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    # Shuffle with our own generator, re-seeded every epoch: a resumed run sees the same batches.
    shuffle = torch.Generator()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=RandomSampler(train_set, generator=shuffle),
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True,
                              pin_memory=torch.cuda.is_available())  # GPU: page-locked batches copy asynchronously
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers, pin_memory=torch.cuda.is_available())
    if len(train_loader) == 0:
        raise UserError(f"--batch-size {args.batch_size} is larger than the {len(train_set)} training images")
    return train_loader, test_loader, shuffle


# ----------------------------------------------------------------------------- model
def build_model(args, device):
    model = models.build_model(args.arch).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)  # GPU: NHWC weights for NHWC batches
    return model


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch, device, amp_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.epochs * steps_per_epoch, WARMUP_EPOCHS * steps_per_epoch))
    # GPU: scales the fp16 loss so small gradients do not flush to zero; a no-op for bf16/fp32.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    return optimizer, scheduler, scaler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, amp_dtype, memory_format, epoch):
    model.train()
    loss_sum = torch.zeros((), device=device)
    seen = 0
    bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=not sys.stderr.isatty())
    start = time.perf_counter()
    for step, (images, labels) in enumerate(bar):
        # GPU: non_blocking lets the copy overlap with compute (the batch is in pinned memory).
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # GPU: skips the step if fp16 gradients overflowed
        scaler.update()
        scheduler.step()
        loss_sum += loss.detach() * len(labels)  # stays on the device: no wait per step
        seen += len(labels)
        if not bar.disable and step % LOG_EVERY == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    train_loss = loss_sum.item() / seen
    seconds = time.perf_counter() - start
    return {"train_loss": train_loss, "images_per_sec": seen / seconds, "epoch_seconds": seconds,
            "peak_memory_mb": metrics.peak_memory_mb(device)}


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, memory_format):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        # GPU: the same device, memory layout and precision as in training.
        images = images.to(device, non_blocking=True, memory_format=memory_format)
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
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch)
    if state is None:
        if args.resume == "auto":
            print(f"no checkpoint in {args.out_dir}: starting from scratch")
        return 0, 0
    epoch, global_step = checkpoint.restore(state, model=model, optimizer=optimizer, scheduler=scheduler,
                                            scaler=scaler)
    print(f"resumed from epoch {epoch} (written by {state['step']})")
    return epoch, global_step


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    device, amp_dtype = setup(args)
    checkpoint.make_out_dir(args.out_dir)
    train_loader, test_loader, shuffle = build_data(args)
    synthetic = data.is_synthetic(args.data_dir)
    model = build_model(args, device)
    optimizer, scheduler, scaler = build_optimizer(args, model, len(train_loader), device, amp_dtype)
    start_epoch, global_step = resume(args, model, optimizer, scheduler, scaler)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # GPU: batches as NHWC
    train_model = torch.compile(model) if args.compile else model  # GPU: same weights; checkpoints use `model`
    log = metrics.MetricsLog(args.out_dir, start_epoch, synthetic)
    print(f"{STEP}: {args.arch} on {device}, amp {amp_dtype}, batch {args.batch_size}, {len(train_loader.dataset)} training images, "
          f"{len(train_loader)} steps/epoch" + ("  [SYNTHETIC DATA, not CIFAR-10]" if synthetic else ""))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        shuffle.manual_seed(args.seed + epoch)
        train_loader.dataset.set_epoch(epoch)
        row = {"epoch": epoch, **train_one_epoch(train_model, train_loader, optimizer, scheduler, scaler, device,
                                                 amp_dtype, memory_format, epoch)}
        global_step += len(train_loader)
        row.update(evaluate(train_model, test_loader, device, amp_dtype, memory_format))
        save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, scaler, row, synthetic)
        print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        if args.stop_after and epoch - start_epoch >= args.stop_after and epoch < args.epochs:
            print(f"stopping after {args.stop_after} epoch(s) as asked; continue with --resume auto")
            break

    metrics.plot(args.out_dir, f"{STEP} ({args.arch})")
    checkpoint.write_digest(args.out_dir, 0, model.state_dict())


if __name__ == "__main__":
    main()
