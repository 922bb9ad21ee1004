"""Step 08 (FSDP2 + DCP) under torchrun on the CPU: it learns, every rank holds other shards of one
model, HSDP (2 replicas of 2 shards) learns the same curve with equal replicas, a sharded checkpoint
resumes on other meshes both ways, and checkpoints move both ways between 08 and 04 (bit for bit;
08's DCP folders through scripts/dcp_to_pt.py, the only writer of a .pt of 08's).
Its sharded resume on the same 2 processes ends bit for bit where 04 does, with ResNet-18's
batch-norm statistics: tests/test_default_model.py."""
import json
import os
import re
import shutil
import signal

import pytest
from torch.distributed.checkpoint import FileSystemReader

from common.checkpoint import weights_digest
from helpers import (BIN, DDP_ARGS, EPOCHS, PYTHON, REPO, as_after_epoch, assert_alike,
                     assert_step01_evaluates_as_logged, assert_trained, checkpoint_epoch, digests,
                     free_port, load_checkpoint, metrics, run, script, start, torchrun, wait_for)
from helpers import converted as to_pt

# run08's recipe on 4 processes: global batch 64 in fp32
HSDP_ARGS = ["--batch-size", "16", "--amp", "off"]


def test_learns_with_each_rank_holding_its_own_shards(run08, tmp_path):
    out, output = run08
    assert_learned(out, 2, tmp_path)  # the weights gathered on each rank are bit-identical
    shards = sorted((out / "dcp" / "epoch0002").glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    assert shards[0].read_bytes() != shards[1].read_bytes(), (
        "the ranks wrote the same data: nothing was sharded")
    assert_every_save_complete(out)


def assert_learned(out, ranks, tmp_path):
    """helpers.assert_trained on a copy of 08's run whose last checkpoint is the .pt that
    scripts/dcp_to_pt.py makes of its dcp/epoch0002."""
    for path in [out / "metrics.jsonl", out / "training_curves.png", *out.glob("weights-rank*")]:
        shutil.copy(path, tmp_path)
    converted(out, 2, tmp_path)
    assert_trained(tmp_path, epochs=2, ranks=ranks)


def assert_every_save_complete(out):
    """Every folder in dcp/ holds DCP's .metadata (rank 0 writes it last), and no .pt is there:
    08 writes DCP only."""
    folders = list((out / "dcp").iterdir())
    assert folders and all((folder / ".metadata").is_file() for folder in folders), folders
    assert not list(out.glob("*.pt")), "08 writes no .pt (scripts/dcp_to_pt.py makes one)"


@pytest.fixture(scope="module")
def hsdp(data, tmp_path_factory):
    """08 on 4 processes as 2 replicas of 2 shards each (HSDP, --replicate 2): run08's recipe (fp32,
    global batch 64: 4 x 16), its checkpoints written in the background."""
    out = tmp_path_factory.mktemp("hsdp")
    torchrun(4, 8, *data, *EPOCHS, *HSDP_ARGS, "--replicate", "2", "--out-dir", out)
    return out


def shards_per_weight(folder):
    """{weight: the pieces a DCP checkpoint stores it in} (its .metadata, written by our run)."""
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {name: len(metadata[name].chunks) for name in metadata
            if name.startswith("model.") and name.endswith(".weight")}


def test_hsdp_learns_run08s_curve_with_equal_replicas(hsdp, run08, tmp_path):
    assert_learned(hsdp, 4, tmp_path)  # every rank's whole state, bit for bit
    # 2 shards per weight, each held by both replicas (1 x 4 would store 4, 4 x 1 one)
    assert set(shards_per_weight(hsdp / "dcp" / "epoch0002").values()) == {2}
    # 4 x 16 against 2 x 32: other sums (helpers.ALIKE)
    assert_alike(metrics(hsdp), metrics(run08[0]))
    assert_every_save_complete(hsdp)


def resumed_state(source, epoch, out, processes, replicate, data):
    """Resume `source`'s epoch on `processes` as `replicate` replicas, with nothing left to train
    (--epochs EPOCH): every rank's weights-rankN.sha256 is then the state DCP loaded, resharded.
    Returns (those digests, the digest of the whole state the source gathered at that epoch)."""
    out = as_after_epoch(source, out, epoch, rows=False)
    proc = torchrun(processes, 8, *data, "--epochs", str(epoch), "--batch-size",
                    str(64 // processes), "--amp", "off", "--replicate", str(replicate),
                    "--out-dir", out, "--resume", "auto")
    assert f"resumed from epoch {epoch} (written by 08_cifar10_fsdp)" in proc.output
    saved = load_checkpoint(converted(source, epoch, out.parent / "converted"))["model"]
    return set(digests(out).values()), weights_digest(saved)


def converted(source, epoch, out):
    """The path of the checkpoint-epochNNNN.pt that scripts/dcp_to_pt.py makes in `out` of
    `source`'s dcp/epochNNNN."""
    return to_pt(source / "dcp" / f"epoch{epoch:04d}", out)


@pytest.mark.parametrize("processes,replicate", [(4, 1), (4, 4), (2, 1)],
                         ids=["1x4", "4x1", "1x2"])
def test_a_2x2_checkpoint_resumes_bit_for_bit_on_other_meshes(hsdp, data, tmp_path, processes,
                                                              replicate):
    """DCP reshards 2 x 2's epoch 1 to 1 x 4 (FSDP), 4 x 1 (replicas only) and 1 x 2: every rank
    holds exactly the weights and buffers saved. (Training on goes on in another summation order:
    the same curve, other bits.) --resume auto passes over the dcp/epoch0002 that a save killed
    part-way leaves (without .metadata, which rank 0 writes once every rank has written)."""
    unfinished = tmp_path / "dcp" / "epoch0002"
    shutil.copytree(hsdp / "dcp" / "epoch0001", unfinished)
    (unfinished / ".metadata").unlink()
    loaded, saved = resumed_state(hsdp, 1, tmp_path, processes, replicate, data)
    assert loaded == {saved}


def test_a_1x2_checkpoint_resumes_bit_for_bit_on_2x2(run08, data, tmp_path):
    """The other way: run08's epoch 1 (FSDP on 2 processes) on 2 replicas of 2 shards."""
    loaded, saved = resumed_state(run08[0], 1, tmp_path, 4, 2, data)
    assert loaded == {saved}


def test_checkpoints_move_both_ways_between_04_and_08(run08, run04, data, tmp_path):
    """04 continues 08's epoch 1 (its DCP folder, made a checkpoint-epoch0001.pt by
    scripts/dcp_to_pt.py) and 08 continues 04's epoch 1 (momentum included), each to the last bit
    where both uninterrupted runs end: the same 2 x 32 in fp32 is the same arithmetic in both steps.
    """
    converted(run08[0], 1, tmp_path / "04")
    proc = torchrun(2, 4, *data, *EPOCHS, *DDP_ARGS, "--out-dir", tmp_path / "04",
                    "--resume", "auto")
    assert "resumed from epoch 1 (written by 08_cifar10_fsdp)" in proc.output
    assert digests(run08[0]) == digests(run04[0]) == digests(tmp_path / "04")
    proc = torchrun(2, 8, *data, *EPOCHS, *DDP_ARGS, "--out-dir", tmp_path / "08",
                    "--resume", checkpoint_epoch(run04[0], 1))
    assert "resumed from epoch 1 (written by 04_cifar10_ddp)" in proc.output
    assert digests(tmp_path / "08") == digests(run04[0])


def test_a_run_killed_during_an_async_save_resumes_from_the_save_before(run08, data, tmp_path):
    """Every process killed (SIGKILL) while its 2nd save is being written in the background (DCP's
    writes slowed by scripts/inject_fault.py slow-save): dcp/epoch0002 stays unfinished (no
    .metadata) and epoch0001 the newest complete checkpoint. With only --resume of that dcp/ folder
    (run08's batch, precision and epochs not typed), 08 takes its newest complete checkpoint and the
    run's settings from it, passes over the unfinished one and ends with run08's exact weights.
    (--resume auto does the same: the reshard tests above.)"""
    job = start([BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}",
                 REPO / "scripts" / "inject_fault.py", "slow-save", script(8), *data, *EPOCHS,
                 *DDP_ARGS, "--out-dir", tmp_path])
    try:
        wait_for(tmp_path, "dcp/epoch0002/position.json", job)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    unfinished = tmp_path / "dcp" / "epoch0002"
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == ["epoch0001", "epoch0002"]
    assert not list(unfinished.glob("*.distcp")) and not (unfinished / ".metadata").exists(), (
        "it was not writing")
    proc = torchrun(2, 8, *data, "--out-dir", tmp_path, "--resume", tmp_path / "dcp")
    assert "resumed from epoch 1 (written by 08_cifar10_fsdp)" in proc.output, proc.output
    assert digests(tmp_path) == digests(run08[0])
    assert json.loads((unfinished / "position.json").read_text())["args"]["batch_size"] == 32
    assert_every_save_complete(tmp_path)  # the resumed run's save replaced the unfinished one


def test_01_evaluates_the_converted_checkpoint_to_the_logged_accuracy(run08, data, tmp_path):
    assert_step01_evaluates_as_logged(converted(run08[0], 2, tmp_path / "pt"),
                                      metrics(run08[0])[1], data, tmp_path)


def test_bf16_policy_learns(small_data, tmp_path):
    """bf16 (--amp auto's choice where the CPU or GPU computes it natively): the
    MixedPrecisionPolicy's bf16 units, fp32 gradient reductions and shards, on data that needs a few
    dozen steps: it learns (fp32 on the same data and steps: 05's run05 on a CPU without native
    bf16)."""
    proc = torchrun(2, 8, *small_data, "--epochs", "2", "--batch-size", "8", "--amp", "bf16",
                    "--out-dir", tmp_path / "run")
    assert "amp bf16" in proc.output, proc.output
    assert_learned(tmp_path / "run", 2, tmp_path)


def test_save_stall_times_every_way_of_saving_with_08s_own_model():
    """scripts/save_stall.py (its table is in docs/08-fsdp.md), on the small cnn: one row per way of
    saving, each a time; the background writing includes async_save's own wait."""
    output = run([PYTHON, "scripts/save_stall.py", "--arch", "cnn", "--repeats", "1"]).output
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+)", output, re.M))
    assert list(rows) == ["dcp.save", "dcp.async_save", "background writing",
                          "gathered .pt (scripts/dcp_to_pt.py's, not 08's)"], output
    assert float(rows["dcp.async_save"]) <= float(rows["background writing"]), output
    assert "step 08, cnn (" in output and "2 CPU processes (gloo)" in output, output
