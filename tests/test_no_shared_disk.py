"""Every rank resumes what rank 0 chose, with or without a shared disk.

Two "machines" on this one, as a job on two nodes starts: two torchrun commands (--nnodes=2, one
process each, each its own LOCAL_RANK 0) meeting at one address; the second runs in a mount
namespace where --out-dir is an empty tmpfs (`unshare -m`), as a node without the shared disk sees
it. Rank 0 sees the checkpoint, rank 1 sees nothing there.

* 04 and 07 continue run04's epoch 1 (rank 0 reads the .pt and sends it) and end with run04's
  weights on both ranks (rank 1's digest is copied out of its tmpfs before it goes).
* 05's engine checkpoint and 08's DCP folder are files per rank, read where they were written:
  every rank stops with one line naming rank 1, at once, not at --dist-timeout.
"""
import shlex
import subprocess

import pytest

from helpers import (BIN, DDP_ARGS, EPOCHS, OUR_FRAMES, as_after_epoch, digests, env, free_port,
                     script)


def unshare_refusal():
    """Why `unshare -m` cannot run here (None where it can: root, as CI runs)."""
    try:
        proc = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    except OSError as error:
        return str(error)
    return None if proc.returncode == 0 else proc.stderr.strip() or f"exit {proc.returncode}"


REFUSED = unshare_refusal()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=(
    f"`unshare -m` is not permitted here ({REFUSED}): it needs root or user namespaces"))


def two_machines(number, out, side, *flags):
    """Step `number` on two one-process nodes; the second sees an empty tmpfs at `out` and leaves
    its weights-rank1.sha256 (if any) in `side`. Returns [(exit status, output)] of both."""
    port = free_port()

    def node(rank):
        return [BIN / "torchrun", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
                "--master_addr=127.0.0.1", f"--master_port={port}", script(number), *flags,
                "--out-dir", out]

    side.mkdir(parents=True, exist_ok=True)
    alone = (f"mount -t tmpfs tmpfs {shlex.quote(str(out))} && {shlex.join(map(str, node(1)))}; "
             f"status=$?; cp {shlex.quote(str(out))}/weights-rank1.sha256 "
             f"{shlex.quote(str(side))}/ 2>/dev/null; exit $status")
    jobs = [subprocess.Popen([str(c) for c in command], env=env(DS_ACCELERATOR="cpu"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for command in (node(0), ["unshare", "-m", "bash", "-c", alone])]
    return [(job.returncode, output)
            for job, output in ((job, job.communicate(timeout=300)[0]) for job in jobs)]


@pytest.mark.parametrize("number", [4, 7], ids=["04-ddp", "07-apex"])
def test_a_rank_without_the_checkpoint_resumes_what_rank_0_sends(number, data, run04, tmp_path):
    out = as_after_epoch(run04[0], tmp_path / "out", 1)
    ends = two_machines(number, out, tmp_path / "rank1", *data, *EPOCHS, *DDP_ARGS,
                        "--resume", "auto")
    assert [status for status, _ in ends] == [0, 0], ends
    assert "resumed from epoch 1 (written by 04_cifar10_ddp)" in ends[0][1], ends[0][1]
    assert digests(out) | digests(tmp_path / "rank1") == digests(run04[0]), (
        digests(out), digests(tmp_path / "rank1"), digests(run04[0]))


@pytest.mark.parametrize("number", [5, 8], ids=["05-deepspeed", "08-fsdp"])
def test_a_rank_that_cannot_see_a_per_rank_checkpoint_stops_every_rank_in_one_line(
        number, request, data, tmp_path):
    """05: test_05_deepspeed.py's ZeRO-3 run's epoch 1; 08: run08's."""
    source, kind = request.getfixturevalue("zero3" if number == 5 else "run08")[0], "DCP"
    if number == 5:
        kind = "DeepSpeed"
    out = as_after_epoch(source, tmp_path / "out", 1)
    ends = two_machines(number, out, tmp_path / "rank1", *data, "--epochs", "2", "--amp", "off",
                        "--resume", "auto")
    line = f"rank(s) 1 cannot see {out}"
    for status, output in ends:
        # torchrun's report of the failed process (its Root Cause) names our one line
        assert status != 0 and not OUR_FRAMES.search(output), output
        assert line in output.partition("Root Cause")[2] and f"the {kind} checkpoint" in output, (
            output)
