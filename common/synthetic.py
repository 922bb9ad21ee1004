"""Write a small, learnable stand-in for CIFAR-10 in the real on-disk format.

    python -m common.synthetic --data-dir data/synthetic [--train-size 5000 --test-size 1000]

It writes `cifar-10-batches-py/` (data_batch_1..5, test_batch, batches.meta) exactly as the
official python version lays it out: pickled dicts with `data` (uint8, N x 3072, channel-major),
`labels`, and `label_names` in batches.meta. The training scripts read it with torchvision's
CIFAR10 class like the real thing. batches.meta also carries `synthetic: True`, so every run on
it says that its numbers are not CIFAR-10 numbers.

Each class is a noisy image with its own colour tint and stripe orientation: a network learns it
in an epoch or two, which is what tests and offline smoke runs need.
"""
import argparse
import math
import os
import pickle

import torch

from .cli import exits_cleanly, non_negative_int, positive_int, UserError
from .data import CLASSES, FOLDER


def make_images(count, seed):
    """(uint8 [count, 3, 32, 32], labels [count]) with balanced, shuffled classes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % len(CLASSES)
    labels = labels[torch.randperm(count, generator=g)]
    tint = torch.rand(len(CLASSES), 3, 1, 1, generator=torch.Generator().manual_seed(1234)) * 120 + 40
    angle = torch.arange(len(CLASSES)) * math.pi / len(CLASSES)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    phase = torch.rand(count, 1, 1, generator=g) * 2 * math.pi
    a = angle[labels].view(-1, 1, 1)
    stripes = torch.sin((xx * torch.cos(a) + yy * torch.sin(a)) * 0.8 + phase)  # [count, 32, 32]
    noise = torch.randn(count, 3, 32, 32, generator=g) * 45
    images = tint[labels] + 50 * stripes.unsqueeze(1) + noise
    return images.clamp(0, 255).to(torch.uint8), labels


def _write_batch(path, images, labels, name):
    batch = {"batch_label": name, "labels": labels.tolist(),
             "data": images.reshape(len(images), -1).numpy(),
             "filenames": [f"synthetic_{i:05d}.png" for i in range(len(labels))]}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def write_synthetic_cifar10(data_dir, train_size=5000, test_size=1000, seed=0):
    folder = os.path.join(data_dir, FOLDER)
    os.makedirs(folder, exist_ok=True)
    images, labels = make_images(train_size + test_size, seed)
    train_images, train_labels = images[:train_size], labels[:train_size]
    for i, part in enumerate(torch.arange(train_size).tensor_split(5), start=1):
        _write_batch(os.path.join(folder, f"data_batch_{i}"), train_images[part], train_labels[part],
                     f"training batch {i} of 5 (SYNTHETIC)")
    _write_batch(os.path.join(folder, "test_batch"), images[train_size:], labels[train_size:],
                 "testing batch 1 of 1 (SYNTHETIC)")
    meta = {"label_names": CLASSES, "num_cases_per_batch": math.ceil(train_size / 5), "num_vis": 3072,
            "synthetic": True}
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump(meta, f, protocol=2)
    with open(os.path.join(folder, "README.txt"), "w") as f:
        f.write("SYNTHETIC stand-in for CIFAR-10 written by `python -m common.synthetic`; "
                "not real images. Accuracy on it says nothing about CIFAR-10.\n")
    return folder


@exits_cleanly
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data/synthetic", help="where to write cifar-10-batches-py/")
    parser.add_argument("--train-size", type=positive_int, default=5000, help="training images (default 5000)")
    parser.add_argument("--test-size", type=positive_int, default=1000, help="test images (default 1000)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    args = parser.parse_args(argv)
    if args.train_size < 5:
        raise UserError("--train-size must be at least 5 (one image per data_batch file)")
    if os.path.isfile(os.path.join(args.data_dir, FOLDER, "data_batch_1")):
        from .data import is_synthetic
        if not is_synthetic(args.data_dir):
            raise UserError(f"{args.data_dir} holds real CIFAR-10; refusing to overwrite it: pick another --data-dir")
    try:
        folder = write_synthetic_cifar10(args.data_dir, args.train_size, args.test_size, args.seed)
    except OSError as error:
        raise UserError(f"cannot write to {args.data_dir}: {error.strerror}") from None
    print(f"wrote SYNTHETIC CIFAR-10 ({args.train_size} train / {args.test_size} test images) to {folder}")
    print(f"train on it with e.g.: python 01_cifar10_cpu.py --data-dir {args.data_dir} --arch cnn --epochs 3")


if __name__ == "__main__":
    main()
