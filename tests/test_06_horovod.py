"""Step 06 (Horovod) under the real horovodrun: it trains, keeps the replicas identical, resumes bit
for bit, matches DDP (step 04) to the last bit, writes checkpoints that steps 01 and 04 load, and
says in one line when Horovod is missing. Its part-way resume after a stop signal is
tests/test_preemption.py's; that it continues 04's checkpoint with ResNet-18's batch-norm statistics
to 04's bits, tests/test_default_model.py's.

Every horovodrun start costs seconds on two cores (the launcher first checks its own build in
subprocesses, then every rank imports torch), so one uninterrupted run serves several checks.
That run is the classic command with --grad-accum 2 (Horovod's backward_passes_per_step). The
resumed run adds --gloo, which skips horovodrun's MPI probe (this build has Gloo only). All use
--amp off, so that step 01's fp32 evaluation of the checkpoint can be held to 06's logged numbers.
--fp16-allreduce (Horovod's fp16 compression) continues that run's epoch 1 on the CPU too. Untested
here: the GPU path (NCCL, fp16 + GradScaler, hvd.SyncBatchNorm).
"""
import shutil

import pytest
import torch

from common.checkpoint import weights_digest
from helpers import (BIN, HOROVOD_ARGS, PYTHON, SMOKE, assert_step01_evaluates_as_logged,
                     assert_trained, checkpoint_epoch, copy_checkpoint_dir, digests, free_port,
                     launch_command, load_checkpoint, metrics, run, run_together, script)

# 2 processes x 16 images x 2 accumulated passes = 64 images per optimizer step
TRAIN = HOROVOD_ARGS
# run06 (conftest.py): the uninterrupted 2-process run, started exactly as the README's classic
# command, with TRAIN.


def test_two_processes_train_identical_replicas(run06):
    out, output = run06
    assert_trained(out, epochs=2, ranks=2)
    assert "2 processes x 2 accumulation = 64 global" in output
    assert (output.count("epoch   2/2") == 1
            and "[1]<stdout>:epoch" not in output), "only rank 0 logs"
    state = load_checkpoint(checkpoint_epoch(out, 2))
    assert state["step"] == "06_cifar10_horovod" and state["args"]["grad_accum"] == 2
    # --lr is the global batch's peak learning rate, as in every step (Horovod's examples would
    # scale it by 2).
    assert state["optimizer"]["param_groups"][0]["initial_lr"] == pytest.approx(0.1)


def test_06_and_04_continue_a_06_checkpoint_to_the_same_bits_and_01_trains_on(run06, cifar_dir,
                                                                              tmp_path):
    """06 itself (--grad-accum 2 is Horovod's backward_passes_per_step) and 04 under torchrun each
    continue the uninterrupted run's epoch-1 checkpoint, and both end bit-identical to it: Horovod's
    allreduce and DDP's average the same gradients. Only rank 0 reads the checkpoint; rank 1 gets
    everything from it by broadcast. Meanwhile 01 continues 06's last checkpoint to a third
    epoch."""
    out = run06[0]
    in06, in04, in01 = tmp_path / "06", tmp_path / "04", copy_checkpoint_dir(out, tmp_path / "01")
    for folder in (in06, in04):
        folder.mkdir()
        shutil.copy(checkpoint_epoch(out, 1), folder)
    data = ["--data-dir", cifar_dir, *SMOKE]
    again, ddp, continued = run_together(
        [*launch_command("horovodrun", 2, 6), *data, *TRAIN, "--out-dir", in06, "--resume", "auto"],
        [BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", script(4), *data,
         *TRAIN, "--out-dir", in04, "--resume", "auto"],
        [PYTHON, script(1), *data, "--epochs", "3", "--batch-size", "64", "--amp", "off",
         "--out-dir", in01, "--resume", checkpoint_epoch(in01, 2)])
    assert "[0]<stdout>:resumed from epoch 1 (written by 06_cifar10_horovod)" in again, again
    assert "[1]<stdout>:resumed" not in again
    assert digests(in06) == digests(out) and sorted(digests(in06)) == [0, 1]
    same = ("epoch", "train_loss", "test_loss", "test_acc")
    assert [metrics(in06)[-1][k] for k in same] == [metrics(out)[-1][k] for k in same]
    assert "resumed from epoch 1 (written by 06_cifar10_horovod)" in ddp
    assert digests(in04) == digests(out)
    assert metrics(in04)[-1]["test_acc"] == metrics(out)[-1]["test_acc"]
    assert "resumed from epoch 2 (written by 06_cifar10_horovod)" in continued
    rows = metrics(in01)
    # epoch 2's row comes from the copied checkpoint (metrics.jsonl agrees with the checkpoints),
    # then 01's epoch 3
    assert [r["epoch"] for r in rows] == [2, 3] and rows[-1]["test_acc"] >= 0.5
    assert load_checkpoint(checkpoint_epoch(in01, 3))["step"] == "01_cifar10_cpu"


def test_a_checkpoint_of_weights_only_is_continued_with_exactly_its_weights(run06, cifar_dir,
                                                                           tmp_path):
    """A checkpoint without optimizer state (what 05 exports), with nothing left to train: every
    rank ends with exactly the weights in the file. (Horovod's broadcast_optimizer_state on an
    optimizer without state first takes a step with zero gradients, which weight decay turns into
    a change of the weights: 06 must not call it then.)"""
    state = load_checkpoint(checkpoint_epoch(run06[0], 1))
    torch.save({**state, "optimizer": None}, tmp_path / "checkpoint-epoch0001.pt")
    proc = run([*launch_command("horovodrun", 2, 6), "--data-dir", cifar_dir, *SMOKE, *TRAIN,
                "--epochs", "1", "--out-dir", tmp_path, "--resume", "auto"])
    assert ("resumed from epoch 1 (written by 06_cifar10_horovod): weights only, momentum starts "
            "from zero") in proc.output, proc.output
    assert set(digests(tmp_path).values()) == {weights_digest(state["model"])}


def test_01_evaluates_the_checkpoint_to_the_logged_accuracy(run06, cifar_dir, tmp_path):
    """06 evaluated a sharded test set (151 + 150 images) with hvd.allreduce(op=hvd.Sum)."""
    assert_step01_evaluates_as_logged(checkpoint_epoch(run06[0], 2), metrics(run06[0])[-1],
                                      ["--data-dir", cifar_dir, *SMOKE], tmp_path)


def test_missing_horovod_is_one_line_with_the_fix(cifar_dir, tmp_path):
    """With horovod unimportable the script names the install script and the python to use it
    with."""
    hide_horovod = ("import runpy, sys; sys.modules['horovod'] = None; sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = run([PYTHON, "-c", hide_horovod, script(6), "--data-dir", cifar_dir, *SMOKE,
                "--out-dir", tmp_path / "o"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.output, proc.output
    errors = [line for line in proc.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Horovod is not importable" in errors[0], proc.output
    assert f"PYTHON={PYTHON} bash scripts/install_horovod.sh" in errors[0]
    assert not (tmp_path / "o").exists(), "nothing is written before the check"


def test_fp16_allreduce_sends_fp16_gradients_and_learns_as_fp32_does(run06, cifar_dir, tmp_path):
    """--fp16-allreduce (hvd.Compression.fp16) continues the uninterrupted run's epoch 1: replicas
    still identical, other bits than the fp32 all-reduce gave (the gradients were rounded to fp16 on
    the way), the same epoch 2 within the tolerance of the other cross-method tests."""
    shutil.copy(checkpoint_epoch(run06[0], 1), tmp_path)
    run([*launch_command("horovodrun", 2, 6), "--data-dir", cifar_dir, *SMOKE, *TRAIN,
         "--fp16-allreduce", "--out-dir", tmp_path, "--resume", "auto"])
    found, fp32 = digests(tmp_path), digests(run06[0])
    assert sorted(found) == [0, 1] and len(set(found.values())) == 1, found
    assert found != fp32, "the same bits as the fp32 all-reduce: the gradients were not compressed"
    row, want = metrics(tmp_path)[-1], metrics(run06[0])[-1]
    assert (row["epoch"] == 2
            and row["train_loss"] == pytest.approx(want["train_loss"], rel=2e-2)), (row, want)
    assert abs(row["test_acc"] - want["test_acc"]) <= 0.02, (row, want)
