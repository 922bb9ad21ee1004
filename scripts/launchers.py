"""How the steps start: each launcher's command as the README types it, free ports, the environment.

The one home of these for everything that starts the numbered scripts from outside
(tests/helpers.py, scripts/benchmark.py) and of free_port() for the scripts themselves.

    launch_command("torchrun", 2, "04_cifar10_ddp.py") + ["--arch", "cnn"]
    run(that, timeout=600)                  # from the repository root, in env()
"""
import contextlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent  # the venv's bin/: torchrun, deepspeed and horovodrun live next to python
# Launcher name -> the executable it needs in BIN (None: python itself starts it).
LAUNCHERS = {"python": None, "torchrun": "torchrun", "legacy": None, "deepspeed": "deepspeed",
             "horovodrun": "horovodrun"}
# Set by a launcher for its ranks:
# inherited from an outer job they would confuse the one started here.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


def free_port():
    """A TCP port on 127.0.0.1 that is free right now (for --master_port / MASTER_PORT), below
    Linux's ephemeral range (32768 and up): a launcher binds it seconds later, and a port the system
    hands out meanwhile (to gloo's connections, to a world of one's port 0) is never this one."""
    for _ in range(1000):
        port = random.randrange(21000, 32768)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free TCP port on 127.0.0.1 in 21000-32767")


def launch_command(launcher, nproc, script):
    """The command that starts `script` with `nproc` processes under `launcher` (one of LAUNCHERS),
    as the README does; append the script's own flags. "python" is one process; "legacy" is
    torch.distributed.launch, the launcher of the old tutorials, which passes --local-rank=N."""
    script, nproc = str(script), str(nproc)
    return {
        "python": lambda: [PYTHON, script],
        "torchrun": lambda: [str(BIN / "torchrun"), f"--nproc_per_node={nproc}",
                             f"--master_port={free_port()}", script],
        "legacy": lambda: [PYTHON, "-m", "torch.distributed.launch", f"--nproc_per_node={nproc}",
                           f"--master_port={free_port()}", script],
        "deepspeed": lambda: [str(BIN / "deepspeed"), "--num_gpus", nproc,
                              f"--master_port={free_port()}", script],
        # --gloo skips horovodrun's MPI probe (seconds per start; this build has Gloo only).
        "horovodrun": lambda: [str(BIN / "horovodrun"), "--gloo", "-np", nproc, "-H",
                               f"localhost:{nproc}", PYTHON, script],
    }[launcher]()


def env(**extra):
    """The environment of a run: one thread per process (OMP_NUM_THREADS=1; 2 cores), unbuffered
    output, the venv's bin/ first on PATH, the repository first on PYTHONPATH (then the caller's),
    no rank variables of an outer job; then `extra`."""
    e = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
             PATH=f"{BIN}{os.pathsep}{e.get('PATH', '')}",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")])))
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(command, timeout=None, **extra):
    """Run `command` from the repository root in env(**extra);
    stdout and stderr together in .stdout."""
    return subprocess.run([str(c) for c in command], cwd=REPO, env=env(**extra), timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
