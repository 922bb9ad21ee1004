"""The recipes of docs/debugging.md, each on a step with a fault injected from outside
(scripts/inject_fault.py; the steps have no fault switches), through torchrun: each names the rank
and the collective the page says it names. And every rank's timing in metrics.jsonl, read from the
shared runs."""
import contextlib
import re
import signal

import psutil
import pytest

from helpers import (BIN, DDP_ARGS, PYTHON, REPO, Output, free_port, metrics, rank_process, run,
                     script, start)

INJECT = REPO / "scripts" / "inject_fault.py"
# Not anchored to the line's start: another process's output (a DataLoader warning) may share
# the line.
PROFILE_LINE = (r"profile rank {rank}: {steps} steps, [\d.]+ ms each: compute (\d+)%, "
                r"communication (\d+)%, data (\d+)%, other (\d+)% \(trace: ([^)\s]+)\)")


def injected(fault, number, *args):
    """torchrun --nproc_per_node=2 scripts/inject_fault.py FAULT <step> ARGS,
    as docs/debugging.md runs it."""
    return [BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", INJECT, fault,
            script(number), *args]


def shares(output, rank, steps):
    line = re.search(PROFILE_LINE.format(rank=rank, steps=steps), output, re.M)
    assert line, output
    return dict(zip(("compute", "communication", "data", "other"), map(int, line.groups()[:4])))


@pytest.mark.parametrize("fixture", ["run04", "run06", "run08"])
def test_every_epoch_row_holds_every_ranks_timing(fixture, request):
    """Each epoch's row: each rank's seconds in the loop, waiting for data and waiting for a later
    rank (gathered at the end of the epoch); 06 accumulates 2 passes per step (the arrival is the
    last pass's)."""
    out = request.getfixturevalue(fixture)
    out = out[0] if isinstance(out, tuple) else out
    for row in metrics(out):
        ranks = row["ranks"]
        assert (sorted(ranks) == ["data_s", "train_s", "wait_s"]
                and all(len(v) == 2 for v in ranks.values())), ranks
        for train, data, wait in zip(ranks["train_s"], ranks["data_s"], ranks["wait_s"]):
            assert 0.5 * row["epoch_seconds"] < train <= row["epoch_seconds"] + 0.5, (row, ranks)
            assert 0 <= data < train and 0 <= wait < train, ranks


def test_a_slow_rank_is_named_in_the_epoch_line_and_shows_in_the_profile(tmp_path, small_data):
    """Rank 1 sleeps 0.25 s before each optimizer step. The epoch line names it (rank 0 waited for
    it, rank 1 for nobody); --profile shows its sleep as "other" and rank 0's wait as
    "communication". The trace asks for more steps than the epoch has: the epoch's end cuts it (10
    steps: the 7 after the first 3)."""
    output = run(injected("slow-rank", 4, *small_data, *DDP_ARGS, "--batch-size", "16",
                          "--epochs", "1", "--profile", "100", "--out-dir", tmp_path)).output
    slow, other = shares(output, 1, 7), shares(output, 0, 7)
    assert slow["other"] >= 15 and other["other"] < slow["other"] / 2, (slow, other)
    assert other["communication"] >= 15 and other["communication"] > 1.5 * slow["communication"], (
        slow, other)
    assert re.search(r"^epoch   1/1 .* slowest rank 1: [\d.]+ s of its own, "
                     r"the median rank [\d.]+ s \(", output, re.M)
    (row,) = metrics(tmp_path)
    assert row["ranks"]["wait_s"][0] > 0.8 * 10 * 0.25 and row["ranks"]["wait_s"][1] < 0.5, (
        row["ranks"])


def test_a_starved_input_pipeline_shows_as_data_and_more_workers_feed_it(tmp_path, small_data):
    """Every rank's data set takes 10 ms per image, read in the training process (--workers 0): most
    of each step waits for data, on both ranks, and nobody is named slowest. With 8 loader workers
    the wait mostly goes: in the traced steps, and in the second epoch's data_s (the first epoch's
    is mostly the 8 workers' start from the forkserver; an epoch lasts about a second, too short to
    hold its ranks' timing to 20%)."""
    shown = {}
    for workers, epochs in ((0, 1), (8, 2)):
        output = run(injected("slow-data", 4, *small_data, *DDP_ARGS, "--batch-size", "16",
                              "--epochs", epochs, "--profile", "5", "--workers", str(workers),
                              "--out-dir", tmp_path / str(workers))).output
        shown[workers] = [shares(output, rank, 5)["data"] for rank in (0, 1)]
        row = metrics(tmp_path / str(workers))[-1]
        shown[workers] += row["ranks"]["data_s"] + [
            data / train for data, train in zip(row["ranks"]["data_s"], row["ranks"]["train_s"])]
        # starved alike (the fed epoch is too short to ask)
        assert workers or "slowest rank" not in output, output
    # profile shares (%), data_s / train_s
    assert min(shown[0][:2]) >= 30 and min(shown[0][4:]) >= 0.3, shown
    # Fed: the traced steps and the second epoch barely wait
    assert (max(shown[8][:2]) < min(shown[0][:2]) / 2
            and max(shown[8][2:4]) < min(shown[0][2:4]) / 2), shown


def finish(output, stuck):
    """Rank 0 has given up: end the stuck rank (torchrun would give it 30 s)
    and return the whole output."""
    with contextlib.suppress(psutil.NoSuchProcess):
        stuck.kill()
    output.job.wait(timeout=60)
    output.thread.join(10)
    return output.text


def py_spy_dump(process, frame, timeout=30):
    """`py-spy dump` of a process, repeated until its stack holds `frame`."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        dump = run([BIN / "py-spy", "dump", "--pid", process.pid]).output
        if frame in dump:
            return dump
        assert time.monotonic() < deadline, dump
        time.sleep(0.5)


def test_a_stuck_rank_is_found_by_py_spy_and_the_flight_recorder(tmp_path, data):
    """Rank 1 stops for good before its 5th optimizer step. py-spy shows where each rank is (rank 1
    in the fault, rank 0 in DDP's broadcast before the forward); the flight recorder, dumped on
    SIGUSR2, read by torchfrtrace, names the collective rank 1 never joined; after --dist-timeout
    rank 0 stops with one line."""
    launcher = start(injected("stuck-rank", 4, *data, *DDP_ARGS, "--epochs", "1",
                              "--dist-timeout", "14", "--out-dir", tmp_path / "out"),
                     TORCH_FR_BUFFER_SIZE="2000", FR_DIR=tmp_path / "fr")
    try:
        output = Output(launcher)
        output.until(r"^rank 1: stuck")
        ranks = [rank_process(launcher, rank) for rank in (0, 1)]
        # rank 0 may still be on its way there
        dumps = [py_spy_dump(ranks[0], "DistributedDataParallel._sync_buffers"),
                 py_spy_dump(ranks[1], "faulty_step (inject_fault.py")]
        assert "faulty_step" not in dumps[0], dumps[0]
        for rank in ranks:
            rank.send_signal(signal.SIGUSR2)
        # each line is one write (scripts/inject_fault.py): never shared
        output.until(r"^rank 0: flight recorder written[\s\S]*^rank 1: flight|"
                     r"^rank 1: flight recorder written[\s\S]*^rank 0: flight")
        analysis = run([BIN / "torchfrtrace", tmp_path / "fr", "-p", "rank"]).output
        assert re.search(r"Not all ranks joining collective, sequence number: \d+", analysis), (
            analysis)
        assert ("collective: gloo:broadcast" in analysis
                and "missing ranks: {1}" in analysis), analysis
        assert "_sync_buffers" in analysis, "the stack of the collective that hangs"
        output.until(r"error: a collective timed out", timeout=90)
        output = finish(output, ranks[1])
    finally:
        launcher.kill()
    assert re.search(r"^\[rank 0\] error: a collective timed out \(Timed out waiting 14000ms for "
                     r"\w+ operation to complete\): another rank is stuck or skipped it; "
                     r"docs/debugging.md finds which$", output, re.M)
    between = output.split("rank 1: stuck")[1].split("error: a collective timed out")[0]
    assert "Traceback" not in between


def test_a_rank_that_never_arrives_is_named_by_a_monitored_barrier(tmp_path, data):
    """Every rank meets the others in monitored_barrier before each optimizer step; rank 1 stops for
    good before its 5th: rank 0 names it after the barrier's timeout (5 s), in one line."""
    launcher = start(injected("barrier", 4, *data, *DDP_ARGS, "--epochs", "1",
                              "--out-dir", tmp_path), BARRIER_TIMEOUT="5")
    try:
        stuck, output = rank_process(launcher, 1), Output(launcher)
        output.until(r"error: a collective timed out", timeout=120)
        output = finish(output, stuck)
    finally:
        launcher.kill()
    assert re.search(r"^\[rank 0\] error: a collective timed out \(\[Rank 0\]: Ranks 1 failed "
                     r"to pass monitoredBarrier in 5000 ms\)", output, re.M), output


def test_a_collective_only_one_rank_makes_is_caught_by_detail_debug(tmp_path, data):
    """Rank 1 makes an all-reduce of its own; TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective
    against the other ranks' first, so both ranks stop at once, naming both collectives (step 08:
    under DETAIL, DDP's constructor crashes in torch 2.13 on gloo, docs/debugging.md)."""
    proc = run(injected("extra-collective", 8, *data, *DDP_ARGS, "--epochs", "1",
                        "--out-dir", tmp_path),
               check=False, timeout=120, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    assert proc.returncode != 0
    for me, other in ((1, 0), (0, 1)):
        seen_by_1 = ("ALLREDUCE, TensorShape=[1]", "_ALLGATHER_BASE")
        mine, theirs = seen_by_1 if me else ("_ALLGATHER_BASE", "ALLREDUCE")
        pattern = (rf"RuntimeError: Detected mismatch between collectives on ranks. Rank {me} is "
                   rf"running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
                   rf"OpType={re.escape(mine)}.*but Rank {other} is running collective: "
                   rf"CollectiveFingerPrint\(SequenceNumber=\d+, OpType={re.escape(theirs)}")
        assert re.search(pattern, proc.output), proc.output


def test_a_bug_in_the_loop_ends_the_run_with_its_traceback_instead_of_hanging(tmp_path, data):
    """An exception the step does not expect (here: raised in the 2nd optimizer step) prints its
    traceback and exits 1. With DataLoader workers running (they block SIGTERM, common/preempt.py),
    an uncaught exception used to keep them alive, and the process waited for them at exit
    forever."""
    proc = run([PYTHON, INJECT, "exception", script(1), *data, "--workers", "1", "--epochs", "1",
                "--out-dir", tmp_path], check=False, timeout=90, FAULT_RANK="0")
    assert proc.returncode == 1, proc.output
    assert "Traceback" in proc.output and proc.output.rstrip().endswith(
        "ValueError: a bug in the optimizer step (scripts/inject_fault.py)"), proc.output
