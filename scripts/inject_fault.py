"""Runs a step (unchanged) with a fault injected from outside, for the recipes of docs/debugging.md.

    torchrun --nproc_per_node=2 scripts/inject_fault.py FAULT 04_cifar10_ddp.py [its arguments]

FAULT, on rank 1 unless said otherwise (rank N: FAULT_RANK=N):
  slow-rank         sleeps SLOW seconds (default 0.25) before each of its optimizer steps
  slow-data         every rank's data set takes SLOW seconds (default 0.01) per image (also in
                    DataLoader workers started by fork, Linux's default; not in spawned ones)
  stuck-rank        stops for good before its 5th optimizer step
  extra-collective  makes an all-reduce of its own before its 5th optimizer step, which no other
                    rank makes
  exception         raises an exception (a bug) in its 2nd optimizer step
  barrier           every rank meets the others in torch.distributed.monitored_barrier (timeout
                    BARRIER_TIMEOUT seconds, default 10) before each optimizer step, and rank 1
                    stops for good before its 5th
  slow-save         every rank's Distributed Checkpoint writes (08's, in the background) wait SLOW
                    seconds (default 60) from its 2nd save on: a kill then lands during a save
Every fault: SIGUSR2 makes each rank write its flight recorder (TORCH_FR_BUFFER_SIZE=N must be set)
to $FR_DIR/rankR, with the process groups' ranks added, which torch 2.13's gloo leaves out and
torchfrtrace needs.
The faults patch torch.optim.SGD.step (the optimizer of steps 04, 06, 07, 08),
common.data.CIFAR10Tensors and DCP's FileSystemWriter.
"""
import datetime
import os
import pickle
import runpy
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

FAULTS = ("slow-rank", "slow-data", "stuck-rank", "extra-collective", "exception", "barrier",
          "slow-save")
RANK = os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0"))
FAULTY = RANK == os.environ.get("FAULT_RANK", "1")


def dump_flight_recorder():
    """On each SIGUSR2 (any time, even while the training loop's thread waits in a collective): the
    flight recorder's entries to $FR_DIR/rankR, in the format torchfrtrace reads."""
    while True:
        signal.sigwait({signal.SIGUSR2})
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        groups = dist.distributed_c10d._world.pg_map
        trace["pg_config"] = {group.group_name: {"name": group.group_name, "desc": group.group_desc,
                                                 "ranks": str(dist.get_process_group_ranks(group))}
                              for group in groups}
        os.makedirs(os.environ.get("FR_DIR", "."), exist_ok=True)
        path = os.path.join(os.environ.get("FR_DIR", "."), f"rank{dist.get_rank()}")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(trace, f)
        os.replace(path + ".tmp", path)
        # One write per line.
        print(f"rank {dist.get_rank()}: flight recorder written to {path}\n", end="", flush=True)


def patch_optimizer_step(fault):
    step, count = torch.optim.SGD.step, [0]

    def faulty_step(self, *args, **kwargs):
        count[0] += 1
        if fault == "slow-rank" and FAULTY:
            time.sleep(float(os.environ.get("SLOW", "0.25")))
        if fault in ("stuck-rank", "barrier") and FAULTY and count[0] == 5:
            print(f"rank {RANK}: stuck before optimizer step 5 (scripts/inject_fault.py)",
                  flush=True)
            time.sleep(24 * 3600)
        if fault == "extra-collective" and FAULTY and count[0] == 5:
            dist.all_reduce(torch.zeros(1))
        if fault == "exception" and FAULTY and count[0] == 2:
            raise ValueError("a bug in the optimizer step (scripts/inject_fault.py)")
        if fault == "barrier":
            seconds = float(os.environ.get("BARRIER_TIMEOUT", "10"))
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = faulty_step


def patch_data():
    from common.data import CIFAR10Tensors

    item = CIFAR10Tensors.__getitem__

    def slow_item(self, index):
        time.sleep(float(os.environ.get("SLOW", "0.01")))
        return item(self, index)

    CIFAR10Tensors.__getitem__ = slow_item


def patch_checkpoint_writer():
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write, count = FileSystemWriter.write_data, [0]

    def slow_write(self, *args, **kwargs):
        count[0] += 1
        if count[0] >= 2:
            time.sleep(float(os.environ.get("SLOW", "60")))
        return write(self, *args, **kwargs)

    FileSystemWriter.write_data = slow_write


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in FAULTS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(FAULTS)}}} STEP.py [arguments]")
    # Every thread from now on leaves it to the dumper.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    threading.Thread(target=dump_flight_recorder, daemon=True, name="flight-recorder").start()
    # The repository, for common/.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1] == "slow-data":
        patch_data()
    elif sys.argv[1] == "slow-save":
        patch_checkpoint_writer()
    else:
        patch_optimizer_step(sys.argv[1])
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
