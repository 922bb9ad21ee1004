"""When a process dies: no hangs, a clear verdict from the launcher, and restarts that resume.

The kill is a real SIGKILL of one worker process, found below the real launcher.
"""
import pytest

from helpers import BIN, DDP_ARGS, EPOCHS, digests, free_port, kill_rank_after_epoch_1, metrics, script, start


def test_04_dead_rank_ends_the_job_quickly(tmp_path, data):
    """torchrun notices the dead worker, stops the other one and exits non-zero naming the rank."""
    launcher = start([BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", script(4), *data,
                      "--epochs", "50", "--out-dir", tmp_path])
    status, output, seconds = kill_rank_after_epoch_1(launcher, tmp_path, rank=1)
    assert status != 0
    assert "ChildFailedError" in output and "rank      : 1" in output and "Signal 9 (SIGKILL)" in output
    assert seconds < 60, f"took {seconds:.0f} s to give up"


def test_04_torchrun_restarts_and_resumes_to_the_same_weights(tmp_path, data, run04):
    """torchrun --max-restarts=1 restarts all workers after one is killed; --resume auto picks up the
    newest checkpoint, and the run ends bit-identical to one that was never interrupted.
    Restarts need the c10d rendezvous (--standalone, or --rdzv-backend=c10d on several machines): with
    the static one (--master_port) the restarted ranks read the dead attempt's gloo addresses."""
    launcher = start([BIN / "torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=1", script(4), *data, *EPOCHS, *DDP_ARGS, "--out-dir", tmp_path, "--resume", "auto"])
    status, output, _ = kill_rank_after_epoch_1(launcher, tmp_path, rank=1, timeout=240)
    assert status == 0, output[-4000:]
    assert "no checkpoint in" in output and "resumed from epoch 1" in output
    assert [row["epoch"] for row in metrics(tmp_path)] == [1, 2]
    assert digests(tmp_path) == digests(run04[0])
