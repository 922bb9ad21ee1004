"""A step copied as the template of one's own job, as the README's "Use a step as a template" says:
the step and the folder common/ (05: and ds_config.json), with build_data, ARCHS and build_model
replaced by a user's own. The user's data: a torch Dataset class of their own, 1-channel 28x28
float images in [0, 1], 7 classes, 982 training samples (491 per rank: the last optimizer step of
an epoch is short, a single pass of 11 images) and 257 test images. The user's model: a small
ConvNet whose blocks (convolution, batch norm, ReLU, pooling) sit in an nn.ModuleList, and a linear
head; their build_model draws each rank's initial weights from a seed of its own, so a step that
does not start every rank from rank 0's weights trains replicas (or slices) of different models.
Nothing else of a copy changes (the user imports what their code needs: torchvision, and torch.nn
where the step does not). The copies of 04 (torchrun), 05 (the deepspeed launcher) and 08
(torchrun), on 2 processes each:

* learn (test accuracy far above chance after 2 epochs), train every image once per epoch
  (metrics.jsonl's "images") and end with the same weights on every rank;
* label their outputs with their own file name and --arch;
* stopped after epoch 1 (whose last optimizer step is the short one) and resumed, each ends bit for
  bit where an uninterrupted run ends, with the same losses: 04's and 08's copies in fp32 (NCHW)
  where one uninterrupted run of 04's copy ends (the resumes are exact, and the two methods agree
  on the user's model: 08 finds its FSDP units inside the ModuleList and starts from rank 0's
  weights); 05's copy as the README runs it (--amp auto: bf16 on a CPU that computes it, ZeRO
  stage 2 from ds_config.json), where its own uninterrupted run ends: the user's float batches go
  in the engine's precision. (05 in fp32 is held to 04's bits in tests/test_preemption.py.)

The copies of every other step, each run once for 2 epochs in fp32 (NCHW), learn in the same way
and end bit for bit where their neighbour's copy does: 01, 02 and 03 (one process each) where 01's
copy does; 06 (horovodrun) and 07 (torch.distributed.launch), on 2 processes, where 04's copy does.

05's copy also carries the checks of the README's 05 command: only the script's own lines, its
engine folder made by scripts/ds_to_pt.py a .pt of the fp32 master weights whose digest every rank
wrote, and its engine checkpoint refused in one line by one process. Fourteen launches in all.
torchvision's constructors fit ARCHS as they are (checked in this process).
"""
import re
import runpy
import shutil

import pytest
import torch

from helpers import (PYTHON, REPO, as_after_epoch, assert_one_line_error, converted, digests,
                     launch_command, load_checkpoint, metrics, run, script)

README = (REPO / "README.md").read_text()
# An even count: DistributedSampler evens an odd one out by repeating an image (982 trained of 981).
CLASSES, TRAIN, TEST = 7, 982, 257
# What a user writes: their data and their models, in place of the step's build_data, and of its
# ARCHS and build_model. The rest of the copy is the step as it is.
USER_DATA = '''class Strokes(torch.utils.data.Dataset):
    """My images: {"images": float [N, 1, 28, 28] in [0, 1], "labels": int [N]} in one file."""

    def __init__(self, path):
        saved = torch.load(path)
        self.images, self.labels = saved["images"], saved["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


def build_data(args):
    train_set = Strokes(os.path.join(args.data_dir, "train.pt"))
    test_set = Strokes(os.path.join(args.data_dir, "test.pt"))
    return train_set, test_set, data.Info(num_classes=7)
'''
USER_MODEL = '''class ConvNet(nn.Module):
    """Blocks of convolution, batch norm, ReLU and pooling (28 -> 7), then a linear head."""

    def __init__(self, num_classes, widths=(1, 8, 16)):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(),
                          nn.MaxPool2d(2))
            for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1] * 7 * 7, num_classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


ARCHS = {"convnet": ConvNet, "resnet18": torchvision.models.resnet18}


def build_model(args, info):
    torch.manual_seed(args.seed + int(os.environ.get("RANK", "0")))
    return ARCHS[args.arch](num_classes=info.num_classes)
'''
# Import torchvision after common, as the README says.
USER_IMPORTS = ["import torchvision"]
# ... and nn, for their ConvNet, where the step does not import it already (01, 02).
NN = "import torch.nn as nn"
# The copies: (file name, launcher)
JOBS = {1: ("my_cpu", "python"), 2: ("my_gpu", "python"), 3: ("my_dataparallel", "python"),
        4: ("my_ddp", "torchrun"), 5: ("my_deepspeed", "deepspeed"),
        6: ("my_horovod", "horovodrun"), 7: ("my_apex", "legacy"), 8: ("my_fsdp", "torchrun")}
# 16 images x 2 passes per optimizer step. On 2 processes: 491 images per rank, 16 optimizer steps
# per epoch, the last of them one pass of 11 images; on 1: 31 steps, the last of 22 images.
STEPS = {1: 31, 2: 16}
SMALL = ["--epochs", "2", "--batch-size", "16", "--grad-accum", "2", "--workers", "0"]
# fp32, NCHW: 04's bits
EXACT = [*SMALL, "--amp", "off", "--no-channels-last"]


def test_the_readme_says_to_copy_the_step_and_common():
    section = README.split("## Use a step as a template")[1].split("\n## ")[0]
    assert "Copy the step and the folder `common/`" in section and "`build_data(args)`" in section \
        and "`build_model(args, info)`" in section


def seam(source):
    """The step's build_data, and its ARCHS with build_model: what a user replaces."""
    found = re.findall(r"\ndef build_data\(args\):\n.*?\n\n\n"
                       r"|\nARCHS = .*?\n\n\ndef build_model\(.*?\n\n\n", source, re.S)
    assert len(found) == 2, "build_data, and ARCHS with build_model, in that form"
    return found


@pytest.mark.parametrize("number", range(1, 9))
def test_only_the_two_functions_know_the_data_is_cifar10(number):
    """Outside build_data and build_model (and ARCHS) no line of a step mentions CIFAR-10; the
    scripts' own file names (0N_cifar10_*.py, in usage lines) are just names."""
    source = (REPO / script(number)).read_text()
    for part in seam(source):
        source = source.replace(part, "\n")
    mentions = [line for line in source.splitlines()
                if re.search("cifar", re.sub(r"\d\d_cifar10_\w+\.py", "", line), re.I)]
    assert not mentions, mentions


def test_our_models_take_uint8_images_and_refuse_float_ones_in_one_line():
    from common import data, models
    from common.cli import UserError

    model = models.cnn(num_classes=3, mean=data.MEAN, std=data.STD)
    assert model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)).shape == (2, 3)
    with pytest.raises(UserError, match="normalises uint8 images itself but got torch.float32"):
        model(torch.rand(2, 3, 32, 32))


def user_imports(step_source):
    """The import lines the user's code needs that the step has not."""
    return [*USER_IMPORTS, *([NN] if f"\n{NN}\n" not in step_source else [])]


def copy_as_template(number, folder, user=(USER_DATA, USER_MODEL)):
    """The copy a user makes: the step and common/ (05: and ds_config.json, which its README command
    names), then build_data, ARCHS and build_model of their own (`user`), and torchvision
    imported."""
    name, _ = JOBS[number]
    folder.mkdir(parents=True)
    shutil.copytree(REPO / "common", folder / "common",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if number == 5:
        shutil.copy(REPO / "ds_config.json", folder)
    source = (REPO / script(number)).read_text()
    functions, models = seam(source)
    source = source.replace(functions, "\n" + user[0] + "\n\n").replace(
        models, "\n" + user[1] + "\n\n")
    imports = "".join(f"{line}\n" for line in user_imports(source))
    source = re.sub(r"(\nfrom common\.cli import [^\n]*\n)", rf"\1{imports}", source, count=1)
    (folder / f"{name}.py").write_text(source)
    return folder / f"{name}.py"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{step: its copy}, each in a folder of its own."""
    root = tmp_path_factory.mktemp("jobs")
    return {number: copy_as_template(number, root / f"{number:02d}") for number in JOBS}


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    """train.pt and test.pt as the user's Strokes class reads them: a 7x7 grid of random brightness
    per class, blown up to 28x28, under uniform noise; random labels."""
    folder = tmp_path_factory.mktemp("strokes")
    generator = torch.Generator().manual_seed(0)
    patterns = torch.rand(CLASSES, 1, 7, 7, generator=generator)
    patterns = patterns.repeat_interleave(4, 2).repeat_interleave(4, 3)
    for split, count in (("train", TRAIN), ("test", TEST)):
        labels = torch.randint(0, CLASSES, (count,), generator=generator)
        images = 0.4 * patterns[labels] + 0.6 * torch.rand(count, 1, 28, 28, generator=generator)
        torch.save({"images": images, "labels": labels}, folder / f"{split}.pt")
    return folder


def launch(number, jobs, user_data, out, *flags):
    """The copy of step `number` on 2 processes, launched as the README launches the step (05:
    `deepspeed -q ... --deepspeed_config ds_config.json`, DS_ACCELERATOR=cpu), its own folder on
    PYTHONPATH (its common/)."""
    target = jobs[number]
    command = launch_command(JOBS[number][1], processes(number), number)
    command[command.index(script(number))] = target
    extra = {}
    if number == 5:
        command = [command[0], "-q", *command[1:], "--deepspeed_config",
                   target.parent / "ds_config.json"]
        extra = {"DS_ACCELERATOR": "cpu"}
    return run([*command, "--data-dir", user_data, *flags, "--out-dir", out],
               PYTHONPATH=target.parent, **extra)


def processes(number):
    """01-03 run as one process, the others on 2."""
    return 1 if JOBS[number][1] == "python" else 2


def saved_epoch_2(out):
    """What a copy saved of epoch 2: its checkpoint-epoch0002.pt, or 05's or 08's position.json
    beside the library's files (05 and 08 write no .pt)."""
    from common import checkpoint

    for folder in (checkpoint.ENGINE_DIR, checkpoint.DCP_DIR):
        if (out / folder).is_dir():
            return checkpoint.own_header(str(out / folder / "epoch0002"))
    return load_checkpoint(out / "checkpoint-epoch0002.pt")


def assert_learned_every_image(out, name, output, world=2):
    """The outcome of any copy's 2 epochs: labelled with its name, every training image once per
    epoch, far above chance (1/7), the same weights on every rank."""
    where = "cpu" if world == 1 else f"{world} x cpu"
    assert f"{name}: convnet on {where}, " in output and "SYNTHETIC" not in output, output
    assert f"{TRAIN} training samples, {STEPS[world]} steps/epoch" in output, output
    rows = metrics(out)
    assert [row["epoch"] for row in rows] == [1, 2]
    assert [(row["images"], row["steps"]) for row in rows] == [(TRAIN, STEPS[world])] * 2, rows
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["test_acc"] > 0.6, rows
    state = saved_epoch_2(out)
    assert (state["step"], state["arch"], state["synthetic"]) == (name, "convnet", False)
    found = digests(out)
    assert sorted(found) == list(range(world)) and len(set(found.values())) == 1, found


@pytest.fixture(scope="module")
def reference(jobs, user_data, tmp_path_factory):
    """04's copy, uninterrupted, in fp32: where the stopped and resumed copies of 04 and 08 end."""
    out = tmp_path_factory.mktemp("reference04")
    return out, launch(4, jobs, user_data, out, *EXACT).output


@pytest.fixture(scope="module")
def copy05(jobs, user_data, tmp_path_factory):
    """05's copy, uninterrupted, as the README runs it: where its stopped and resumed copy ends."""
    out = tmp_path_factory.mktemp("copy05")
    return out, launch(5, jobs, user_data, out, *SMALL).output


def test_a_copy_changes_only_the_users_functions_and_takes_torchvision_models(jobs):
    for number, target in jobs.items():
        step, copy = (REPO / script(number)).read_text(), target.read_text()
        for part in seam(step):
            step = step.replace(part, "\n")
        copy = copy.replace(USER_DATA, "").replace(USER_MODEL, "")
        for line in user_imports(step):
            copy = copy.replace(f"{line}\n", "", 1)
        assert copy.split() == step.split(), f"the copy of {number:02d} changed more"
    # torchvision's resnet18 as it is; the first of ARCHS is the default.
    from common import data

    copy04 = runpy.run_path(str(jobs[4]), run_name="my_ddp")
    assert copy04["parse_args"]([]).arch == "convnet"
    model = copy04["build_model"](copy04["parse_args"](["--arch", "resnet18"]),
                                  data.Info(num_classes=CLASSES))
    assert type(model).__name__ == "ResNet" and model.fc.out_features == CLASSES


def test_a_copy_of_04_learns_the_users_data_from_every_image(reference):
    out, output = reference
    assert_learned_every_image(out, "my_ddp", output)


@pytest.fixture(scope="module")
def copy01(jobs, user_data, tmp_path_factory):
    """01's copy in fp32 (NCHW): where the copies of 02 and 03 end on a CPU."""
    out = tmp_path_factory.mktemp("copy01")
    return out, launch(1, jobs, user_data, out, *EXACT).output


@pytest.mark.parametrize("number", [1, 2, 3, 6, 7],
                         ids=["01-cpu", "02-gpu", "03-dataparallel", "06-horovod", "07-apex"])
def test_a_copy_of_every_other_step_learns_and_ends_where_its_neighbour_does(
        number, jobs, user_data, request, tmp_path):
    """Once, uninterrupted, in fp32: 01's copy learns; 02's and 03's end bit for bit where it does;
    06's and 07's where 04's copy does (each starts every rank from rank 0's weights)."""
    if number == 6:
        pytest.importorskip("horovod.torch",
                            reason="Horovod not built (scripts/install_horovod.sh)")
    out, output = request.getfixturevalue("copy01")
    if number != 1:
        out = tmp_path
        output = launch(number, jobs, user_data, out, *EXACT).output
    assert_learned_every_image(out, JOBS[number][0], output, processes(number))
    kin = {1: "copy01", 2: "copy01", 3: "copy01", 6: "reference", 7: "reference"}[number]
    assert set(digests(out).values()) == set(digests(request.getfixturevalue(kin)[0]).values())


@pytest.mark.parametrize("number", [4, 5, 8], ids=["04-ddp", "05-deepspeed", "08-fsdp"])
def test_a_copy_stopped_and_resumed_ends_where_an_uninterrupted_run_does(number, jobs, user_data,
                                                                         request, tmp_path):
    name, flags, fixture = JOBS[number][0], EXACT, "reference"
    if number == 5:
        flags, fixture = SMALL, "copy05"
    reference = request.getfixturevalue(fixture)
    first = launch(number, jobs, user_data, tmp_path, *flags, "--stop-after", "1")
    resumed = launch(number, jobs, user_data, tmp_path, *flags, "--resume", "auto")
    assert f"resumed from epoch 1 (written by {name})" in resumed.output, resumed.output
    assert_learned_every_image(tmp_path, name, first.output)
    assert digests(tmp_path) == digests(reference[0])
    for got, want in zip(metrics(tmp_path), metrics(reference[0]), strict=True):
        assert (got["test_loss"], got["test_acc"]) == (want["test_loss"], want["test_acc"])
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-9)


# What 05's copy prints of its own (the rest would be DeepSpeed's noise).
OURS05 = ("no GPU found", "my_deepspeed:", "epoch ", "resumed from", "DeepSpeed config: {")


def test_a_copy_of_05_trains_float_images_quietly_in_the_engines_precision(copy05, tmp_path):
    """The README's command as it is: --amp auto (bf16 on a CPU that computes it natively, else
    fp32), channels-last, ZeRO stage 2 (ds_config.json), `deepspeed -q` with DS_ACCELERATOR=cpu:
    only the script's own lines, from rank 0; its engine folder, made a .pt by scripts/ds_to_pt.py,
    holds the fp32 master weights, whose digest every rank wrote."""
    from common.checkpoint import weights_digest
    from common.cli import amp_dtype

    out, output = copy05
    auto = "bf16" if amp_dtype("auto", torch.device("cpu")) else "off"
    assert f"ZeRO stage 2, amp {auto} (auto: " in output, output
    assert_learned_every_image(out, "my_deepspeed", output)
    assert output.count("epoch   2/2") == 1, "only rank 0 logs"
    noise = [line for line in output.splitlines() if line.strip() and not line.startswith(OURS05)]
    assert not noise, "DeepSpeed noise in the training log:\n" + "\n".join(noise)
    assert not list(out.glob("*.pt")), "05 writes no .pt"
    state = load_checkpoint(converted(out / "ds_checkpoints" / "epoch0002", tmp_path))
    floats = {t.dtype for t in state["model"].values() if t.is_floating_point()}
    assert state["optimizer"] is None and floats == {torch.float32}, floats
    assert weights_digest(state["model"]) == digests(out)[0]
    assert (out / "ds_checkpoints" / "latest").read_text().strip() == "epoch0002"


def test_a_copy_of_05s_engine_checkpoint_of_2_processes_is_refused_by_1_with_the_way_that_works(
        copy05, jobs, tmp_path):
    """05's copy as --stop-after 1 would have left it, resumed on one process: DeepSpeed cannot take
    two processes' ZeRO shards, so the line names the way that works (weights only), once."""
    as_after_epoch(copy05[0], tmp_path, 1)
    alone = run([PYTHON, jobs[5], "--out-dir", tmp_path,
                 # the engine's folder: the settings come from its position.json
                 "--resume", tmp_path / "ds_checkpoints"],
                check=False, DS_ACCELERATOR="cpu", PYTHONPATH=jobs[5].parent)
    folder = tmp_path / "ds_checkpoints" / "epoch0001"
    assert_one_line_error(alone, "holds the optimizer state of 2 processes, this run has 1",
                          f"`python scripts/ds_to_pt.py {folder}`")
    assert alone.output.count("note: the checkpoint's run had 2 processes (global batch 64), "
                              "this one has 1 (global batch 32)") == 1, alone.output


# Jobs of other shapes, copied into 01 and 04-08 and run with the default flags (--amp auto: bf16
# where the CPU computes it natively; --channels-last, which 2-D batches pass by): rows of raw
# features (values in the hundreds) into an MLP with batch norm, and token ids (int64) into an
# embedding. Each sizes its model from data.Info.shape.
ROWS_DATA = '''class Rows(torch.utils.data.Dataset):
    """My table: {"features": float [N, F], "labels": int [N]} in one file."""

    def __init__(self, path):
        saved = torch.load(path)
        self.features, self.labels = saved["features"], saved["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.features[index], int(self.labels[index])


def build_data(args):
    train_set = Rows(os.path.join(args.data_dir, "train.pt"))
    test_set = Rows(os.path.join(args.data_dir, "test.pt"))
    return train_set, test_set, data.Info(num_classes=3, shape=train_set.features.shape[1:])
'''
ROWS_MODEL = '''class MLP(nn.Module):
    def __init__(self, features, num_classes, width=32):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, width), nn.BatchNorm1d(width), nn.ReLU(),
                                    nn.Linear(width, num_classes))

    def forward(self, x):
        return self.layers(x)


ARCHS = {"mlp": MLP}


def build_model(args, info):
    return ARCHS[args.arch](info.shape[0], info.num_classes)
'''
TOKENS_DATA = '''class Sequences(torch.utils.data.Dataset):
    """My sequences: {"tokens": int64 [N, T], "labels": int [N]} in one file."""

    def __init__(self, path):
        saved = torch.load(path)
        self.tokens, self.labels = saved["tokens"], saved["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.tokens[index], int(self.labels[index])


def build_data(args):
    train_set = Sequences(os.path.join(args.data_dir, "train.pt"))
    test_set = Sequences(os.path.join(args.data_dir, "test.pt"))
    return train_set, test_set, data.Info(num_classes=4, shape=train_set.tokens.shape[1:])
'''
TOKENS_MODEL = '''class TokenBag(nn.Module):
    """Each token's embedding, then a linear head over the whole sequence."""

    def __init__(self, length, num_classes, vocabulary=64, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(length * width, num_classes)

    def forward(self, tokens):
        return self.head(self.embed(tokens).flatten(1))


ARCHS = {"bag": TokenBag}


def build_model(args, info):
    return ARCHS[args.arch](info.shape[0], info.num_classes)
'''
# kind: (the user's data, their model, its --arch, classes)
SHAPES = {"rows": (ROWS_DATA, ROWS_MODEL, "mlp", 3),
          "tokens": (TOKENS_DATA, TOKENS_MODEL, "bag", 4)}
# 196 samples per rank in batches of 16: 13 steps an epoch, the last of 4 samples (batch norm
# takes it); one process: 25 steps, the last of 8.
SHAPED_TRAIN, SHAPED_TEST, SHAPED_STEPS = 392, 99, {1: 25, 2: 13}
DEFAULTS = ["--epochs", "2", "--batch-size", "16", "--workers", "0"]


def shaped_samples(kind, count, generator):
    """(inputs, labels) of `kind`: rows of 20 raw features around a centre per class (values in
    the hundreds), or 12 token ids of which 6, at random places, are two of the class's own."""
    classes = SHAPES[kind][3]
    labels = torch.randint(0, classes, (count,), generator=generator)
    if kind == "rows":
        centres = torch.randn(classes, 20, generator=torch.Generator().manual_seed(1))
        noise = torch.randn(count, 20, generator=generator)
        return 500 + 100 * (centres[labels] + noise), labels
    tokens = torch.randint(0, 64 - 2 * classes, (count, 12), generator=generator)
    places = torch.rand(count, 12, generator=generator).argsort(1)[:, :6]
    own = 64 - 2 * classes + 2 * labels[:, None] + torch.randint(0, 2, (count, 6),
                                                                  generator=generator)
    return tokens.scatter(1, places, own), labels


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """{kind: ({step: its copy}, its data folder)}: the user's files and copies of 01, 04-08."""
    root, found = tmp_path_factory.mktemp("shaped"), {}
    for kind, (user_data_code, user_model, _, _) in SHAPES.items():
        generator, folder = torch.Generator().manual_seed(0), root / kind / "data"
        folder.mkdir(parents=True)
        for split, count in (("train", SHAPED_TRAIN), ("test", SHAPED_TEST)):
            inputs, labels = shaped_samples(kind, count, generator)
            key = "features" if kind == "rows" else "tokens"
            torch.save({key: inputs, "labels": labels}, folder / f"{split}.pt")
        copies = {number: copy_as_template(number, root / kind / f"{number:02d}",
                                           (user_data_code, user_model))
                  for number in (1, 4, 5, 6, 7, 8)}
        found[kind] = copies, folder
    return found


@pytest.fixture(scope="module")
def shaped_runs(shaped, tmp_path_factory):
    """runs(kind, step) -> (out-dir, output) of its copy's uninterrupted run, made once."""
    made = {}

    def runs(kind, number):
        if (kind, number) not in made:
            out = tmp_path_factory.mktemp(f"{kind}{number:02d}")
            copies, folder = shaped[kind]
            made[kind, number] = out, launch(number, copies, folder, out, *DEFAULTS,
                                             "--arch", SHAPES[kind][2]).output
        return made[kind, number]
    return runs


def assert_learned_every_sample(out, kind, name, output, world):
    """A shaped copy's 2 epochs: every sample trained each epoch in whole steps, far above chance,
    the same state on every rank."""
    assert f"{SHAPED_TRAIN} training samples, {SHAPED_STEPS[world]} steps/epoch" in output, output
    assert re.search(r"epoch +2/2 .* \d+ samples/s", output), output
    rows = metrics(out)
    assert [(row["images"], row["steps"]) for row in rows] == [
        (SHAPED_TRAIN, SHAPED_STEPS[world])] * 2, rows
    chance = 1 / SHAPES[kind][3]
    assert rows[-1]["test_acc"] > 2 * chance and rows[-1]["train_loss"] < rows[0]["train_loss"], (
        kind, rows)
    assert saved_epoch_2(out)["step"] == name
    found = digests(out)
    assert sorted(found) == list(range(world)) and len(set(found.values())) == 1, found


# Both jobs through 01 and every distributed step.
SHAPED_RUNS = [(kind, number) for kind in sorted(SHAPES) for number in (1, 4, 5, 6, 7, 8)]


@pytest.mark.parametrize("kind,number", SHAPED_RUNS, ids=[f"{k}-{n}" for k, n in SHAPED_RUNS])
def test_a_copy_trains_rows_and_token_ids_with_the_default_flags(kind, number, shaped_runs):
    """Rows and token ids, 2-D batches, through every step's loop with the default flags: learned
    from every sample, equal ranks; 06's and 07's copies end where 04's does (the same loop)."""
    if number == 6:
        pytest.importorskip("horovod.torch",
                            reason="Horovod not built (scripts/install_horovod.sh)")
    out, output = shaped_runs(kind, number)
    assert_learned_every_sample(out, kind, JOBS[number][0], output, processes(number))
    if number in (6, 7):
        assert digests(out) == digests(shaped_runs(kind, 4)[0])


@pytest.mark.parametrize("number", [5, 8], ids=["05-deepspeed", "08-fsdp"])
def test_a_rows_copy_stopped_and_resumed_ends_where_its_uninterrupted_run_does(
        number, shaped, shaped_runs, tmp_path):
    """With batch norm's running statistics, through the library's own checkpoint (05's engine
    checkpoint, 08's DCP), with the default flags (04's .pt path is the image copies')."""
    copies, folder = shaped["rows"]
    flags = [*DEFAULTS, "--arch", "mlp"]
    launch(number, copies, folder, tmp_path, *flags, "--stop-after", "1")
    resumed = launch(number, copies, folder, tmp_path, *flags, "--resume", "auto")
    assert f"resumed from epoch 1 (written by {JOBS[number][0]})" in resumed.output, resumed.output
    assert digests(tmp_path) == digests(shaped_runs("rows", number)[0])


def test_a_batch_of_one_for_batch_norm_is_one_line_naming_drop_last(shaped, tmp_path, capsys):
    """33 rows in batches of 16: the epoch's last batch holds one row, which batch norm refuses in
    training: one line that names --drop-last, exit 2; with --drop-last every epoch trains 32."""
    copies, _ = shaped["rows"]
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 33), ("test", 10)):
        features, labels = shaped_samples("rows", count, generator)
        torch.save({"features": features, "labels": labels}, tmp_path / f"{split}.pt")
    step = runpy.run_path(str(copies[1]), run_name="my_cpu")
    flags = ["--data-dir", str(tmp_path), "--epochs", "1", "--batch-size", "16", "--workers", "0",
             "--amp", "off"]
    with pytest.raises(SystemExit) as stopped:
        step["main"]([*flags, "--out-dir", str(tmp_path / "one")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stopped.value.code == 2 and len(errors) == 1 and "--drop-last" in errors[0], errors
    assert step["main"]([*flags, "--drop-last", "--out-dir", str(tmp_path / "dropped")]) == 0
    assert [(row["images"], row["steps"]) for row in metrics(tmp_path / "dropped")] == [(32, 2)]
