"""A step copied as the template of one's own job, as the README's "Use a step as a template" says:
the step and the folder common/, and build_data and build_model replaced by an ImageFolder of PNG
images (5 classes) and a model of one's own or torchvision's resnet18(num_classes=5). Nothing else
of the copy changes, and the copy trains, resumes exactly and labels its outputs with its own name.

* 04's copy: 2 processes under torchrun, stopped after epoch 1 and resumed, ends bit-identical to an
  uninterrupted run; it learns. 01's copy learns under plain python, and torchvision's resnet18
  registers in its ARCHS as it is.
* The copy's diff against its step stays under 30 changed lines: the two functions, ARCHS and an
  import.
"""
import re
import shutil
import subprocess

import pytest

from helpers import BIN, PYTHON, REPO, digests, free_port, load_checkpoint, metrics, run, script

README = (REPO / "README.md").read_text()
CLASSES = 5
MAX_CHANGED = 30

# What a user writes: their data and their models. The rest of the copy is the step as it is.
USER_DATA = '''def build_data(args):
    """Folders of PNG images, one folder per class, under train/ and test/."""
    to_tensor = torchvision.transforms.ToTensor()  # float images in [0, 1]
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data_dir, "train"), to_tensor)
    test_set = torchvision.datasets.ImageFolder(os.path.join(args.data_dir, "test"), to_tensor)
    return train_set, test_set, data.Info(num_classes=len(train_set.classes))
'''
USER_MODEL = '''def tiny(num_classes):
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, num_classes))


ARCHS = {"tiny": tiny, "resnet18": torchvision.models.resnet18}  # --arch choices (the first is the default)


def build_model(args, info):
    return ARCHS[args.arch](num_classes=info.num_classes)
'''  # noqa: E501 (what a user writes, as written)


def test_the_readme_says_to_copy_the_step_and_common():
    section = README.split("## Use a step as a template")[1].split("\n## ")[0]
    assert "Copy the step and the folder `common/`" in section and "`build_data(args)`" in section \
        and "`build_model(args, info)`" in section


def copy_as_template(number, folder, name):
    """The copy a user makes: the step and common/, then build_data, ARCHS and build_model of their
    own. Returns the script's path and its changed lines against the step (as
    `diff | grep -c '^[<>]'` counts them)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "common", folder / "common",
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = (REPO / script(number)).read_text()
    source = re.sub(r"def build_data\(args\):\n.*?\n\n\n", USER_DATA + "\n\n", source, count=1,
                    flags=re.S)
    source = re.sub(r"ARCHS = \{.*?\n\n\ndef build_model\(args, info\):\n.*?\n\n\n",
                    USER_MODEL + "\n\n", source, count=1, flags=re.S)
    source = re.sub(r"(\nfrom common\.cli import [^\n]*\n)",
                    r"\1import torchvision  # after common (see README)\n", source, count=1)
    if "import torch.nn as nn" not in source:
        source = source.replace("import torch.nn.functional as F\n",
                                "import torch.nn as nn\nimport torch.nn.functional as F\n")
    target = folder / f"{name}.py"
    target.write_text(source)
    diff = subprocess.run(["diff", REPO / script(number), target], stdout=subprocess.PIPE,
                          text=True).stdout
    return target, sum(line.startswith(("<", ">")) for line in diff.splitlines())


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """train/ and test/ folders of 32x32 PNG images, one folder per class: a colour per class, under
    noise."""
    import torch
    from PIL import Image

    root = tmp_path_factory.mktemp("pngs")
    generator = torch.Generator().manual_seed(0)
    colours = torch.rand(CLASSES, 3, 1, 1, generator=generator) * 160 + 40
    for split, count in (("train", 32), ("test", 6)):
        for label in range(CLASSES):
            (root / split / f"class{label}").mkdir(parents=True)
            for i in range(count):
                image = (colours[label]
                         + torch.randn(3, 32, 32, generator=generator) * 40).clamp(0, 255)
                Image.fromarray(image.to(torch.uint8).permute(1, 2, 0).numpy()).save(
                    root / split / f"class{label}" / f"{i}.png")
    return root


TRAIN = ["--epochs", "2", "--batch-size", "8", "--workers", "0", "--amp", "off", "--lr", "0.2"]


def test_a_copy_of_04_with_its_own_data_and_model_trains_and_resumes_exactly(pngs, tmp_path):
    target, changed = copy_as_template(4, tmp_path / "job", "my_job")
    assert changed < MAX_CHANGED, f"the copy differs from 04 in {changed} lines"

    def torchrun(out, *extra):
        return run([BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}",
                    target, "--data-dir", pngs, *TRAIN, "--out-dir", out, *extra],
                   PYTHONPATH=target.parent)

    whole = torchrun(tmp_path / "whole")
    assert ("my_job: tiny on 2 x cpu" in whole.output
            and "SYNTHETIC" not in whole.output), whole.output
    first, *_, last = metrics(tmp_path / "whole")
    assert (last["train_loss"] < first["train_loss"]
            and last["test_acc"] > 2 / CLASSES), (first, last)
    state = load_checkpoint(tmp_path / "whole" / "checkpoint-epoch0002.pt")
    assert (state["step"], state["arch"], state["synthetic"]) == ("my_job", "tiny", False)
    # a launch of its own: the copy's epochs repeat bit for bit
    torchrun(tmp_path / "resumed", "--stop-after", "1")
    resumed = torchrun(tmp_path / "resumed", "--resume", "auto")
    assert "resumed from epoch 1 (written by my_job)" in resumed.output
    assert (digests(tmp_path / "resumed") == digests(tmp_path / "whole")
            and sorted(digests(tmp_path / "whole")) == [0, 1])


def test_a_copy_of_01_trains_under_plain_python(pngs, tmp_path):
    target, changed = copy_as_template(1, tmp_path / "job", "train")
    assert changed < MAX_CHANGED, f"the copy differs from 01 in {changed} lines"
    run([PYTHON, target, "--data-dir", pngs, *TRAIN, "--out-dir", tmp_path / "out"],
        PYTHONPATH=target.parent)
    first, *_, last = metrics(tmp_path / "out")
    assert (last["train_loss"] < first["train_loss"]
            and last["test_acc"] > 2 / CLASSES), (first, last)
    # torchvision's, as it is
    other = run([PYTHON, target, "--data-dir", pngs, *TRAIN, "--arch", "resnet18", "--epochs", "1",
                 "--out-dir", tmp_path / "resnet"], PYTHONPATH=target.parent)
    assert ("train: resnet18 on cpu" in other.output
            and metrics(tmp_path / "resnet")[0]["epoch"] == 1), other.output


@pytest.mark.parametrize("number", range(1, 9))
def test_only_the_two_functions_know_the_data_is_cifar10(number):
    """Outside build_data and build_model (and ARCHS) no line of a step mentions CIFAR-10; the
    scripts' own file names (0N_cifar10_*.py, in usage lines) are just names."""
    source = (REPO / script(number)).read_text()
    seam = re.findall(r"\ndef build_data\(args\):\n.*?\n\n\n"
                      r"|\nARCHS = .*?\n\n\ndef build_model\(.*?\n\n\n", source, re.S)
    assert len(seam) == 2, "build_data, and ARCHS with build_model, in that form"
    for part in seam:
        source = source.replace(part, "\n")
    mentions = [line for line in source.splitlines()
                if re.search("cifar", re.sub(r"\d\d_cifar10_\w+\.py", "", line), re.I)]
    assert not mentions, mentions


def test_our_models_take_uint8_images_and_refuse_float_ones_in_one_line():
    import torch

    from common import data, models
    from common.cli import UserError

    model = models.cnn(num_classes=3, mean=data.MEAN, std=data.STD)
    assert model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)).shape == (2, 3)
    with pytest.raises(UserError, match="normalises uint8 images itself but got torch.float32"):
        model(torch.rand(2, 3, 32, 32))
