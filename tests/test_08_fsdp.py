"""Step 08 (FSDP2 + DCP) under torchrun on the CPU: it learns, every rank holds other shards of one
model, a sharded checkpoint resumes on another number of processes, and checkpoints move both ways
between 08 and 04 (held to the tolerance of the other cross-method tests). Its sharded resume on the
same 2 processes ends bit for bit where 04 does, with ResNet-18's batch-norm statistics:
tests/test_default_model.py."""
import shutil

import pytest

from helpers import (DDP_ARGS, EPOCHS, PYTHON, as_after_epoch, assert_step01_evaluates_as_logged,
                     assert_trained, checkpoint_epoch, metrics, run, script, torchrun)


def epoch_close(a, b):
    assert a["epoch"] == b["epoch"]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=2e-3)
    assert b["test_loss"] == pytest.approx(a["test_loss"], rel=2e-3)
    assert abs(b["test_acc"] - a["test_acc"]) <= 0.02


def test_learns_with_each_rank_holding_its_own_shards(run08):
    out, output = run08
    assert_trained(out, epochs=2, ranks=2)  # the weights gathered on each rank are bit-identical
    shards = sorted((out / "dcp" / "epoch0002").glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    assert shards[0].read_bytes() != shards[1].read_bytes(), (
        "the ranks wrote the same data: nothing was sharded")
    assert not list((out / "dcp").glob("*.tmp")), "a finished save leaves no temporary folder"


def test_sharded_checkpoint_resumes_on_one_process_and_back_on_two(run08, data, tmp_path):
    """2 -> 1: DCP reshards the 2-process checkpoint for one process (global batch kept: 1 x 64),
    which trains epoch 2 as the 2-process run did. 1 -> 2: that run's checkpoint continues on 2
    processes. The first --resume auto also passes over the dcp/epoch0002.tmp that a save killed
    part-way leaves (it is renamed only once every rank has written, and rank 0 writes .metadata
    last), and its own save replaces it."""
    one = as_after_epoch(run08[0], tmp_path / "one", 1, rows=False)
    unfinished = one / "dcp" / "epoch0002.tmp"
    shutil.copytree(one / "dcp" / "epoch0001", unfinished)
    (unfinished / ".metadata").unlink()
    proc = run([PYTHON, script(8), *data, "--epochs", "2", "--batch-size", "64", "--amp", "off",
                "--out-dir", one, "--resume", "auto"])
    assert "resumed from epoch 1 (written by 08_cifar10_fsdp), sharded" in proc.output
    epoch_close(metrics(run08[0])[1], metrics(one)[-1])
    assert sorted(path.name for path in (one / "dcp").iterdir()) == ["epoch0001", "epoch0002"]
    proc = torchrun(2, 8, *data, "--epochs", "3", *DDP_ARGS, "--out-dir", one, "--resume", "auto")
    assert "resumed from epoch 2 (written by 08_cifar10_fsdp), sharded" in proc.output
    # epoch 1's row came from its checkpoint (no metrics.jsonl was left: it agrees with the
    # checkpoints)
    assert ([row["epoch"] for row in metrics(one)] == [1, 2, 3]
            and metrics(one)[-1]["test_acc"] >= 0.5)


def test_checkpoints_move_both_ways_between_04_and_08(run08, run04, data, tmp_path):
    """04 continues 08's epoch 1 like 08 did, and 08 continues 04's epoch 1 like 04 did (momentum
    included)."""
    (tmp_path / "04").mkdir()
    shutil.copy(checkpoint_epoch(run08[0], 1), tmp_path / "04")
    proc = torchrun(2, 4, *data, *EPOCHS, *DDP_ARGS, "--out-dir", tmp_path / "04",
                    "--resume", "auto")
    assert "resumed from epoch 1 (written by 08_cifar10_fsdp)" in proc.output
    epoch_close(metrics(run08[0])[1], metrics(tmp_path / "04")[-1])
    proc = torchrun(2, 8, *data, *EPOCHS, *DDP_ARGS, "--out-dir", tmp_path / "08",
                    "--resume", checkpoint_epoch(run04[0], 1))
    assert "resumed from epoch 1 (written by 04_cifar10_ddp)" in proc.output
    epoch_close(metrics(run04[0])[1], metrics(tmp_path / "08")[-1])


def test_01_evaluates_the_gathered_checkpoint_to_the_logged_accuracy(run08, data, tmp_path):
    assert_step01_evaluates_as_logged(checkpoint_epoch(run08[0], 2), metrics(run08[0])[1], data,
                                      tmp_path)


def test_bf16_policy_learns(small_data, tmp_path):
    """bf16 (--amp auto's choice where the CPU or GPU computes it natively): the
    MixedPrecisionPolicy's bf16 units, fp32 gradient reductions and shards, on data that needs a few
    dozen steps: it learns (fp32 on the same data and steps: 05's run05 on a CPU without native
    bf16)."""
    proc = torchrun(2, 8, *small_data, "--epochs", "2", "--batch-size", "8", "--amp", "bf16",
                    "--out-dir", tmp_path)
    assert "amp bf16" in proc.output, proc.output
    assert_trained(tmp_path, epochs=2, ranks=2)
