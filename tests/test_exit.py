"""Every run exits: within seconds of its last line, with DataLoader workers, for any epoch count.

A run's DataLoader workers keep SIGTERM blocked (a Slurm signal to every process must not kill them,
common/preempt.py), and multiprocessing's exit handler ends such children with SIGTERM and waits for
them: a loader still alive at exit made it wait forever. Whether it was alive depended on when the
garbage collector ran: step 01 with 2 workers hung after 3 epochs and exited after 2 or 4. The exit
now ends them with SIGKILL first, and a process still exiting common.cli.EXIT_WAIT seconds later (a
thread or child that does not end) ends with one line and exit status 1. (Stopped by SIGTERM with
workers: tests/test_preemption.py times that exit the same way.)
"""
import os

import pytest
import torch

from helpers import EXIT_GRACE, PYTHON, REPO, Output, as_typed, readme_command, start

# (step, epochs): 01 (whose loop 02 and 03 share) with 3 epochs, where it hung, and the
# distributed steps under their README commands, with 2, 3 or 4 epochs (05's and 07's loaders are
# 04's; 05's launcher's exits: tests/test_preemption.py and tests/test_fault_tolerance.py; 08 waits
# for its last background save).
CASES = [(1, 3), (4, 3), (6, 2), (8, 4)]


@pytest.mark.parametrize("number,epochs", CASES, ids=[f"{n:02d}-{e}epochs" for n, e in CASES])
def test_a_run_with_loader_workers_ends_within_seconds_of_its_last_epoch(number, epochs, tiny_data,
                                                                         tmp_path):
    cmd, port = as_typed(readme_command(number), *tiny_data, "--arch", "cnn", "--workers", "2",
                         "--epochs", epochs, "--batch-size", "2", "--out-dir", tmp_path)
    # A user's process: without the harness's speed-up (tests/harness/sitecustomize.py).
    output = Output(start(cmd, PET_MASTER_PORT=port, DS_ACCELERATOR="cpu", SUITE_HARNESS="off"))
    # horovodrun: [0]<stdout>:
    status, seconds = output.ends_within(rf"(^|[]:>])epoch +{epochs}/{epochs} ", EXIT_GRACE)
    assert (status == 0 and "Traceback" not in output.text
            and "error:" not in output.text), output.text
    print(f"step {number:02d}, {epochs} epochs: ended {seconds:.1f} s after its last epoch line")


HUNG = """
import multiprocessing, signal, sys, threading, time
from common import cli, preempt

cli.EXIT_WAIT = 3
def forever():
    time.sleep(600)

@cli.exits_cleanly
def main(case):
    preempt.Stop()  # blocks SIGTERM, as in every step, before the loaders start their workers
    if case == "worker":  # a daemonic child, as a DataLoader's persistent worker is, still running at exit
        multiprocessing.Process(target=forever, daemon=True).start()
    if case == "child":  # a child that nothing ends: multiprocessing's exit handler waits for it
        multiprocessing.Process(target=forever).start()
    if case == "thread":  # a thread that never ends: the exit waits for it
        threading.Thread(target=forever).start()
    print("trained", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
"""  # noqa: E501 (a script of its own: its lines as written)


@pytest.mark.parametrize("case", ["worker", "child", "thread"])
def test_an_exit_that_would_hang_ends_with_one_line_and_status_1(case, tmp_path):
    """A daemonic child that blocks SIGTERM (a loader's worker) is ended at exit, whenever the
    collector runs; whatever else holds the exit (a child or a thread that does not end) ends it 3 s
    in (EXIT_WAIT here)."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    output = Output(start([PYTHON, script, case], PYTHONPATH=REPO, SUITE_HARNESS="off"))
    status, seconds = output.ends_within("^trained", 10)
    errors = [line for line in output.text.splitlines() if line.startswith("error:")]
    assert "Traceback" not in output.text, output.text
    if case == "worker":
        assert status == 0 and not errors and seconds < 3, (seconds, output.text)
        return
    assert status == 1 and len(errors) == 1, output.text
    assert errors[0].startswith("error: this process was still exiting "
                                "3 s after its work ended"), errors[0]
    assert seconds >= 3 and (
        "1 child process" if case == "child" else "0 child process") in errors[0], errors[0]


def test_an_epoch_starts_and_ends_no_thread(monkeypatch):
    """Evaluation forks its DataLoader workers right after the training loop; a thread ending at
    that moment (tqdm started and ended one with every epoch's bar, even a hidden one) can leave the
    forked worker blocked for ever in CPython 3.11, and its rank with it: the intermittent hang of
    this suite until 2026-11-26. The epoch's meter, on every rank, on a terminal or not, starts no
    thread."""
    import io
    import threading
    from types import SimpleNamespace

    import torch

    from common.metrics import Meter

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for rank, stream in (("0", Terminal()), ("1", Terminal()), ("0", io.StringIO())):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr("sys.stderr", stream)
        before = threading.enumerate()
        meter = Meter(SimpleNamespace(grad_accum=1, out_dir=".", profile=0, loss_every=10), 2)
        meter.start(None, 0)
        for _ in range(2):
            meter.batch_in_hand()
            meter.batch_done()
            assert threading.enumerate() == before, (rank, threading.enumerate())
        meter.row(torch.tensor([2.0, 2.0], dtype=torch.float64))


class ParentOfTheWorker(torch.utils.data.Dataset):
    """Each sample: the process id of the worker's parent (a module-level class: it pickles)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.getppid()


def test_loader_workers_of_04_to_08_are_not_forks_of_their_rank(capsys):
    """The second hang (2026-11-29, the fresh clone's CI): a gloo thread of a rank frees a tensor
    that Python let go of before the collective's work ended (all_gather_object's), taking Python's
    runtime lock to do it; a DataLoader worker forked at that moment stopped for ever inside
    os.fork (CPython 3.11's PyOS_AfterFork_Child waiting for that lock, seen with gdb), and its
    rank waited for its first test batch. 04-08 start their workers from a forkserver: the workers'
    parent is not the rank, and a data set that cannot travel there pickled stops in one line."""
    import multiprocessing

    from common import cli, data

    for path in sorted(REPO.glob("0[4-8]_cifar10_*.py")):
        source = path.read_text()
        loaders = source[source.index("def build_loaders("):]
        assert loaders.index("data.workers_from_a_forkserver(") < loaders.index("DataLoader("), (
            path.name)
    before = multiprocessing.get_start_method()
    try:
        data.workers_from_a_forkserver()
        parents = {int(p) for batch in torch.utils.data.DataLoader(
            ParentOfTheWorker(), batch_size=2, num_workers=2) for p in batch}
        assert len(parents) == 1 and os.getpid() not in parents, (os.getpid(), parents)
        local = torch.utils.data.TensorDataset(torch.zeros(4))
        local.transform = lambda x: x
        with pytest.raises(AttributeError) as error:
            next(iter(torch.utils.data.DataLoader(local, num_workers=1)))
        with pytest.raises(SystemExit) as exit:
            cli.exits_cleanly(lambda: (_ for _ in ()).throw(error.value))()
        line = capsys.readouterr().err
        assert exit.value.code == 2 and line.count("\n") == 1 and "Traceback" not in line, line
        assert ("workers start from a forkserver" in line and "Can't pickle local object" in line
                and line.rstrip().endswith("or pass --workers 0")), line
    finally:
        multiprocessing.set_start_method(before, force=True)
