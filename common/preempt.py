"""Stopping cleanly on request. Slurm sends SIGTERM to every process of a job before it kills it
(scancel, preemption, the time limit); `#SBATCH --signal=USR1@120` asks for SIGUSR1 two minutes
early (slurm/). Stop catches both; the loop asks stop.requested(steps) after each optimizer step,
and the step saves where it stopped and exits EXIT_REQUEUE, on which the batch scripts requeue the
job. Every rank must stop after the same step: the step gives Stop `agree(flag)`, a collective that
starts a max over ranks of a one-element CPU tensor without waiting and returns what waits for it;
Stop starts one every CHECK_EVERY steps and reads it at the next look, when it has long arrived.
Processes started after Stop() (DataLoader workers) inherit the two signals blocked, lest Slurm's
signal kill a worker and the training process with it; the exit ends them with SIGKILL
(end_workers_at_exit), as SIGTERM would wait forever. Stop(watch=PID) also stops as on SIGTERM
once process PID ends: step 05's ranks watch the deepspeed runner, which a signal ends alone."""
import atexit
import contextlib
import multiprocessing
import os
import signal
import threading
import time

import psutil
import torch

from .cli import rank

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# EX_TEMPFAIL ("try again later"): stopped on request with a checkpoint; requeue and resume.
EXIT_REQUEUE = 75
# Optimizer steps between two looks at the stop flag: a signal ends the epoch within 2 x this.
CHECK_EVERY = 8
# Seconds between two looks at a watched process (Stop(watch=PID)).
WATCH_EVERY = 0.5


class Stop:
    """Catches SIGTERM and SIGUSR1 from now on; --stop-after N leaves after N epochs of this run.
    watch: a process id; once that process ends, this one stops as if it received SIGTERM."""

    def __init__(self, stop_after=None, agree=None, watch=None):
        # The first signal this process received; the ranks agreed to stop.
        self.signal, self.stopped = None, False
        self.stop_after, self._agree, self._pending = stop_after, agree, None
        # Threads started before now may take a signal: Python runs this handler for them.
        for sig in SIGNALS:
            signal.signal(sig, lambda signum, frame: self._note(signum))
        # This thread blocks them (inherited by threads and processes it starts); one thread of ours
        # waits for them.
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        threading.Thread(target=self._wait, daemon=True, name="stop-signals").start()
        # Daemon threads: neither keeps the process alive at exit.
        if watch is not None:
            threading.Thread(target=self._watch, args=(watch,), daemon=True,
                             name="stop-watch").start()
        # Registered once; multiprocessing's exit handler runs after it.
        if not getattr(end_workers_at_exit, "registered", False):
            atexit.register(end_workers_at_exit)
            end_workers_at_exit.registered = True

    def _note(self, signum):
        self.signal = self.signal or signal.Signals(signum).name

    def _wait(self):
        while True:
            self._note(signal.sigwait(SIGNALS))

    def _watch(self, pid):
        """SIGTERM, as noted, once process `pid` has ended (gone, or a zombie that its parent has
        not reaped yet)."""
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                time.sleep(WATCH_EVERY)
        self._note(signal.SIGTERM)

    def requested(self, steps=CHECK_EVERY, wait=False):
        """After `steps` optimizer steps of this epoch: True once the ranks agreed that one received
        a signal. Collective every CHECK_EVERY steps: reads the agreement the previous look started
        and starts the next (wait: waits for it)."""
        if self.stopped or self._agree is None:  # one process: no one to agree with
            self.stopped = self.stopped or self.signal is not None
            return self.stopped
        if steps % CHECK_EVERY:
            return False
        if self._pending is not None:
            self._read()
        if not self.stopped:
            flag = torch.tensor([int(self.signal is not None)])
            self._pending = (self._agree(flag), flag)
            if wait:
                self._read()
        return self.stopped

    def _read(self):
        wait, flag = self._pending
        wait()
        self.stopped, self._pending = bool(flag.item()), None

    def leave(self, epoch, start_epoch, epochs):
        """After epoch `epoch` (saved): True if the run leaves now, on a signal or after
        --stop-after epochs; rank 0 says why. Collective, like requested()."""
        run_epochs = epoch - start_epoch
        if epoch >= epochs or not (self.requested(wait=True)
                                   or (self.stop_after and run_epochs >= self.stop_after)):
            return False
        if rank() == 0:
            other = "another rank received SIGTERM/SIGUSR1"
            got = f"received {self.signal}" if self.signal else other
            why = f"{got}: checkpoint saved; exit {EXIT_REQUEUE} (a batch script requeues)"
            asked = f"stopping after {self.stop_after} epoch(s) as asked"
            print(f"{why if self.stopped else asked}; continue with --resume auto", flush=True)
        return True

    def exit_status(self):
        return EXIT_REQUEUE if self.stopped else 0


def end_workers_at_exit():
    """What multiprocessing's exit handler does to daemonic children (DataLoader workers), with
    SIGKILL instead of the SIGTERM they block. torch's SIGCHLD handler, which would call a loader's
    worker killed, goes first."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)
