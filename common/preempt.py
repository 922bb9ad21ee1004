"""Preemption: SIGTERM or SIGUSR1 ends a run after its current optimizer step, with a checkpoint to continue.

Slurm sends SIGTERM to every process of a job before it kills it (scancel, preemption, the time limit), and
`#SBATCH --signal=USR1@120` asks it for SIGUSR1 two minutes before the time limit (see slurm/). Stop() catches both:
the training loop asks `requested()` after every optimizer step. With several processes the ranks agree (a max over
ranks, on a small gloo group of their own, so no GPU waits for it) and all stop after the same step. The step then
saves where it stopped (checkpoint-epochNNNN-stepSSSSSS.pt) and exits with EXIT_REQUEUE, on which the batch scripts
requeue the job; `--resume auto` continues it exactly where it stopped.

Processes started after Stop() (DataLoader workers above all) inherit the two signals blocked: Slurm signals every
process of the job step, and a worker that died of it would take the training process down with it.
"""
import multiprocessing
import signal
import threading
from multiprocessing import resource_tracker

import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_REQUEUE = 75  # EX_TEMPFAIL ("try again later"): stopped on request with a checkpoint; requeue and resume


class Stop:
    """Catches SIGTERM and SIGUSR1 from now on. `agree(tensor)`: a max over ranks of a CPU int tensor (returning
    the result or reducing in place); default: torch.distributed's when a group of several processes is up."""

    def __init__(self, agree=None):
        self.signal = None  # the name of the first signal this process received
        self.stopped = False  # the ranks agreed to stop
        for sig in SIGNALS:  # threads started before now may take a signal: Python runs this handler for them
            signal.signal(sig, lambda signum, frame: self._note(signum))
        if multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):  # spawn, forkserver (step 06)
            resource_tracker.ensure_running()  # it unblocks SIGTERM when it starts: start it before the block below
        # This thread blocks them (inherited by threads and processes it starts); one thread of ours waits for them.
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        threading.Thread(target=self._wait, daemon=True, name="stop-signals").start()
        if agree is None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            group = torch.distributed.new_group(backend="gloo")  # CPU flags, also when the training group is nccl
            agree = lambda flag: torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX, group=group)  # noqa: E731
        self._agree = agree

    def _note(self, signum):
        self.signal = self.signal or signal.Signals(signum).name

    def _wait(self):
        while True:
            self._note(signal.sigwait(SIGNALS))

    def requested(self):
        """True once any rank received a signal; every rank must call it at the same points (it is collective)."""
        if not self.stopped:
            flag = torch.tensor([int(self.signal is not None)])
            agreed = self._agree(flag) if self._agree is not None else None
            self.stopped = bool((flag if agreed is None else agreed).item())
        return self.stopped

    def leave_line(self, stop_after=None):
        """What the run prints when it leaves early: on a signal, or after --stop-after epochs."""
        if not self.stopped:
            return f"stopping after {stop_after} epoch(s) as asked; continue with --resume auto"
        got = f"received {self.signal}" if self.signal else "another rank received SIGTERM/SIGUSR1"
        return f"{got}: checkpoint saved; exit {EXIT_REQUEUE} (a batch script requeues); continue with --resume auto"


def part_done(state):
    """{epoch: the row a run stopped part-way saved for the start of that epoch} from a checkpoint's state ({} if
    it was written at the end of an epoch)."""
    row = state.get("metrics") or {}
    return {row["epoch"]: row} if row.get("partial") else {}


def first_pass(part, passes, grad_accum):
    """Where a part-way epoch continues: after the passes the stopped run did. A run with another number of steps
    per epoch (batch size, processes) continues after the same fraction of the epoch (checkpoint.by_progress)."""
    if not part:
        return 0
    steps_now = passes // grad_accum
    return min(round(part["steps"] * steps_now / part["of_steps"]), steps_now - 1) * grad_accum
