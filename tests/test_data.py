"""The data path: generated data in CIFAR-10's real format, read by torchvision's CIFAR10 class."""
import pickle

import pytest
import torch

from common import data
from common._torchvision import CIFAR10
from common.cli import UserError
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
            and info == data.Info(10, data.MEAN, data.STD, synthetic=True))


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


def test_importing_common_leaves_torchdynamo_unloaded_and_compile_working():
    """torchvision's import would load all of TorchDynamo (1 s of every process);
    common/_torchvision.py defers it, and the function torchvision took from it, torch.compile and
    torch._dynamo itself still work."""
    import subprocess
    import sys

    from helpers import REPO, env

    code = ("import sys, torch, common; assert 'torch._dynamo' not in sys.modules, 'loaded'; "
            "assert sys.modules['torchvision.ops.roi_align'].is_compile_supported('cpu'); "
            "f = torch.compile(lambda x: x * 2 + 1, backend='eager'); "
            "print(f(torch.ones(2)).tolist(), "
            "torch._dynamo.utils.is_compile_supported('cpu'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["[3.0,", "3.0]", "True"], (
        proc.stdout + proc.stderr)
