"""CIFAR-10 read by torchvision's CIFAR10 class into memory as uint8 tensors, and every step's
training sampler. A `cifar-10-batches-py` folder in --data-dir is used as it is (a generated copy
too); download() fetches the official archive (MD5 checked) where there is none. The augmentation (a
random crop with 4 px zero padding, a horizontal flip) runs on uint8 tensors, its randomness a hash
of (seed, epoch, index): a sample gets the same crop in an epoch whatever the processes, batch size
or workers, so a resumed or two-process run follows one uninterrupted process exactly."""
import contextlib
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import typing
from multiprocessing import resource_tracker

import torch
import torch.nn.functional as F
from torchvision.datasets import CIFAR10

from .cli import UserError

FOLDER = "cifar-10-batches-py"
FILES = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
         "test_batch", "batches.meta"]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # per channel, 0-1 scale


class Info(typing.NamedTuple):
    """What build_data says of its data, for build_model and the run's lines: the classes; mean and
    std per channel (0-1) for our models; synthetic: outputs say so; the shape of one input (an
    image's (channels, height, width), a row's (features,), a sequence's (tokens,)); what a sample
    is called in the outputs."""
    num_classes: int
    mean: tuple = None
    std: tuple = None
    synthetic: bool = False
    shape: tuple = None
    unit: str = "samples"


def layout(batch, args):
    """The layout a batch moves to the device in: channels-last (NHWC) for a batch of images (4-D)
    with --channels-last, else the plain one (rows of features and token ids have no channels)."""
    if args.channels_last and batch.dim() == 4:
        return torch.channels_last
    return torch.contiguous_format


class _CIFAR10Folder(CIFAR10):
    """torchvision's CIFAR10, trusting a folder already on disk: its MD5 check rejects generated
    copies, and it has no switch to skip it, so each file's MD5 is None (check_integrity(path,
    None) asks only that the file exists). A download is still checked, by the archive's MD5."""
    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


def _remedies(data_dir):  # what to do about data that is not there or not readable
    first = os.path.join(data_dir, FOLDER, "data_batch_1")
    return (f"either put the official CIFAR-10 python version ({CIFAR10.url}) unpacked into "
            f"{data_dir} (so that {first} exists), or generate a small synthetic stand-in with: "
            f"python scripts/synthetic.py --data-dir {data_dir}")


def download(data_dir, fetch=True):
    """Make sure CIFAR-10 is in data_dir, downloading it if allowed (fetch).
    Raises UserError otherwise."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} is a file, not a folder: "
                        f"pass the folder that holds {FOLDER}/")
    missing = [name for name in FILES if not os.path.isfile(os.path.join(data_dir, FOLDER, name))]
    if not missing:
        return
    if os.path.isdir(os.path.join(data_dir, FOLDER)) or not fetch:
        raise UserError(f"CIFAR-10 is incomplete in {data_dir} (missing {', '.join(missing)}): "
                        + _remedies(data_dir))
    timeout, private = socket.getdefaulttimeout(), None
    # A firewall that drops packets fails the download instead of hanging it.
    socket.setdefaulttimeout(60)
    try:
        os.makedirs(data_dir, exist_ok=True)
        # Into a folder of this process's own, renamed into place in one step: processes on other
        # machines that share data_dir (one per node downloads) never see a half-extracted folder,
        # and the first rename wins.
        private = tempfile.mkdtemp(prefix=".download-", dir=data_dir)
        _CIFAR10Folder(private, train=True, download=True)
        # OSError: the target exists, as another process was first (with the same files).
        with contextlib.suppress(OSError):
            os.rename(os.path.join(private, FOLDER), os.path.join(data_dir, FOLDER))
    except PermissionError as error:
        raise UserError(f"cannot write to --data-dir {data_dir} ({error.strerror}): "
                        "pick a writable folder") from None
    except Exception as error:  # urllib, socket and ssl errors all mean "could not download"
        raise UserError(f"CIFAR-10 is not in {data_dir} and downloading it failed "
                        f"({type(error).__name__}: {error}): " + _remedies(data_dir)) from None
    finally:
        socket.setdefaulttimeout(timeout)
        if private:
            shutil.rmtree(private, ignore_errors=True)


def _mix64(x):
    """splitmix64's finaliser: a cheap, well-spread hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & (2**64 - 1)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * factor) & (2**64 - 1)
    return x ^ (x >> 31)


class CIFAR10Tensors(torch.utils.data.Dataset):
    """Images (uint8 [N, 3, 32, 32]) and labels; with train=True every item is randomly cropped and
    flipped, by set_epoch()'s epoch (in shared memory: DataLoader workers, persistent ones too, see
    it)."""

    def __init__(self, images, labels, train, seed=0):
        self.images, self.labels, self.train, self.seed = images, labels, train, seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self._epoch.fill_(epoch)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.train:
            key = _mix64(_mix64(_mix64(self.seed) ^ int(self._epoch)) ^ index)
            top, left = key % 9, (key // 9) % 9
            image = F.pad(image, (4, 4, 4, 4))[:, top:top + 32, left:left + 32]
            image = image.flip(-1) if (key // 81) % 2 else image
        return image, self.labels[index]


def _read_split(data_dir, train):
    try:
        dataset = _CIFAR10Folder(data_dir, train=train, download=False)
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, OSError,
            RuntimeError) as error:
        where = os.path.join(data_dir, FOLDER)
        # `where`: the first file that is no pickled dict.
        for name in ["batches.meta", *(FILES[:5] if train else ["test_batch"])]:
            with contextlib.suppress(Exception), open(os.path.join(where, name), "rb") as f:
                if isinstance(pickle.load(f, encoding="latin1"), dict):
                    continue
            where = os.path.join(where, name)
            break
        raise UserError(f"cannot read CIFAR-10 in {where} ({type(error).__name__}: {error}); the "
                        "file is damaged or not CIFAR-10: " + _remedies(data_dir)) from None
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    labels = torch.tensor(dataset.targets, dtype=torch.int64)
    if (len(labels) != len(images) or len(labels) == 0 or labels.min() < 0
            or labels.max() >= len(CLASSES)):
        raise UserError(f"CIFAR-10 in {data_dir} has {len(images)} images, {len(labels)} labels, "
                        "or labels outside 0-9: " + _remedies(data_dir))
    return images, labels


def cifar10(data_dir, seed=0):
    """CIFAR-10 (downloaded already) in memory: (train set with augmentation, test set, Info)."""
    download(data_dir, fetch=False)
    # These read and check batches.meta too.
    train, test = _read_split(data_dir, train=True), _read_split(data_dir, train=False)
    with open(os.path.join(data_dir, FOLDER, "batches.meta"), "rb") as f:
        # scripts/synthetic.py's data says so.
        synthetic = bool(pickle.load(f, encoding="latin1").get("synthetic"))
    return (CIFAR10Tensors(*train, train=True, seed=seed), CIFAR10Tensors(*test, train=False),
            Info(num_classes=len(CLASSES), mean=MEAN, std=STD, synthetic=synthetic,
                 shape=tuple(train[0].shape[1:]), unit="images"))


class EpochSampler(torch.utils.data.Sampler):
    """Every index `sampler` (a DistributedSampler) gives for an epoch, in optimizer steps of
    `step_size` indices (batch x accumulation; the last smaller where the shard is not a multiple,
    or left out with drop_last: then up to step_size - 1 samples of each shard, other ones each
    epoch, are not trained in it); after a stop part-way, only those after the steps done, none of
    them loaded (accelerate's skip_first_batches, for a loader). set_epoch() also tells the data
    set (ours: its crops)."""

    def __init__(self, sampler, step_size, drop_last=False):
        self.sampler, self.step_size, self.skip = sampler, step_size, 0
        whole, rest = divmod(len(sampler), step_size)
        self.steps, self.dropped = whole + (rest > 0), 0
        if drop_last:
            self.steps, self.dropped = whole, rest
        if not self.steps:
            total = len(getattr(sampler, "dataset", ()))
            raise UserError(f"no training step for this process: its shard of the {total} "
                            f"training samples holds {len(sampler)}, less than one optimizer "
                            f"step ({step_size}) with --drop-last, or none; give every process "
                            "more (more samples, fewer processes, a smaller batch)")

    def set_epoch(self, epoch, part=None):
        """Epoch `epoch`, after the steps `part` did (steps_done). Returns how many it skips."""
        self.sampler.set_epoch(epoch)
        getattr(self.sampler.dataset, "set_epoch", lambda epoch: None)(epoch)
        done = self.steps_done(part)
        self.skip = done * self.step_size
        return done

    def steps_done(self, part):
        """The steps of this run that `part`, the metrics row a run stopped in the epoch saved
        ("steps" done of "of_steps", its batch arithmetic), stands for: the same share of it."""
        done = round(part["steps"] * self.steps / part["of_steps"]) if part else 0
        return min(done, self.steps - 1)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, len(self.sampler) - self.dropped)

    def __len__(self):
        return len(self.sampler) - self.skip - self.dropped


def workers_from_a_forkserver(*preload):
    """This process's DataLoader workers start from a forkserver (no threads; torch, common and
    `preload` imported once), not as forks of it. A gloo thread takes Python's runtime lock to free
    a tensor that Python let go of before the collective's work ended (all_gather_object's, seen
    in gdb); a worker forked then stops before its first line (CPython 3.11) and its rank waits for
    ever. Python 3.14 makes forkserver the default. The data sets reach the workers pickled."""
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["common", *preload])
    # Its resource tracker, started now: starting one unblocks SIGTERM here, and the workers must
    # inherit this thread's mask (preempt.py blocks SIGTERM and SIGUSR1 for them).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def eval_batches(size, rank, world, most=512):
    """The evaluation batches of rank `rank` of `world` (for a DataLoader's batch_sampler=): its
    shard range(rank, size, world) of a test set of `size` images, unpadded, in contiguous runs of
    at most `most` indices. Every rank gets exactly as many batches as every other (their sizes
    within a rank differing by at most one): under ZeRO-3 or FSDP every forward is collective, and
    a rank with one batch more would wait alone for the others."""
    if most < 2:
        # With batches of 1, shards of unequal size cannot have as many batches.
        raise ValueError(f"eval_batches needs most >= 2, not {most}")
    if size < world:
        raise UserError(f"{size} test samples cannot give each of the {world} processes one: "
                        "use more test samples or fewer processes")
    shard = range(rank, size, world)
    # The batches of the largest shard; a shard is at most one image smaller, so it fills as many.
    largest, extra = divmod(size, world)
    largest += extra > 0
    count, rest = divmod(largest, most)
    count += rest > 0
    base, longer = divmod(len(shard), count)
    batches, start = [], 0
    for number in range(count):
        end = start + base + (number < longer)
        batches.append(list(shard[start:end]))
        start = end
    return batches
