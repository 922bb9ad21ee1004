"""CIFAR-10 through torchvision, kept in memory as uint8 tensors.

* `prepare_cifar10(data_dir)` makes sure the data is on disk: an existing `cifar-10-batches-py`
  folder is used as it is (also generated or re-packed copies, whose MD5 sums differ from the
  official ones); otherwise torchvision downloads the archive and checks its MD5.
* `cifar10_datasets(data_dir, seed)` reads it with torchvision's CIFAR10 class and returns two
  `CIFAR10Tensors` data sets that yield (uint8 image [3, 32, 32], label).

The standard augmentation (random crop with 4 px zero padding, horizontal flip) runs on uint8
tensors in the data set, so loading never waits on PIL. Its randomness is a hash of
(seed, epoch, sample index): every sample gets the same crop in a given epoch whatever the number
of processes, the batch size or the worker count. That is what makes a resumed run, or a run on
two processes, follow exactly the same path as an uninterrupted single-process run.
Normalisation happens inside the model (see models.Normalize), on the device.
"""
import contextlib
import os
import pickle
import shutil
import socket
import tempfile

import torch
import torch.nn.functional as F

from .cli import UserError
from ._torchvision import CIFAR10

FOLDER = "cifar-10-batches-py"
FILES = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
         "test_batch", "batches.meta"]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
OFFICIAL_URL = CIFAR10.url


class _CIFAR10Folder(CIFAR10):
    """torchvision's CIFAR10, but a folder already on disk is trusted as it is.

    torchvision checks the MD5 of every batch file, which rejects generated or re-packed copies.
    A fresh download is still checked: download_and_extract_archive verifies the archive's MD5.
    """

    meta = {**CIFAR10.meta, "md5": None}  # check_integrity(path, None) only asks that the file exists

    def _check_integrity(self):
        return all(os.path.isfile(os.path.join(self.root, FOLDER, name)) for name in FILES)


def _missing_files(data_dir):
    return [name for name in FILES if not os.path.isfile(os.path.join(data_dir, FOLDER, name))]


def _remedies(data_dir):
    return (f"either put the official CIFAR-10 python version ({OFFICIAL_URL}) unpacked into "
            f"{data_dir} (so that {os.path.join(data_dir, FOLDER, 'data_batch_1')} exists), or "
            f"generate a small synthetic stand-in with: python -m common.synthetic --data-dir {data_dir}")


def prepare_cifar10(data_dir, download=True):
    """Make sure CIFAR-10 is in data_dir, downloading it if allowed. Raises UserError otherwise."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} is a file, not a folder: pass the folder that holds {FOLDER}/")
    missing = _missing_files(data_dir)
    if not missing:
        return
    if os.path.isdir(os.path.join(data_dir, FOLDER)) or not download:
        raise UserError(f"CIFAR-10 is incomplete in {data_dir} (missing {', '.join(missing)}): " + _remedies(data_dir))
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)  # a firewall that drops packets fails the download instead of hanging it
    private = None
    try:
        os.makedirs(data_dir, exist_ok=True)
        # Into a folder of this process's own, then renamed into place in one step: processes on other machines that
        # share data_dir (one per node downloads) never see a half-extracted folder, and the first rename wins.
        private = tempfile.mkdtemp(prefix=".download-", dir=data_dir)
        _CIFAR10Folder(private, train=True, download=True)
        with contextlib.suppress(OSError):  # the target exists: another process was first (with the same files)
            os.rename(os.path.join(private, FOLDER), os.path.join(data_dir, FOLDER))
    except PermissionError as error:
        raise UserError(f"cannot write to --data-dir {data_dir} ({error.strerror}): pick a writable folder") from None
    except Exception as error:  # urllib, socket and ssl errors all mean "could not download"
        raise UserError(f"CIFAR-10 is not in {data_dir} and downloading it failed "
                        f"({type(error).__name__}: {error}): " + _remedies(data_dir)) from None
    finally:
        socket.setdefaulttimeout(previous_timeout)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def is_synthetic(data_dir):
    """True for data written by common.synthetic (its batches.meta says so)."""
    with open(os.path.join(data_dir, FOLDER, "batches.meta"), "rb") as f:
        meta = pickle.load(f, encoding="latin1")
    return bool(meta.get("synthetic", False))


def _mix64(x):
    """splitmix64 finaliser: a cheap, well-spread hash of a 64-bit integer."""
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


class CIFAR10Tensors(torch.utils.data.Dataset):
    """CIFAR-10 as uint8 tensors; with `train=True` every item is randomly cropped and flipped."""

    def __init__(self, images, labels, train, seed=0):
        self.images = images  # uint8 [N, 3, 32, 32]
        self.labels = labels  # int64 [N]
        self.train = train
        self.seed = seed
        # Shared memory, so that DataLoader workers (also persistent ones) see set_epoch().
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        """Choose this epoch's augmentation. Call before iterating, like DistributedSampler.set_epoch."""
        self._epoch.fill_(epoch)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.train:
            key = _mix64(_mix64(_mix64(self.seed) ^ int(self._epoch)) ^ index)
            top, left, flip = key % 9, (key // 9) % 9, (key // 81) % 2
            image = F.pad(image, (4, 4, 4, 4))[:, top:top + 32, left:left + 32]
            if flip:
                image = image.flip(-1)
        return image, self.labels[index]


def _unreadable(data_dir, train):
    """The first batch file of the split that does not unpickle to a dict (None if all do)."""
    for name in ["batches.meta", *(FILES[:5] if train else ["test_batch"])]:
        path = os.path.join(data_dir, FOLDER, name)
        try:
            with open(path, "rb") as f:
                if not isinstance(pickle.load(f, encoding="latin1"), dict):
                    return path
        except Exception:
            return path
    return None


def _read_split(data_dir, train):
    try:
        dataset = _CIFAR10Folder(data_dir, train=train, download=False)
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, OSError,
            RuntimeError) as error:
        where = _unreadable(data_dir, train) or os.path.join(data_dir, FOLDER)
        raise UserError(f"cannot read CIFAR-10 in {where} ({type(error).__name__}: {error}); the file is damaged "
                        "or not CIFAR-10: " + _remedies(data_dir)) from None
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    labels = torch.tensor(dataset.targets, dtype=torch.int64)
    if len(labels) != len(images) or len(labels) == 0 or labels.min() < 0 or labels.max() >= len(CLASSES):
        raise UserError(f"CIFAR-10 in {data_dir} has {len(images)} images, {len(labels)} labels, "
                        "or labels outside 0-9: " + _remedies(data_dir))
    return images, labels


def cifar10_datasets(data_dir, seed=0):
    """Read CIFAR-10 (already prepared) into memory: (train set with augmentation, test set)."""
    prepare_cifar10(data_dir, download=False)
    train_images, train_labels = _read_split(data_dir, train=True)
    test_images, test_labels = _read_split(data_dir, train=False)
    return (CIFAR10Tensors(train_images, train_labels, train=True, seed=seed),
            CIFAR10Tensors(test_images, test_labels, train=False))
