"""Process plumbing of the multi-process steps that is not their lesson: running without a launcher."""
import datetime
import os
import sys

import torch
import torch.multiprocessing as mp

from .cli import UserError, positive_int
from .launchers import free_port


def add_arguments(parser, spawn=True):
    """The launch flags of the torch.distributed steps: --spawn N (start the processes without a launcher) and
    --dist-timeout (how long a collective waits for a missing rank: init_process_group's timeout)."""
    if spawn:
        parser.add_argument("--spawn", type=positive_int, metavar="N",
                            help="start N processes with torch.multiprocessing.spawn instead of a launcher")
    parser.add_argument("--dist-timeout", type=lambda text: datetime.timedelta(seconds=positive_int(text)),
                        default=datetime.timedelta(seconds=600), metavar="SECONDS",
                        help="how long a collective waits for a missing rank before failing (default 600)")


def _as_rank(local_rank, main, argv, nprocs):
    # What a launcher would have set for this process, and torchrun's one thread per process.
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    main(argv)


def without_launcher(main, argv, nprocs=None):
    """The script was started by plain python. With nprocs (--spawn N): run main(argv) in N new processes
    (torch.multiprocessing.spawn) as ranks 0..N-1 of one group on this machine; a rank that fails becomes one
    line. Without: run main(argv) here as the only rank of a group of one."""
    argv = sys.argv[1:] if argv is None else argv
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not nprocs:
        print("not started by a launcher: running as a single process (world size 1)")
        return _as_rank(0, main, argv, 1)
    try:
        mp.spawn(_as_rank, args=(main, argv, nprocs), nprocs=nprocs)
    except mp.ProcessExitedException as error:
        raise UserError(f"rank {error.error_index} of {nprocs} exited with status {error.exit_code}") from None
