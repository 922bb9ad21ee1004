"""Step 07 (Apex): the native successors for real on CPU, and Apex's absence said in one line.

The native path (torch.autocast + GradScaler, torch DDP) runs under the legacy launcher old Apex
tutorials use (`python -m torch.distributed.launch`, which passes --local-rank=N) and, resumed, under
torchrun, ending with step 04's bits. The legacy apex.amp/apex.parallel path and FusedSGD need a CUDA GPU
and a built Apex: neither exists here, so they are untested; these tests check what a reader without
them sees (`--amp-backend apex` without Apex: tests/test_bad_input.py, with the other bad input).
"""
import os

import pytest

from helpers import (DDP_ARGS, EPOCHS, PYTHON, REPO, SMOKE, as_after_epoch, assert_one_line_error, assert_trained, checkpoint_epoch,
                     digests, load_checkpoint, legacy_launch, metrics, once, run, script, torchrun)

# 2 processes x 32 in fp32, as run04 (conftest.py): the native path is 04's code, so 07 must end with 04's bits. fp32
# because the CPU emulates bf16, which test_bf16_autocast_resumes_bit_for_bit runs on 8 images.
TRAIN = [*EPOCHS, *DDP_ARGS]
ONE = [*EPOCHS, "--batch-size", "64", "--amp", "off"]  # 1 x 64: the same global batch in one process


@pytest.fixture(scope="module")
def resumed(data, tmp_path_factory):
    """Epoch 1 under the legacy launcher, then --resume auto under torchrun: both launchers, one run."""
    def make(out):
        common = [*data, *TRAIN, "--out-dir", out]
        first = legacy_launch(2, 7, *common, "--stop-after", "1")
        then = torchrun(2, 7, *common, "--resume", "auto")
        return out, first.output, then.output
    return once(tmp_path_factory, "apex-resumed", make)


def test_native_path_trains_under_the_legacy_launcher(resumed):
    out, output, _ = resumed
    assert "epoch   1/2" in output and "stopping after 1 epoch" in output, output
    assert_trained(out, epochs=2, ranks=2)
    chosen = [line for line in output.splitlines() if line.startswith("amp backend:")]
    assert chosen == ["amp backend: torch (auto: NVIDIA Apex is not installed; using its native successors "
                      "torch.autocast + GradScaler + torch DDP)"], output
    assert "optimizer: torch.optim.SGD" in output
    state = load_checkpoint(checkpoint_epoch(out, 2))
    assert state["step"] == "07_cifar10_apex" and state["scaler"] == {}  # fp32: the scaler is disabled


def test_resumed_under_torchrun_it_ends_where_04_does_bit_for_bit(resumed, run04):
    out, _, output = resumed
    assert "resumed from epoch 1 (written by 07_cifar10_apex)" in output
    assert [row["epoch"] for row in metrics(out)] == [1, 2]
    assert sorted(digests(out)) == [0, 1] and digests(out) == digests(run04[0]), "stopped, resumed, and 04's bits"


def test_bf16_autocast_resumes_bit_for_bit(tiny_data, tmp_path):
    """bf16 autocast (--amp auto's choice where the CPU computes it natively; the scaler disabled) on 8 images, 2
    optimizer steps per epoch (a CPU without native bf16 emulates it): the legacy launcher's run as it was after
    epoch 1 (what a stopped launch leaves: the `resumed` fixture), resumed under torchrun, ends where the
    uninterrupted one does."""
    tiny = [*tiny_data, *SMOKE, "--epochs", "2", "--batch-size", "2", "--amp", "bf16"]
    whole = legacy_launch(2, 7, *tiny, "--out-dir", tmp_path / "whole")
    assert "amp bf16" in whole.output, whole.output
    assert load_checkpoint(checkpoint_epoch(tmp_path / "whole", 2))["scaler"] == {}  # bf16: the scaler is disabled
    as_after_epoch(tmp_path / "whole", tmp_path / "resumed", 1)  # a stopped legacy launch: the `resumed` fixture
    torchrun(2, 7, *tiny, "--out-dir", tmp_path / "resumed", "--resume", "auto")
    found = digests(tmp_path / "resumed")
    assert sorted(found) == [0, 1] and found == digests(tmp_path / "whole"), (found, digests(tmp_path / "whole"))


def test_checkpoints_interchange_with_step_01(resumed, data, tmp_path):
    """01 continues from 07's epoch-1 checkpoint; 07 then loads 01's result to the last bit."""
    run([PYTHON, script(1), *data, *ONE, "--out-dir", tmp_path / "01", "--resume", checkpoint_epoch(resumed[0], 1)])
    proc = run([PYTHON, script(7), *data, *ONE, "--out-dir", tmp_path / "07",
                "--resume", checkpoint_epoch(tmp_path / "01", 2), "--amp-backend", "torch"])
    assert "resumed from epoch 2 (written by 01_cifar10_cpu)" in proc.output
    assert digests(tmp_path / "07") == digests(tmp_path / "01")


@pytest.fixture
def registry_apex(tmp_path):
    """What `pip install apex` gives: a top-level package named apex, without amp/ or optimizers/."""
    (tmp_path / "site" / "apex").mkdir(parents=True)
    (tmp_path / "site" / "apex" / "__init__.py").write_text("")
    return {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}


def test_registry_apex_is_named_as_the_unrelated_package(registry_apex, data, tmp_path):
    proc = run([PYTHON, script(7), *data, "--out-dir", tmp_path / "run", "--amp-backend", "apex"], check=False,
               **registry_apex)
    assert_one_line_error(proc, "the apex in ", "is the unrelated registry package of that name, not NVIDIA Apex",
                          "pip uninstall apex")
