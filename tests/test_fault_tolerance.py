"""When a process dies: no hangs, a clear verdict from the launcher, and restarts that resume.

The kill is a real SIGKILL of one worker process, found below the real launcher.
"""

import re
from types import SimpleNamespace

import pytest

from common import checkpoint
from helpers import (BIN, DDP_ARGS, EPOCHS, REPO, digests, kill_rank_after_epoch_1, launch_command,
                     metrics, script, start)

# deepspeed's launcher polls its ranks once a second and exits with the status of the first failed
# one it finds: the killed rank's -9, or 2 where the other rank noticed first and stopped with our
# line. The command line it prints is always that of its last rank, here rank 1, whichever failed
# (deepspeed/launcher/launch.py).
KILLED = r"sigkill_handler\] \[.*'--local_rank=1'.*\] exits with return code = "
DEEPSPEED_VERDICT = rf"{KILLED}-9|stopping: another rank stopped[\s\S]*{KILLED}2"


# launcher, step, what the launcher says about the dead rank (rank 1, killed by signal 9)
DEAD_RANK = [
    ("torchrun", 4, r"rank      : 1 \(local_rank: 1\)\s+exitcode  : -9"),
    ("legacy", 7, r"rank      : 1 \(local_rank: 1\)\s+exitcode  : -9"),
    ("horovodrun", 6, r"The first process to do so was:\s+Process name: 1\s+Exit code: 137"),
    ("deepspeed", 5, DEEPSPEED_VERDICT),
]


@pytest.mark.parametrize("launcher,number,verdict", [
    pytest.param(*case, id=case[0]) if list(REPO.glob(f"{case[1]:02d}_*.py"))
    else pytest.param(*case, id=case[0], marks=pytest.mark.skip(reason="script not written yet"))
    for case in DEAD_RANK])
def test_a_dead_rank_ends_the_job_quickly(tmp_path, small_data, launcher, number, verdict):
    """The launcher notices the killed worker, stops the others and exits non-zero, naming the rank
    (deepspeed: the status of the first failed rank it polls, see DEEPSPEED_VERDICT): nothing waits
    forever on a collective."""
    job = start([*launch_command(launcher, 2, number), *small_data, "--epochs", "50",
                 "--out-dir", tmp_path])
    # 05 writes its engine's folders only, each complete once rank 0's position.json is in it.
    pattern, own = "checkpoint-epoch*.pt", None
    if number == 5:
        pattern, own = "ds_checkpoints/epoch*/position.json", "ds_checkpoints"
    status, output, seconds = kill_rank_after_epoch_1(job, tmp_path, rank=1, pattern=pattern)
    assert status != 0
    assert re.search(verdict, output), output[-3000:]
    assert seconds < 60, f"took {seconds:.0f} s to give up"
    args = SimpleNamespace(resume="auto", out_dir=str(tmp_path), arch="cnn")
    found = checkpoint.find(args, own=own)
    assert checkpoint.resume(found)[0] >= 1, "the good checkpoint survives"


def test_04_torchrun_restarts_and_resumes_to_the_same_weights(tmp_path, data, run04):
    """torchrun --max-restarts restarts all workers after one is killed; --resume auto picks up the
    newest checkpoint, and the run ends bit-identical to one that was never interrupted.
    Restarts need the c10d rendezvous (--standalone, or --rdzv-backend=c10d on several machines):
    with the static one (--master_port) the restarted ranks read the dead attempt's gloo addresses.
    The c10d rendezvous shares its store with the workers by default, and there too a restarted rank
    can read the dead attempt's addresses (pytorch#135712, #167288): 1 run in 3 here used up its
    restarts on "Connection refused" or hung. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every
    attempt its own store (10 of 10)."""
    launcher = start([BIN / "torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=3",
                      script(4), "--dist-timeout", "45", *data, *EPOCHS, *DDP_ARGS,
                      "--out-dir", tmp_path, "--resume", "auto"],
                     TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    status, output, _ = kill_rank_after_epoch_1(launcher, tmp_path, rank=1, timeout=240)
    assert status == 0, output[-4000:]
    assert "no checkpoint in" in output and "resumed from epoch 1" in output
    assert [row["epoch"] for row in metrics(tmp_path)] == [1, 2]
    assert digests(tmp_path) == digests(run04[0])
