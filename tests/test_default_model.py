"""The default model, ResNet-18 with its 20 batch-norm layers, in every step under its own launcher.

The small cnn normalises with GroupNorm, which hides what batch norm brings: running statistics that
are buffers (not parameters, so no gradient all-reduce keeps them equal), statistics per process,
and their precision. So the steps run ResNet-18 here, on a small fixed set (32 training images, 2
optimizer steps per epoch, `--easy`), with a learning rate that suits it:

* fp32, 2 epochs: one process x 16 images (01, 02, 03), two processes x 8 (04 to 08). Two processes
  sum each gradient in one addition (a + b is b + a), so every distributed step trains exactly as
  DDP does: 04's run is the reference that each other step must end at bit for bit, uninterrupted
  (05 in ZeRO 1, 08) or after continuing 04's checkpoint (06, 07). (Their stops and resumes are
  exact on the small cnn with batch norm, tests/test_preemption.py.) The training loss falls from
  epoch 1 to epoch 2.
* bf16 (--amp auto's choice on a CPU that computes it natively), two optimizer steps on 8 images:
  01's autocast (which 02-04, 06 and 07 share), 05's engine (bf16 weights) and 08's
  MixedPrecisionPolicy (bf16 units, fp32 batch norm). The start line says that bf16 was asked for,
  and on a CPU without native bf16 that it is emulated.

Every run also passes helpers.run's check that its ranks end with equal states
(weights-rankN.sha256: a hash of every tensor of the state_dict, buffers included).
"""
import pytest

from helpers import (PYTHON, checkpoint_epoch, digests, launch_command, load_checkpoint, metrics,
                     once, run, script, synthetic)

RESNET = ["--arch", "resnet18", "--workers", "0", "--seed", "0", "--lr", "0.005"]
FP32 = [*RESNET, "--amp", "off", "--epochs", "2"]
ONE, TWO = [*FP32, "--batch-size", "16"], [*FP32, "--batch-size", "8"]


@pytest.fixture(scope="session")
def resnet_data(tmp_path_factory):
    def make(folder):
        return ["--data-dir",
                synthetic(folder, "--easy", "--train-size", "32", "--test-size", "16")]
    return once(tmp_path_factory, "resnet", make)


def launch(launcher, nproc, number, *args, **kw):
    return run([*launch_command(launcher, nproc, number), *args], DS_ACCELERATOR="cpu", **kw)


def rows(out_dir):
    return [(row["epoch"], row["train_loss"], row["test_loss"], row["test_acc"])
            for row in metrics(out_dir)]


def assert_learns_with_batch_norm(out_dir, ranks):
    (_, loss1, *_), (_, loss2, *_) = rows(out_dir)
    assert loss2 < loss1 - 0.1, f"the training loss did not fall: {rows(out_dir)}"
    state = load_checkpoint(checkpoint_epoch(out_dir, 2))
    assert state["arch"] == "resnet18" and "layers.0.bn1.running_mean" in state["model"], (
        "buffers are checkpointed")
    assert sorted(digests(out_dir)) == list(range(ranks))


@pytest.fixture(scope="session")
def resnet01(resnet_data, tmp_path_factory):
    def make(out):
        run([PYTHON, script(1), *resnet_data, *ONE, "--out-dir", out])
        return out
    return once(tmp_path_factory, "resnet01", make)


@pytest.fixture(scope="session")
def resnet04(resnet_data, tmp_path_factory):
    """The reference of the distributed steps: 04 under torchrun, 2 processes x 8 images,
    uninterrupted."""
    def make(out):
        launch("torchrun", 2, 4, *resnet_data, *TWO, "--out-dir", out)
        return out
    return once(tmp_path_factory, "resnet04", make)


def test_01_learns_and_02_stopped_then_03_resumed_ends_exactly_there(resnet01, resnet_data,
                                                                    tmp_path):
    assert_learns_with_batch_norm(resnet01, ranks=1)
    stopped = run([PYTHON, script(2), *resnet_data, *ONE, "--out-dir", tmp_path,
                   "--stop-after", "1"])
    assert ("stopping after 1 epoch" in stopped.output
            and [epoch for epoch, *_ in rows(tmp_path)] == [1])
    resumed = run([PYTHON, script(3), *resnet_data, *ONE, "--out-dir", tmp_path,
                   "--resume", "auto"])
    assert "resumed from epoch 1 (written by 02_cifar10_gpu)" in resumed.output
    assert rows(tmp_path) == rows(resnet01) and digests(tmp_path) == digests(resnet01)


def test_04_learns_with_identical_replicas(resnet04):
    assert_learns_with_batch_norm(resnet04, ranks=2)


# How each distributed step gets to the end of epoch 2: [launcher, extra arguments] per launch, and
# what it says when it resumes.
SAYS = {5: "05_cifar10_deepspeed: resnet18 on 2 x cpu, ZeRO stage 1",
        6: "resumed from epoch 1 (written by 04_cifar10_ddp)",
        7: "resumed from epoch 1 (written by 04_cifar10_ddp)",
        8: "08_cifar10_fsdp: resnet18 on 2 x cpu"}
CONTINUED = {
    # ZeRO 1 (2: tests/test_learning_curves.py), uninterrupted
    5: [("deepspeed", ["--zero-stage", "1"])],
    # 04's epoch-1 checkpoint, momentum and batch-norm statistics
    6: [("horovodrun", ["--resume", "FROM_04"])],
    # the launcher of old tutorials; its own resume: test_preemption.py
    7: [("legacy", ["--resume", "FROM_04"])],
    # sharded, uninterrupted
    8: [("torchrun", [])],
}


@pytest.mark.parametrize("number", sorted(CONTINUED), ids=[f"{n:02d}" for n in sorted(CONTINUED)])
def test_each_distributed_step_ends_exactly_where_ddp_does(number, resnet04, resnet_data, tmp_path):
    for launcher, extra in CONTINUED[number]:
        extra = [str(checkpoint_epoch(resnet04, 1)) if word == "FROM_04" else word
                 for word in extra]
        output = launch(launcher, 2, number, *resnet_data, *TWO, "--out-dir", tmp_path,
                        *extra).output
    assert SAYS[number] in output, output
    assert sorted(digests(tmp_path)) == [0, 1]
    assert rows(tmp_path)[-1] == rows(resnet04)[-1], "epoch 2 as 04 logged it"
    assert digests(tmp_path) == digests(resnet04), (
        "every tensor, batch-norm statistics included, as 04's")


# launcher, processes, batch: two optimizer steps on tiny_data's 8 images (bf16 is emulated on CPUs
# without AVX512-BF16 or AMX: ResNet-18 at about 2 images/s). 05's engine in bf16 with batch norm:
# tests/test_template.py (a user's ConvNet); 08's policy on ResNet-18 in bf16:
# tests/test_gpu_paths.py, in process.
BF16 = {1: ("python", 1, "4")}


@pytest.mark.parametrize("number", sorted(BF16), ids=[f"{n:02d}" for n in sorted(BF16)])
def test_bf16_on_the_cpu(number, tiny_data, tmp_path):
    import torch

    from common.cli import amp_choice

    launcher, nproc, batch = BF16[number]
    output = launch(launcher, nproc, number, *tiny_data, *RESNET, "--epochs", "1",
                    "--batch-size", batch, "--amp", "bf16", "--out-dir", tmp_path).output
    why = amp_choice("bf16", torch.device("cpu"))[1]  # "as asked", or that this CPU emulates it
    assert "resnet18 on" in output and (
        "amp bf16," if why == "as asked" else f"amp bf16 ({why}),") in output, output
    (row,) = metrics(tmp_path)
    # finite, near ln(10) after 2 steps
    assert 1.5 < row["train_loss"] < 4 and row["test_loss"] < 4, row
    assert sorted(digests(tmp_path)) == list(range(nproc))
