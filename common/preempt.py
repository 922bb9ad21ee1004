"""Preemption and part-way epochs, kept out of the training loop: a stop flag, and each epoch's batches.

Slurm sends SIGTERM to every process of a job before it kills it (scancel, preemption, the time limit), and
`#SBATCH --signal=USR1@120` asks it for SIGUSR1 two minutes before the time limit (see slurm/). Stop() catches both.
Batches, which hands the training loop its batches, looks at the flag every CHECK_EVERY optimizer steps and ends the
epoch after that step once the ranks agree to stop: the loop itself never asks. The ranks agree with a max over ranks
on a small gloo group of their own (no GPU waits for it), started without waiting at one look and read at the next,
CHECK_EVERY steps later, by when it has long arrived: no step waits for a collective, and every rank stops after the
same step. The step then saves where it stopped (checkpoint-epochNNNN-stepSSSSSS.pt) and exits with EXIT_REQUEUE, on
which the batch scripts requeue the job; `--resume auto` continues it exactly where it stopped: Batches starts that
epoch after the steps already done (with other batch arithmetic: after the same fraction of the epoch).

Processes started after Stop() (DataLoader workers above all) inherit the two signals blocked: Slurm signals every
process of the job step, and a worker that died of it would take the training process down with it. At exit,
multiprocessing ends its daemonic children (the loaders' persistent workers) with SIGTERM and waits for them: blocked,
it would wait forever for a loader that the garbage collector has not freed yet. So Stop() also has the exit end them
with SIGKILL first, whenever the collector runs.
"""
import atexit
import contextlib
import os
import itertools
import multiprocessing
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker

import torch
from tqdm import tqdm

from .cli import UserError, processes, rank

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_REQUEUE = 75  # EX_TEMPFAIL ("try again later"): stopped on request with a checkpoint; requeue and resume
CHECK_EVERY = 8  # optimizer steps between two looks at the stop flag: a signal ends the epoch within 2 x this
ARRIVALS_FROM = 1.7e9  # Batches' arrival times count from here (2023-11), not 1970: sums of them keep their precision


def agree_by_torch_distributed():
    """agree() for Stop: an all-reduce (max) over every rank, on a gloo group of its own, started without waiting;
    returns what gives the result. None when there is no group of several processes."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    group = dist.new_group(backend="gloo")  # CPU flags, also when the training group is nccl

    def agree(flag, name=None):
        work = dist.all_reduce(flag, dist.ReduceOp.MAX, group=group, async_op=True)
        return lambda: (work.wait(), flag)[1]

    return agree


class Stop:
    """Catches SIGTERM and SIGUSR1 from now on. `agree(flag, name)`: starts a max over ranks of a CPU tensor (`name`:
    Horovod's for it) and returns a function that waits for it and returns the result (default: torch.distributed's,
    when a group is up)."""

    def __init__(self, agree=None, stop_after=None):
        self.signal = None  # the name of the first signal this process received
        self.stopped = False  # the ranks agreed to stop
        self.stop_after = stop_after  # --stop-after N: leave after N epochs of this run
        for sig in SIGNALS:  # threads started before now may take a signal: Python runs this handler for them
            signal.signal(sig, lambda signum, frame: self._note(signum))
        if multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):  # spawn, forkserver (step 06)
            resource_tracker.ensure_running()  # it unblocks SIGTERM when it starts: start it before the block below
        # This thread blocks them (inherited by threads and processes it starts); one thread of ours waits for them.
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        threading.Thread(target=self._wait, daemon=True, name="stop-signals").start()
        if not getattr(end_workers_at_exit, "registered", False):  # once; multiprocessing's exit handler runs after it
            atexit.register(end_workers_at_exit)
            end_workers_at_exit.registered = True
        self._agree = agree or agree_by_torch_distributed()
        self._pending = None  # the agreement started at the previous look

    def _note(self, signum):
        self.signal = self.signal or signal.Signals(signum).name

    def _wait(self):
        while True:
            self._note(signal.sigwait(SIGNALS))

    def requested(self, wait=False):
        """True once the ranks agreed that one of them received a signal. Collective: every rank calls it at the same
        points. It reads the agreement the previous call started (which has arrived by then) and starts the next;
        wait=True also waits for the one it starts (at the end of an epoch, where the ranks meet anyway)."""
        if self.stopped or self._agree is None:
            self.stopped = self.stopped or self.signal is not None
            return self.stopped
        if self._pending is not None:
            self.stopped, self._pending = bool(self._pending().item()), None
        if not self.stopped:
            self._pending = self._agree(torch.tensor([int(self.signal is not None)]))
            if wait:
                self.stopped, self._pending = bool(self._pending().item()), None
        return self.stopped

    def max_over_ranks(self, tensor, name):
        """The elementwise max over ranks of a CPU tensor, waited for (Batches' timings); None without a group of
        several processes. Collective."""
        return None if self._agree is None else self._agree(tensor, name)()

    def leave(self, epoch, start_epoch, epochs):
        """After epoch `epoch` (saved): True if the run leaves now, on a signal or after --stop-after epochs; rank 0
        says why. Collective, like requested()."""
        if epoch >= epochs or not (self.requested(wait=True) or self.stop_after and epoch - start_epoch >= self.stop_after):
            return False
        if rank() == 0:
            got = f"received {self.signal}" if self.signal else "another rank received SIGTERM/SIGUSR1"
            print(f"{got}: checkpoint saved; exit {EXIT_REQUEUE} (a batch script requeues); continue with --resume auto"
                  if self.stopped else f"stopping after {self.stop_after} epoch(s) as asked; continue with --resume auto",
                  flush=True)
        return True

    def exit_status(self):
        return EXIT_REQUEUE if self.stopped else 0


def end_workers_at_exit():
    """What multiprocessing's exit handler does to daemonic children (DataLoader workers), with SIGKILL instead of the
    SIGTERM they block. torch's SIGCHLD handler, which would call a loader's worker killed, goes first."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)


class Batches:
    """The batches of each epoch, for the training loop: `for images, labels in batches.epoch(n)`.

    Whole accumulation groups only (`grad_accum` passes per optimizer step). An epoch that a stopped run began goes on
    after the optimizer steps it did (with another number of steps per epoch, after the same fraction of it). The epoch
    ends early, after an optimizer step, once the ranks agreed to stop (Stop; None: never). A dataset with set_epoch()
    (ours: its augmentation) is told the epoch. Rank 0 shows a progress bar on a terminal. After the loop: `start` (its
    perf_counter), `steps` done of `of_steps`, `part`, the row the stopped run saved for this epoch (or None), and
    `ranks`, every rank's timing of the epoch (timings(); None in a single process)."""

    def __init__(self, loader, grad_accum, memory_format, stop, part_done=None, profile=None):
        self.loader, self.grad_accum, self.memory_format, self.stop = loader, grad_accum, memory_format, stop
        self.profile = profile  # metrics.Profile (--profile), or None
        self.part_done = part_done or {}  # {epoch: the row a stopped run saved} (checkpoint.part_done)
        self.passes = len(loader) // grad_accum * grad_accum
        self.of_steps = self.passes // grad_accum
        if not self.passes:
            raise UserError(f"{len(getattr(loader, 'dataset', loader))} training images are too few for an optimizer "
                            "step: lower --batch-size or --grad-accum")
        self.number, self.part, self.first, self.done, self.start = 0, None, 0, 0, 0.0
        self.data_seconds, self.arrivals, self.ranks = 0.0, [], None

    def epoch(self, number):
        self.number, self.part = number, self.part_done.get(number)
        steps = 0 if not self.part else min(round(self.part["steps"] * self.of_steps / self.part["of_steps"]),
                                            self.of_steps - 1)
        self.first = steps * self.grad_accum
        return self

    @property
    def steps(self):
        return self.done // self.grad_accum

    def __len__(self):
        return self.passes - self.first

    def __iter__(self):
        if hasattr(getattr(self.loader, "dataset", None), "set_epoch"):
            self.loader.dataset.set_epoch(self.number)
        self.start, self.done = time.perf_counter(), self.first
        self.data_seconds, self.arrivals, self.ranks = 0.0, [], None
        try:
            with tqdm(total=self.passes, initial=self.first, desc=f"epoch {self.number}", leave=False,
                      disable=rank() != 0 or not sys.stderr.isatty()) as bar:
                for index, batch in enumerate(self.timed(itertools.islice(self.loader, self.first, self.passes)),
                                              self.first):
                    step = index // self.grad_accum
                    if index % self.grad_accum == 0 and index > self.first and step % CHECK_EVERY == 0 \
                            and self.stop is not None and self.stop.requested():
                        break  # after the optimizer step of the group before: saved as part of this epoch
                    if index % self.grad_accum == 0 and self.profile:
                        self.profile.step()
                    if index % self.grad_accum == self.grad_accum - 1:  # the pass whose backward meets the others
                        self.arrivals.append(time.time() - ARRIVALS_FROM)  # one clock for every rank (timings())
                    yield batch
                    self.done = index + 1
                    bar.update()
        finally:
            if self.profile:
                self.profile.finish()  # a trace that the end of the epoch (or a stop) cut short

        self.ranks = self.timings()

    def timed(self, batches):
        """The batches; each wait for one is counted in data_seconds (and is a span of --profile's trace)."""
        iterator = iter(batches)
        while True:
            waited = time.perf_counter()
            with self.profile.data() if self.profile else contextlib.nullcontext():
                batch = next(iterator, None)
            self.data_seconds += time.perf_counter() - waited
            if batch is None:
                return
            yield batch

    def timings(self):
        """Every rank's seconds in this epoch's loop ("train_s"), waiting for its batches ("data_s") and waiting for
        a later rank ("wait_s"): {name: [one per rank]}, by one max over ranks at the end of the epoch (collective:
        every rank ends it after the same step); None in a single process. Each step's collectives hold every rank
        until the last one arrives, so every rank's train_s is about the same; what tells ranks apart is when each
        arrives: each notes the time it has a step's batch in hand (its last pass's), and a rank's wait_s is the sum
        over steps of how much later the last rank got there. That assumes equal compute: a rank slower inside its
        forward and backward does not show here (--profile shows it). On several machines it also assumes their
        clocks agree (NTP: to a few ms)."""
        world = processes()
        if world == 1 or self.stop is None:
            return None
        steps, me = len(self.arrivals), len(self.arrivals) + 3 * rank()
        row = torch.zeros(steps + 3 * world, dtype=torch.float64)  # each rank fills its own slots: max = gather
        row[:steps] = torch.tensor(self.arrivals, dtype=torch.float64)
        row[me:me + 3] = torch.tensor([time.perf_counter() - self.start, self.data_seconds, sum(self.arrivals)],
                                     dtype=torch.float64)
        row = self.stop.max_over_ranks(row, "timings")
        if row is None:
            return None
        last = row[:steps].sum().item()
        train, data, arrived = row[steps:].view(world, 3).T.tolist()
        wait = [max(0.0, last - mine) for mine in arrived]
        return {name: [round(seconds, 3) for seconds in values]
                for name, values in (("train_s", train), ("data_s", data), ("wait_s", wait))}


def part_done(state):
    """{epoch: the row a run stopped part-way saved for the start of that epoch} from a checkpoint's state ({} if
    it was written at the end of an epoch): what Batches continues."""
    row = state.get("metrics") or {}
    return {row["epoch"]: row} if row.get("partial") else {}


class ShuffledSampler(torch.utils.data.Sampler):
    """A random order of the whole data set that depends on (seed, epoch) alone, like DistributedSampler's with one
    process: set_epoch() picks the epoch's. A resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, data_source, seed=0):
        self.size, self.seed, self.epoch = len(data_source), seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self):
        return self.size
