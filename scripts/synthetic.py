"""A learnable CIFAR-10 stand-in in its on-disk format: `python scripts/synthetic.py --data-dir D`.

It writes `cifar-10-batches-py/` as the official python version lays it out (pickled dicts with
`data`, uint8, N x 3072, channel-major, `labels`, and `label_names` in batches.meta), which the
steps read with torchvision's CIFAR10 class; batches.meta also says `synthetic: True`, so that every
run on it says its numbers are not CIFAR-10's.
textures (default): each class a stripe pattern (orientation, frequency) in a random colour on a
random background, under noise, with a contrast from barely visible to strong: no cheap feature
(mean colour, one pixel) tells the class; the small cnn needs 2-3 epochs (batch 64, lr 0.1) to pass
80%. --easy: each class also has a colour tint of its own, solved in an epoch or two, for tests of
mechanics.
"""
import argparse
import math
import os
import pickle
import sys
from pathlib import Path

import torch

# `common` lives at the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import exits_cleanly, non_negative_int, positive_int, UserError  # noqa: E402
from common.data import CLASSES, FOLDER  # noqa: E402


def make_images(count, seed, kind="textures"):
    """(uint8 [count, 3, 32, 32], labels [count]) with balanced, shuffled classes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % len(CLASSES)
    labels = labels[torch.randperm(count, generator=g)]
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    if kind == "easy":  # a colour tint per class: the mean colour alone separates them
        fixed = torch.Generator().manual_seed(1234)
        tint = torch.rand(len(CLASSES), 3, 1, 1, generator=fixed) * 120 + 40
        angle = (torch.arange(len(CLASSES)) * math.pi / len(CLASSES))[labels].view(-1, 1, 1)
        phase = torch.rand(count, 1, 1, generator=g) * 2 * math.pi
        stripes = torch.sin((xx * torch.cos(angle) + yy * torch.sin(angle)) * 0.8 + phase)
        noise = torch.randn(count, 3, 32, 32, generator=g) * 45
        images = tint[labels] + 50 * stripes.unsqueeze(1) + noise
        return images.clamp(0, 255).to(torch.uint8), labels
    # textures: class = (stripe pattern, frequency). Patterns are symmetric under the horizontal
    # flip of the augmentation: vertical, horizontal, and the pairs +-30, +-60 and 0+90 degrees laid
    # over each other.
    patterns = [(0,), (90,), (30, 150), (60, 120), (0, 90)]
    # Radians per pixel.
    frequency = torch.tensor([0.7, 1.4]).repeat_interleave(5)[labels].view(-1, 1, 1)
    wave = torch.zeros(count, 32, 32)
    for c in range(len(CLASSES)):
        members = (labels == c).nonzero().flatten()
        for degrees in patterns[c % 5]:
            jitter = (torch.rand(len(members), 1, 1, generator=g) - 0.5) * 0.2
            angle = math.radians(degrees) + jitter
            phase = torch.rand(len(members), 1, 1, generator=g) * 2 * math.pi
            along = xx * torch.cos(angle) + yy * torch.sin(angle)
            wave[members] += (torch.sin(along * frequency[members] + phase)
                              / len(patterns[c % 5]) ** 0.5)
    # Background, stripe colour and contrast are random per image, so neither the mean colour nor
    # any one pixel tells the class; the contrast ranges from barely visible to strong, so accuracy
    # climbs gradually.
    background = torch.rand(count, 3, 1, 1, generator=g) * 120 + 60
    colour = torch.randn(count, 3, 1, 1, generator=g)
    colour = colour / colour.norm(dim=1, keepdim=True)
    contrast = torch.rand(count, 1, 1, 1, generator=g) * 140 + 14
    noise = torch.randn(count, 3, 32, 32, generator=g) * 20
    images = background + contrast * colour * wave.unsqueeze(1) + noise
    return images.clamp(0, 255).to(torch.uint8), labels


def _write_batch(path, images, labels, name):
    batch = {"batch_label": name, "labels": labels.tolist(),
             "data": images.reshape(len(images), -1).numpy(),
             "filenames": [f"synthetic_{i:05d}.png" for i in range(len(labels))]}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def write_synthetic_cifar10(data_dir, train_size=5000, test_size=1000, seed=0, kind="textures"):
    folder = os.path.join(data_dir, FOLDER)
    os.makedirs(folder, exist_ok=True)
    images, labels = make_images(train_size + test_size, seed, kind)
    train_images, train_labels = images[:train_size], labels[:train_size]
    for i, part in enumerate(torch.arange(train_size).tensor_split(5), start=1):
        _write_batch(os.path.join(folder, f"data_batch_{i}"), train_images[part],
                     train_labels[part], f"training batch {i} of 5 (SYNTHETIC)")
    _write_batch(os.path.join(folder, "test_batch"), images[train_size:], labels[train_size:],
                 "testing batch 1 of 1 (SYNTHETIC)")
    meta = {"label_names": CLASSES, "num_cases_per_batch": math.ceil(train_size / 5),
            "num_vis": 3072, "synthetic": True}
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump(meta, f, protocol=2)
    with open(os.path.join(folder, "README.txt"), "w") as f:
        f.write("SYNTHETIC stand-in for CIFAR-10 written by `python scripts/synthetic.py`; "
                "not real images. Accuracy on it says nothing about CIFAR-10.\n")
    return folder


@exits_cleanly
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data/synthetic",
                        help="where to write cifar-10-batches-py/")
    parser.add_argument("--train-size", type=positive_int, default=5000,
                        help="training images (default 5000)")
    parser.add_argument("--test-size", type=positive_int, default=1000,
                        help="test images (default 1000)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--easy", dest="kind", action="store_const", const="easy",
                        default="textures", help="classes with their own colour tint, solved in an "
                        "epoch or two (default: textures)")
    args = parser.parse_args(argv)
    if args.train_size < 5:
        raise UserError("--train-size must be at least 5 (one image per data_batch file)")
    if os.path.isfile(os.path.join(args.data_dir, FOLDER, "data_batch_1")):
        with open(os.path.join(args.data_dir, FOLDER, "batches.meta"), "rb") as f:
            real = not pickle.load(f, encoding="latin1").get("synthetic")
        if real:
            raise UserError(f"{args.data_dir} holds real CIFAR-10; refusing to overwrite it: "
                            "pick another --data-dir")
    try:
        folder = write_synthetic_cifar10(args.data_dir, args.train_size, args.test_size, args.seed,
                                         args.kind)
    except OSError as error:
        raise UserError(f"cannot write to {args.data_dir}: {error.strerror}") from None
    print(f"wrote SYNTHETIC CIFAR-10 ({args.kind}, {args.train_size} train / {args.test_size} test "
          f"images) to {folder}")
    print(f"train on it with e.g.: python 01_cifar10_cpu.py --data-dir {args.data_dir} "
          "--arch cnn --epochs 3")


if __name__ == "__main__":
    main()
