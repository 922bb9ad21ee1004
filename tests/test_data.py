"""The data path: generated data in CIFAR-10's real format, read by torchvision's CIFAR10 class."""
import math
import pickle

import pytest
import torch

from common import data
from common.cli import UserError
from common.data import CIFAR10
from synthetic import make_images, write_synthetic_cifar10


def test_generated_folder_has_the_official_layout(cifar_dir):
    folder = cifar_dir / data.FOLDER
    assert sorted(p.name for p in folder.iterdir() if p.name != "README.txt") == sorted(data.FILES)
    with open(folder / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    assert batch["data"].dtype.name == "uint8" and batch["data"].shape[1] == 3072
    with open(folder / "batches.meta", "rb") as f:
        assert pickle.load(f)["label_names"] == data.CLASSES
    # torchvision's own class refuses it (MD5 sums), ours reads it: that is the one difference.
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR10(str(cifar_dir), train=True)


def test_datasets_read_through_torchvision(cifar_dir):
    train, test, info = data.cifar10(cifar_dir)
    image, label = test[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32) and 0 <= int(label) < 10
    assert (len(train) == 1280 and len(test) == 301
            and info == data.Info(10, data.MEAN, data.STD, synthetic=True, shape=(3, 32, 32),
                                  unit="images"))


def test_augmentation_depends_only_on_seed_epoch_and_index(cifar_dir):
    train, _, _ = data.cifar10(cifar_dir, seed=3)
    other, _, _ = data.cifar10(cifar_dir, seed=3)
    train.set_epoch(1), other.set_epoch(1)
    assert all(torch.equal(train[i][0], other[i][0]) for i in (5, 0, 77))  # any order, any process
    first = torch.stack([train[i][0] for i in range(64)])
    train.set_epoch(2)
    # a new epoch, new crops
    assert not torch.equal(first, torch.stack([train[i][0] for i in range(64)]))


def nearest_mean_accuracy(features, labels, train=2000):
    """Accuracy on the rest of a classifier that picks the class whose mean feature (over the first
    `train`) is nearest: what a cheap feature alone can do."""
    means = torch.stack([features[:train][labels[:train] == c].mean(0) for c in range(10)])
    return (torch.cdist(features[train:], means).argmin(1) == labels[train:]).float().mean().item()


def test_textures_hide_the_class_from_cheap_features():
    images, labels = make_images(3000, seed=0)
    assert nearest_mean_accuracy(images.float().mean((2, 3)), labels) < 0.15  # mean colour: chance
    assert nearest_mean_accuracy(images[:, :, 16, 16].float(), labels) < 0.15  # one pixel: chance
    easy, easy_labels = make_images(3000, seed=0, kind="easy")
    # the check can see a cheap feature
    assert nearest_mean_accuracy(easy.float().mean((2, 3)), easy_labels) > 0.5


def test_missing_data_names_both_remedies(tmp_path):
    with pytest.raises(UserError, match="scripts/synthetic.py") as error:
        data.download(str(tmp_path / "nothing"), fetch=False)
    assert "cifar-10-python.tar.gz" in str(error.value)


def test_truncated_batch_is_one_clear_error(tmp_path):
    write_synthetic_cifar10(str(tmp_path), train_size=50, test_size=10)
    batch = tmp_path / data.FOLDER / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:200])
    with pytest.raises(UserError,
                       match=f"cannot read CIFAR-10 in {batch} .*damaged or not CIFAR-10"):
        data.cifar10(str(tmp_path))


def test_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        data.download(str(tmp_path / "f"))


# A download as torchvision's CIFAR10 does it (download_and_extract_archive into its root). With a
# third argument it stops half-way (batches.meta not yet there) until that file exists.
SLOW_DOWNLOAD = """
import os, sys, time
from common import data
sys.path.insert(0, "scripts")
import synthetic
import torchvision.datasets.cifar

def download_and_extract_archive(url, root, filename=None, md5=None):
    folder = synthetic.write_synthetic_cifar10(root, train_size=50, test_size=10)
    if len(sys.argv) > 2:
        os.rename(os.path.join(folder, "batches.meta"), os.path.join(root, "meta.part"))
        open(sys.argv[2] + ".half-way", "w").close()
        for _ in range(600):
            if os.path.exists(sys.argv[2]):
                break
            time.sleep(0.1)
        os.rename(os.path.join(root, "meta.part"), os.path.join(folder, "batches.meta"))

torchvision.datasets.cifar.download_and_extract_archive = download_and_extract_archive
data.download(sys.argv[1])
print(sorted(os.listdir(sys.argv[1])), [name for name in data.FILES
                                       if not os.path.isfile(os.path.join(sys.argv[1], data.FOLDER, name))])
"""  # noqa: E501 (a script of its own: its lines as written)


def test_two_machines_downloading_into_one_shared_folder_both_succeed(tmp_path):
    """Local rank 0 of every node downloads (step 04's barrier is per node); on a shared file system
    they write into the same --data-dir at the same time. Each downloads into a folder of its own
    and renames it into place: the second never sees the first's half-written folder, and the folder
    ends complete, with no leftovers."""
    import subprocess
    import sys
    import time

    from helpers import REPO, env

    shared, go = tmp_path / "shared", tmp_path / "go"

    def start(*hold):
        return subprocess.Popen([sys.executable, "-c", SLOW_DOWNLOAD, str(shared), *map(str, hold)],
                                cwd=REPO, env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first = start(go)  # holds half-way through its files until `go` exists
    while not (tmp_path / "go.half-way").exists():
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.02)
    second = start()
    outputs = [second.communicate(timeout=120)[0]]
    go.touch()
    outputs.insert(0, first.communicate(timeout=120)[0])
    assert [first.returncode, second.returncode] == [0, 0], outputs
    # nothing missing, for either
    assert all(output.strip().endswith("] []") for output in outputs), outputs
    assert sorted(p.name for p in shared.iterdir()) == ["cifar-10-batches-py"], (
        "no download folder left behind")
    assert len(data.cifar10(str(shared))[0]) == 50


def test_importing_any_part_of_common_makes_torchvision_importable():
    """With a CPU-only torch, the registry's torchvision dies on import (pytorch/vision#9085).
    Importing anything of common first (common.cli here, which reads no data) applies the
    work-around, as a template copy relies on."""
    import subprocess
    import sys

    from helpers import REPO, env

    code = ("import common.cli, torchvision, torchvision.models; "
            "print(torchvision.models.resnet18(num_classes=5).fc)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "out_features=5" in proc.stdout, proc.stderr


def test_importing_common_imports_torchvision_and_changes_nothing_else():
    """`import common` (outside the test harness's speed-ups) imports torchvision and leaves torch
    as it was: its register_fake back in place, no object frozen out of the garbage collector
    (tests/test_style.py: no stand-in modules, no private exits)."""
    import subprocess
    import sys

    from helpers import REPO, env

    code = ("import gc, sys, torch; real = torch.library.register_fake; import common; "
            "print('torchvision' in sys.modules, torch.library.register_fake is real, "
            "gc.get_freeze_count())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(PYTHONPATH=REPO),
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True", "0"], (
        proc.stdout + proc.stderr)


@pytest.mark.parametrize("size, world", [
    (523_265, 2), (1_046_529, 4), (1025, 2), (1025, 3), (301, 2), (9, 4), (5000, 4), (10000, 3),
    (512, 1), (513, 1), (1, 1), (4, 4), (1024, 2), (1026, 2), (2049, 4), (7, 3)])
def test_every_rank_evaluates_every_image_once_in_as_many_batches_as_every_other(size, world):
    """Under ZeRO-3 (05) and FSDP (08) every forward is collective: a rank with one test batch more
    would wait alone. 1,025 images on 2 ranks are shards of 513 and 512: 2 batches each, not 2
    and 1. (On the CPU DeepSpeed 0.19.8 did not hang even so, docs/05-deepspeed.md; a GPU may.)"""
    ranks = [data.eval_batches(size, rank, world) for rank in range(world)]
    counts = {len(batches) for batches in ranks}
    assert len(counts) == 1, (size, world, counts)
    seen = [index for batches in ranks for batch in batches for index in batch]
    assert sorted(seen) == list(range(size)), "every image, once"
    for rank, batches in enumerate(ranks):
        sizes = [len(batch) for batch in batches]
        assert 0 < min(sizes) and max(sizes) <= 512 and max(sizes) - min(sizes) <= 1, sizes
        # the rank's own shard, in order, in contiguous runs
        assert [i for batch in batches for i in batch] == list(range(rank, size, world))
    # no more batches than the largest shard needs
    largest = len(range(0, size, world))
    assert counts == {math.ceil(largest / 512)}, (size, world, counts)


def test_eval_batches_honour_a_smaller_most_and_refuse_a_rank_without_an_image():
    batches = [data.eval_batches(21, rank, 2, most=4) for rank in range(2)]
    assert [[len(b) for b in rank] for rank in batches] == [[4, 4, 3], [4, 3, 3]]
    with pytest.raises(UserError, match="3 test samples cannot give each of the 4 processes one"):
        data.eval_batches(3, 3, 4)


def test_every_distributed_step_evaluates_in_eval_batches():
    """The steps whose ranks evaluate a shard each (04-08) build their test loaders from
    eval_batches (the test above holds it to its promise)."""
    from helpers import REPO

    for number in range(4, 9):
        path = next(REPO.glob(f"{number:02d}_*.py"))
        assert "data.eval_batches(" in path.read_text(), path.name


def epoch(size, step, world=1, rank=0, epoch=1, part=None):
    """Rank `rank`'s EpochSampler over `size` images in steps of `step`: (sampler, the indices its
    epoch yields, the whole shard the DistributedSampler gives)."""
    order = torch.utils.data.DistributedSampler(range(size), num_replicas=world, rank=rank, seed=0)
    sampler = data.EpochSampler(order, step)
    skipped = sampler.set_epoch(epoch, part)
    order.set_epoch(epoch)
    return sampler, skipped, list(sampler), list(order)


@pytest.mark.parametrize("size, step, steps", [(160, 4, 40), (161, 4, 41), (163, 4, 41),
                                               (3, 4, 1), (1280, 96, 14), (50000, 384, 131)])
def test_an_epoch_trains_every_image_of_the_shard_once_in_a_smaller_last_step(size, step, steps):
    sampler, skipped, got, shard = epoch(size, step)
    assert skipped == 0 and sampler.steps == steps and got == shard and len(sampler) == size
    assert sorted(got) == list(range(size)), "every image, once"


def test_every_rank_trains_its_whole_shard_in_as_many_steps():
    """1,281 images on 2 ranks: DistributedSampler's shards of 641 (one image repeated to even
    them), 11 steps of 64, the last of 1."""
    shards = [epoch(1281, 64, world=2, rank=rank) for rank in range(2)]
    assert [s.steps for s, *_ in shards] == [11, 11]
    assert all(got == shard and len(got) == 641 for _, _, got, shard in shards)
    assert set(shards[0][2]) | set(shards[1][2]) == set(range(1281))


@pytest.mark.parametrize("part, skipped", [({"steps": 10, "of_steps": 20}, 20),
                                           ({"steps": 1, "of_steps": 3}, 14),
                                           ({"steps": 19, "of_steps": 20}, 39),
                                           ({"steps": 20, "of_steps": 20}, 40)])
def test_a_resumed_part_way_epoch_yields_exactly_the_indices_after_the_skipped_steps(part,
                                                                                     skipped):
    """163 images in steps of 4: 41 steps, the last of 3. A stop after a fraction of the epoch (in
    any batch arithmetic) goes on after as many of the 41 steps (half: round(20.5), 20); a stop
    at its end leaves the last step to do, never an empty epoch."""
    sampler, done, got, shard = epoch(163, 4, part=part)
    assert done == skipped and got == shard[4 * skipped:] and len(sampler) == len(got) > 0


def test_drop_last_leaves_out_the_short_last_step_and_skips_by_whole_steps():
    """163 samples in steps of 4 with --drop-last: 40 whole steps, the last 3 samples of the epoch's
    order left out (other ones each epoch); resumed after 10 steps, the 30 steps after them."""
    order = torch.utils.data.DistributedSampler(range(163), num_replicas=1, rank=0, seed=0)
    sampler = data.EpochSampler(order, 4, drop_last=True)
    sampler.set_epoch(1)
    shard = list(order)
    assert sampler.steps == 40 and list(sampler) == shard[:160] and len(sampler) == 160
    skipped = sampler.set_epoch(1, {"steps": 10, "of_steps": 40})
    assert skipped == 10 and list(sampler) == shard[40:160] and len(sampler) == 120


def test_an_empty_shard_is_one_clear_error():
    with pytest.raises(UserError, match="^no training step for this process: ") as error:
        data.EpochSampler(torch.utils.data.DistributedSampler(range(0), num_replicas=1, rank=0),
                          4)
    assert "\n" not in str(error.value)
