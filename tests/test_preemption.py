"""Preemption: SIGTERM (or SIGUSR1) to a whole job, as Slurm sends it, ends every step after the
current optimizer step with a checkpoint and exit status 75; `--resume auto` then finishes with
weights bit-identical to an uninterrupted run. (The uninterrupted 04 run also serves a checkpoint of
other batch arithmetic that 01 continues.)

The signal goes to every process of the job (the launcher, every rank and their DataLoader workers),
which is what Slurm does to a job step; to step 05 it goes to the deepspeed launcher's own process
alone, which the ranks watch (a signal to that process ended it alone before). It is sent once the
run prints its start line, so it lands part-way through its one epoch (small batches: 40 optimizer
steps per rank or more, and a stop lands within 24), and the test demands a part-way checkpoint. """
import contextlib
import signal
from pathlib import Path

import psutil
import pytest

from common import checkpoint
from helpers import (EXIT_GRACE, Output, assert_01_continues_by_progress,
                     assert_board_matches_metrics, board, checkpoint_epoch, digests, launch_command,
                     load_checkpoint, metrics, once, run, start)

# (step, launcher, processes): 01, 04 (the loop every later step shares, under torchrun), 05 (the
# engine saves on every rank, under its own launcher), 06 (its own collectives, under horovodrun),
# 07 (04's loop with its own backends) and 08 (sharded weights, DCP checkpoints). 02 and 03 run 01's
# code for this; tests/test_slurm.py repeats 04 under a real Slurm.
CASES = [(1, "python", 1), (4, "torchrun", 2), (5, "deepspeed", 2), (6, "horovodrun", 2),
         (7, "torchrun", 2), (8, "torchrun", 2)]
# 160 (80 per rank) steps/epoch
SETUP = ["--epochs", "1", "--batch-size", "8", "--amp", "off", "--workers", "1"]
# 04 to 08, stopped and resumed, must all end where one uninterrupted run of 04 does, batch-norm
# statistics included: the small cnn with batch norm (buffers each step syncs its own way, train and
# eval modes), NCHW weights and batches (05's and 08's weights are NCHW), 2 accumulated passes of 8
# images per optimizer step (so that each step's accumulation is held to 04's bits too: a loss
# divided twice, a gradient reduced on every pass), and 05 in ZeRO stage 1, which adds up
# accumulated gradients as DDP does. (ZeRO 2 reduces each pass's gradients as they come: other bits
# with --grad-accum; without it, it is held to 04's bits on tests/test_learning_curves.py's runs.)
# 40 optimizer steps per rank
DISTRIBUTED = ["--arch", "cnn_bn", "--no-channels-last", "--grad-accum", "2"]
SHARED = {4: DISTRIBUTED, 5: [*DISTRIBUTED, "--zero-stage", "1"], 6: DISTRIBUTED, 7: DISTRIBUTED,
          8: DISTRIBUTED}


def command(number, launcher, nproc, data, out, *extra):
    return [*launch_command(launcher, nproc, number), *data, *SETUP, *SHARED.get(number, []),
            "--out-dir", out, *extra]


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """uninterrupted(number) -> the out-dir of the uninterrupted run a stopped run of that step must
    end at: 01's own, one of 04 for 04 to 08. Made once, when a test first asks for it. No loader
    workers (the batches do not depend on them): fewer forks of a threaded process, which CPython
    3.11 can deadlock in (a DataLoader worker hung once in os.fork's child-side clean-up here)."""
    def reference(number):
        number = 4 if number in SHARED else number
        (launcher, nproc), = [(la, n) for num, la, n in CASES if num == number]

        def make(out):
            run(command(number, launcher, nproc, data, out, "--workers", "0"))
            return out
        return once(tmp_path_factory, f"uninterrupted{number:02d}", make)
    return reference


@pytest.mark.parametrize("number,launcher,nproc", CASES,
                         ids=[f"{n:02d}-{la}" for n, la, _ in CASES])
def test_a_stop_signal_saves_where_it_stopped_and_resumes_exactly(tmp_path, data, uninterrupted,
                                                                  number, launcher, nproc):
    if number == 6:
        pytest.importorskip("horovod.torch",
                            reason="Horovod not built (scripts/install_horovod.sh)")
    reference, stopped = uninterrupted(number), tmp_path / "stopped"

    job = start(command(number, launcher, nproc, data, stopped))
    output = Output(job)
    output.until("steps/epoch")  # the start line: every rank catches the signals by now
    # `#SBATCH --signal=USR1@120`; scancel, preemption
    sig = signal.SIGUSR1 if number == 1 else signal.SIGTERM
    top = psutil.Process(job.pid)
    below = top.children(recursive=True)
    # Like Slurm: every process of the job step. 05: the deepspeed launcher's own process alone
    # (kill PID, `timeout`, a container stop), which ends it alone: the ranks watch it (05's
    # launcher_pid, preempt.Stop(watch=...)) and stop as on the signal itself.
    targets = [top] if launcher == "deepspeed" else [*below, top]
    for process in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)
    # Every process ends within seconds of rank 0's last line (its DataLoader workers, which keep
    # the signals blocked, too: a worker left at exit would hold its rank forever,
    # tests/test_exit.py).
    output.ends_within("stopped after step", EXIT_GRACE)
    _, alive = psutil.wait_procs(below, timeout=EXIT_GRACE)
    assert not alive, [" ".join(process.cmdline())[:120] for process in alive]
    output.thread.join(10)
    text = output.text
    if launcher == "deepspeed":  # launch.py reports the ranks' status to a runner that is gone
        assert "exits with return code = 75" in text, text
    # launchers: their own code
    assert job.returncode == 75 if launcher == "python" else job.returncode != 0, text
    assert "Traceback" not in text.split("stopped after step")[0], text
    assert "stopped after step" in text, text
    # 05 and 08 write their own format only: an engine or DCP folder, its position.json beside.
    pattern, read = "checkpoint-epoch0000-step*.pt", load_checkpoint
    if number in (5, 8):
        folder = checkpoint.ENGINE_DIR if number == 5 else checkpoint.DCP_DIR
        pattern, read = f"{folder}/epoch0000-step*", checkpoint.own_header
    part_way = sorted(stopped.glob(pattern))
    assert len(part_way) == 1, (sorted(p.name for p in stopped.iterdir()), text)
    state = read(part_way[0])
    row = state["metrics"]
    assert (state["epoch"] == 0 and row["partial"] and row["epoch"] == 1
            and 0 < row["steps"] < row["of_steps"])
    assert state["global_step"] == row["steps"]
    assert metrics(stopped) == [], "metrics.jsonl holds finished epochs only"

    resumed = run(command(number, launcher, nproc, data, stopped, "--resume", "auto"))
    assert f"step {row['steps']} of {row['of_steps']} in epoch 1" in resumed.output, resumed.output
    # only rank 0 reads the checkpoint; rank 1 gets everything from it by broadcast
    if launcher == "horovodrun":
        line = (f"[0]<stdout>:resumed from step {row['steps']} of {row['of_steps']} in epoch 1 "
                "(written by 06_cifar10_horovod)")
        assert line in resumed.output and "[1]<stdout>:resumed" not in resumed.output, (
            resumed.output)
    assert digests(stopped) == digests(reference) and len(set(digests(reference).values())) == 1
    (got,), (want,) = metrics(stopped), metrics(reference)
    assert got["test_acc"] == want["test_acc"] and got["test_loss"] == want["test_loss"]
    # the epoch's loss sums both parts
    assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-9)
    assert got["images"] == want["images"] == 1280
    assert not list(Path(stopped).glob(pattern.replace("0000", "*"))), (
        "a finished epoch supersedes the part-way one")
    # TensorBoard shows the epoch once, with the losses of both parts, as the uninterrupted run's.
    assert_board_matches_metrics(stopped)
    assert board(stopped)["step/train_loss"] == board(reference)["step/train_loss"]


def test_a_04_checkpoint_of_other_batch_arithmetic_continues_in_01_by_progress(uninterrupted, data,
                                                                                tmp_path):
    """The uninterrupted 04 run above (2 processes x 8 images x 2 passes, 40 steps per epoch, 1
    epoch), continued by 01 at batch 64 (20 steps per epoch) for a second epoch: the schedule is
    placed by progress (and stretched to 2 epochs); placed at the raw step 40 of a 40-step schedule
    it would train at learning rate 0 and the weights would not move."""
    assert_01_continues_by_progress(checkpoint_epoch(uninterrupted(4), 1),
                                    [*data, "--arch", "cnn_bn"], tmp_path)


def looks_at_the_flag(steps, grad_accum=1, signal_at=None):
    """The steps' training loop over `steps` optimizer steps
    (`if last_pass and stop.requested(...): break`), with a Stop whose agreement is counted (and
    answers at once); a signal noted at pass `signal_at`.
    Returns (passes made, agreements started, stop)."""
    from common.preempt import Stop

    started = []

    def agree(flag):
        started.append(int(flag.item()))
        return lambda: None

    stop, passes = Stop(agree=agree), 0
    for step in range(steps * grad_accum):
        passes += 1
        if passes == signal_at:
            stop.signal = "SIGTERM"
        last_pass = (step + 1) % grad_accum == 0
        if last_pass and stop.requested((step + 1) // grad_accum):
            break
    return passes, started, stop


def test_the_stop_flag_costs_no_collective_per_step():
    """The loop looks at the stop flag every CHECK_EVERY optimizer steps, and each look only starts
    an agreement that the next look reads (by then it has long arrived): no step waits on a
    collective, and a signal ends the epoch within 2 x CHECK_EVERY steps, after a whole
    accumulation group."""
    from common.preempt import CHECK_EVERY

    passes, started, stop = looks_at_the_flag(100)
    assert passes == 100 and len(started) == 100 // CHECK_EVERY and started == [0] * len(started)
    passes, started, stop = looks_at_the_flag(100, grad_accum=2, signal_at=7)  # during the 4th step
    # one look started the agreement that saw it, the next one read it
    assert started == [1], started
    assert passes == 2 * 2 * CHECK_EVERY, passes
    assert stop.requested() and stop.exit_status() == 75


def test_rank_0_shows_the_epoch_s_optimizer_steps_as_a_progress_bar_on_a_terminal(monkeypatch):
    """On a terminal rank 0 draws a bar of the epoch's optimizer steps (a resumed epoch starts at
    the steps done); in a log file, or on another rank, nothing."""
    import io
    import time
    from types import SimpleNamespace

    import torch

    from common.metrics import Meter

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for rank, stream, shown in (("0", Terminal(), True), ("1", Terminal(), False),
                                ("0", io.StringIO(), False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr("sys.stderr", stream)
        meter = Meter(SimpleNamespace(grad_accum=2, out_dir=".", profile=0, loss_every=10), 5)
        meter.start({"steps": 1, "of_steps": 5, "images": 4}, 1)
        for _ in range(4):  # 2 optimizer steps of 2 passes
            meter.batch_in_hand()
            time.sleep(0.11)  # tqdm redraws at most every 0.1 s
            meter.batch_done()
        meter.row(torch.tensor([8.0, 8.0], dtype=torch.float64))
        assert ("3/5" in stream.getvalue() and "4/5" not in stream.getvalue()) == shown, (
            rank, stream.getvalue())


@pytest.mark.parametrize("grad_accum,passes", [(1, 4), (2, 7)])
def test_every_ranks_timing_is_gathered_by_one_max_at_the_end_of_the_epoch(monkeypatch, grad_accum,
                                                                           passes):
    """metrics.Meter as rank 0 of 2 over 4 optimizer steps (with --grad-accum 2, the last of them
    short: 1 pass), its timing() gathered with rank 1's by a max (the steps' all-reduce): rank 1 had
    each step's last batch 0.5 s after rank 0, spent 1.5 s waiting for data and 10 s in the loop.
    Rank 0 then waited 2 s for it, rank 1 for nobody; each rank's slots hold its own figures."""
    from types import SimpleNamespace

    import torch

    from common.metrics import Meter

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    meter = Meter(SimpleNamespace(grad_accum=grad_accum, out_dir=".", profile=0, loss_every=10), 4)
    meter.start(None, 0)
    for _ in range(passes):
        meter.batch_in_hand()
        meter.batch_done()
    row = meter.timing()
    other, steps = torch.zeros_like(row), len(row) - 6
    other[:steps] = row[:steps] + 0.5
    other[steps + 3:] = torch.tensor([10.0, 1.5, row[:steps].sum().item() + 0.5 * steps],
                                     dtype=torch.float64)
    ranks = meter.row(torch.tensor([8.0, 4.0], dtype=torch.float64),
                      torch.maximum(row, other))["ranks"]
    assert (ranks["train_s"][1] == 10.0 and ranks["data_s"][1] == 1.5
            and 0 <= ranks["data_s"][0] <= ranks["train_s"][0])
    assert ranks["wait_s"] == [2.0, 0.0], ranks


@pytest.mark.parametrize("train,wait,named", [
    ([10, 10, 10], [0, 0, 3], None),  # one rank waited: the others are not slow, it is fast
    ([10, 10, 10, 10], [4, 4, 4, 0], 3),  # own time 10 s against the median 6 s
    ([10, 10], [2, 0], 1),  # 10 s against 8 s (of two, the lower): 25% over
    ([10, 10], [1.5, 0], None),  # 10 s against 8.5 s: 18% over
    ([10, 10], [0, 1.8], 0),  # 10 s against 8.2 s: 22% over
])
def test_the_epoch_line_names_a_rank_over_the_median_by_more_than_20_percent(train, wait, named):
    from common.metrics import slowest_rank

    line = slowest_rank({"train_s": train, "data_s": [0.5] * len(train), "wait_s": wait})
    if named is None:
        assert line == "", line
    else:
        assert line.startswith(f"  slowest rank {named}: 10.0 s of its own, the median rank "), line
        assert line.endswith("(0.5 s of it waiting for data)"), line


def test_a_part_way_epoch_continues_after_the_same_fraction():
    """A run stopped after 10 of 20 steps per epoch, continued with 40 steps per epoch (half the
    batch): the sampler starts at step 20 of the epoch's order, and loads none of the samples
    before it."""
    import torch

    from common.data import EpochSampler

    order = torch.utils.data.DistributedSampler(range(160), num_replicas=1, rank=0, seed=0)
    sampler = EpochSampler(order, 4)  # 40 steps of 4
    assert sampler.set_epoch(1, {"epoch": 1, "steps": 10, "of_steps": 20}) == 20
    order.set_epoch(1)
    assert list(sampler) == list(order)[80:] and len(sampler) == 80
    assert sampler.set_epoch(2) == 0 and len(sampler) == 160 and list(sampler) == list(order)
