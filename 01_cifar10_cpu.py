"""Step 01: train a CIFAR-10 classifier on the CPU.

The baseline every later step changes: data, model, optimizer and schedule, one training epoch,
evaluation, checkpoints and resume. Nothing is parallel yet.

    python 01_cifar10_cpu.py                         # ResNet-18; downloads CIFAR-10 into ./data
    python 01_cifar10_cpu.py --arch cnn --epochs 3   # small network: minutes on a laptop
    python 01_cifar10_cpu.py --resume auto           # continue from the newest checkpoint
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

STEP = "01_cifar10_cpu"
MOMENTUM, WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1
LOG_EVERY = 20  # steps between progress-bar loss updates


# ----------------------------------------------------------------------------- argument parsing
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Step 01: CIFAR-10 on the CPU (the baseline).")
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
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- process/device setup
def setup(args):
    torch.manual_seed(args.seed)
    return torch.device("cpu")


# ----------------------------------------------------------------------------- data
def build_data(args):
    data.prepare_cifar10(args.data_dir)  # downloads unless a cifar-10-batches-py folder is there
    train_set, test_set = data.cifar10_datasets(args.data_dir, seed=args.seed)
    # Shuffle with our own generator, re-seeded every epoch: a resumed run sees the same batches.
    shuffle = torch.Generator()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=RandomSampler(train_set, generator=shuffle),
                              num_workers=args.workers, persistent_workers=args.workers > 0, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=512, num_workers=args.workers)
    if len(train_loader) == 0:
        raise UserError(f"--batch-size {args.batch_size} is larger than the {len(train_set)} training images")
    return train_loader, test_loader, shuffle


# ----------------------------------------------------------------------------- model
def build_model(args, device):
    return models.build_model(args.arch).to(device)


# ----------------------------------------------------------------------------- optimizer and schedule
def build_optimizer(args, model, steps_per_epoch):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.epochs * steps_per_epoch, WARMUP_EPOCHS * steps_per_epoch))
    return optimizer, scheduler


# ----------------------------------------------------------------------------- train one epoch
def train_one_epoch(model, loader, optimizer, scheduler, device, epoch):
    model.train()
    loss_sum = torch.zeros((), device=device)
    seen = 0
    bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=not sys.stderr.isatty())
    start = time.perf_counter()
    for step, (images, labels) in enumerate(bar):
        images, labels = images.to(device), labels.to(device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
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
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = model(images).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, row, synthetic):
    return checkpoint.save(args.out_dir, step=STEP, arch=args.arch, epoch=epoch, global_step=global_step,
                           model_state=model.state_dict(), optimizer=optimizer, scheduler=scheduler,
                           args=args, metrics=row, synthetic=synthetic)


def resume(args, model, optimizer, scheduler):
    state = checkpoint.find_resume(args.resume, args.out_dir, args.arch)
    if state is None:
        if args.resume == "auto":
            print(f"no checkpoint in {args.out_dir}: starting from scratch")
        return 0, 0
    epoch, global_step = checkpoint.restore(state, model=model, optimizer=optimizer, scheduler=scheduler)
    print(f"resumed from epoch {epoch} (written by {state['step']})")
    return epoch, global_step


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    device = setup(args)
    checkpoint.make_out_dir(args.out_dir)
    train_loader, test_loader, shuffle = build_data(args)
    synthetic = data.is_synthetic(args.data_dir)
    model = build_model(args, device)
    optimizer, scheduler = build_optimizer(args, model, len(train_loader))
    start_epoch, global_step = resume(args, model, optimizer, scheduler)
    log = metrics.MetricsLog(args.out_dir, start_epoch, synthetic)
    print(f"{STEP}: {args.arch} on {device}, batch {args.batch_size}, {len(train_loader.dataset)} training images, "
          f"{len(train_loader)} steps/epoch" + ("  [SYNTHETIC DATA, not CIFAR-10]" if synthetic else ""))

    for epoch in range(start_epoch + 1, args.epochs + 1):
        shuffle.manual_seed(args.seed + epoch)
        train_loader.dataset.set_epoch(epoch)
        row = {"epoch": epoch, **train_one_epoch(model, train_loader, optimizer, scheduler, device, epoch)}
        global_step += len(train_loader)
        row.update(evaluate(model, test_loader, device))
        save_checkpoint(args, epoch, global_step, model, optimizer, scheduler, row, synthetic)
        print(metrics.epoch_line(log.append(row), args.epochs), flush=True)
        if args.stop_after and epoch - start_epoch >= args.stop_after and epoch < args.epochs:
            print(f"stopping after {args.stop_after} epoch(s) as asked; continue with --resume auto")
            break

    metrics.plot(args.out_dir, f"{STEP} ({args.arch})")
    checkpoint.write_digest(args.out_dir, 0, model.state_dict())


if __name__ == "__main__":
    main()
