"""The command line every step shares: its flags, the precision --amp picks, the processes' share of the cores, and
the error contract (one line, exit status 2, never a traceback) with an exit that cannot hang."""
import argparse
import contextlib
import functools
import gc
import json
import multiprocessing
import os
import re
import signal
import sys
import textwrap
import threading
import time
import traceback

import torch


class UserError(Exception):
    """A problem the user can fix: one line (with the fix), exit status 2. A step says the same with sys.exit("...")."""


# A collective's failure when a peer is gone (gloo, NCCL, Horovod), a group cannot form, or --dist-timeout passed.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "NCCL communicator was aborted", "HorovodInternalError")
CONNECT_FAILED, TIMED_OUT = "connectFullMesh failed", ("Timed out waiting", "failed to pass monitoredBarrier")


def brief(text, width=200):
    """`text` on one line, shortened at a word boundary to at most `width` characters."""
    return textwrap.shorten(" ".join(str(text).split()), width, placeholder=" ...") or str(text)[:width]


def rank():
    """This process's rank as its launcher set it (RANK, HOROVOD_RANK or Open MPI's); 0 without one."""
    return int(next((os.environ[k] for k in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK") if k in os.environ), 0))


def processes():
    """The job's processes as its launcher set them (WORLD_SIZE, HOROVOD_SIZE or Open MPI's); 1 without one."""
    return int(next((os.environ[k] for k in ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE") if k in os.environ), 1))


def _number(kind, check, rule):
    """An argparse type: `kind` of the text, which must pass `check` (`rule` says what it must be)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'whole ' * (kind is int)}number, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


positive_int = _number(int, lambda value: value >= 1, "positive")
non_negative_int = _number(int, lambda value: value >= 0, "0 or more")
positive_float = _number(float, lambda value: 0 < value < float("inf"), "a positive finite number")


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        """Parse, and note which options were typed (`given`): --resume takes the others from the checkpoint's run."""
        parsed, unset = super().parse_args(args, namespace), object()
        # Parsed again into a namespace that has every option already (argparse then sets no default): typed ones change.
        typed = vars(super().parse_known_args(args, argparse.Namespace(**{a.dest: unset for a in self._actions}))[0])
        parsed.given = frozenset(name for name, value in typed.items() if value is not unset)
        return parsed

    def error(self, message):
        """Usage and the error once per job: under a launcher every rank parses the same arguments; rank 0 says it."""
        if rank() != 0:  # a rank that ended first would have the launcher stop rank 0 before it says why
            time.sleep(30)
            sys.exit(2)
        super().error(message)


def shared_parser(description, step, archs):
    """The flags every step shares (the README's "One command line for every step"); a step adds its method's.
    archs: the script's --arch choices (the first is the default)."""
    parser = _Parser(description=description)
    add = parser.add_argument
    add("--data-dir", default="./data", help="the data (CIFAR-10: the folder of cifar-10-batches-py/; default ./data)")
    add("--out-dir", default=f"runs/{step}", help=f"checkpoints, metrics.jsonl, curves (default runs/{step})")
    add("--epochs", type=positive_int, default=30, help="total epochs (default 30)")
    add("--batch-size", type=positive_int, default=128,
        help="images per pass of one process; global batch = this x processes x --grad-accum (default 128)")
    add("--grad-accum", type=positive_int, default=1, help="passes per optimizer step (default 1)")
    add("--lr", type=positive_float, default=0.1, help="peak learning rate of the global batch (default 0.1)")
    add("--arch", choices=list(archs), default=next(iter(archs)), help=f"the model (default {next(iter(archs))})")
    add("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
        help="mixed precision: auto = what the hardware computes natively (default); off = fp32")
    add("--channels-last", action=argparse.BooleanOptionalAction, default=True, help="NHWC layout (default on)")
    add("--compile", action="store_true", help="torch.compile the model (the first epoch pays the compile)")
    add("--workers", type=non_negative_int, default=2, help="DataLoader worker processes (default 2)")
    add("--seed", type=non_negative_int, default=0, help="seed of weights, order and augmentation (default 0)")
    add("--resume", metavar="PATH|auto", help="a checkpoint to continue; auto: the newest in --out-dir, if any")
    add("--overwrite", action="store_true", help="replace the run already in --out-dir instead of refusing")
    add("--stop-after", type=positive_int, metavar="N", help="leave after N epochs of this run (--resume auto goes on)")
    add("--profile", type=non_negative_int, default=0, metavar="N",
        help="trace N optimizer steps into --out-dir and say where their time went (docs/debugging.md)")
    return parser


def exits_cleanly(main):
    """A UserError, sys.exit("message"), a missing path, a broken JSON file, and a collective that timed out or lost its
    peer become one line on stderr (every rank's, prefixed with its rank; under torchrun also in its error file, so that
    its summary shows it) and exit status 2, never a traceback. Also bounds the exit, and shares the cores."""

    def leave(line, consequence=False):
        print(line + "\n", end="", file=sys.stderr, flush=True)  # one write: ranks' lines never share a line
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # torchrun calls the failure with the smallest timestamp (whole seconds) the root cause: a cause is
            # stamped a second early, a rank that only stopped because another failed a second late.
            with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": line, "timestamp": int(time.time()) + (1 if consequence else -1)}, f)
        return 2

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        bound_the_exit()
        share_the_cores()
        prefix = f"[rank {rank()}] " if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        try:
            return main(*args, **kwargs)
        except SystemExit as error:
            if not isinstance(error.code, str):
                raise
            status = leave(f"{prefix}error: {error.code}")
        except UserError as error:
            status = leave(f"{prefix}error: {error}")
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as error:  # a path given
            status = leave(f"{prefix}error: {error.filename}: {error.strerror}: check the path")
        except Exception as error:
            text = f"{type(error).__name__}: {error}"
            if any(needle in text for needle in TIMED_OUT):
                cause = re.sub(r"^\[\S+:\d+\] ", "", str(error).splitlines()[0])  # gloo's: [source file:line] text
                status = leave(f"{prefix}error: a collective timed out ({brief(cause, 160)}): another rank is stuck "
                               "or skipped it; docs/debugging.md finds which")
            elif type(error).__name__ == "JSONDecodeError":  # a file given to be read as JSON
                status = leave(f"{prefix}error: not valid JSON ({error}): check the JSON file you passed")
            elif CONNECT_FAILED in text:
                status = leave(f"error: cannot connect to the other processes ({brief(str(error).splitlines()[0], 160)})"
                               ": one stopped while the group formed, or the address is unreachable (see "
                               "troubleshooting)", consequence=True)
            elif any(needle in text for needle in PEER_LOST):
                status = leave("stopping: another rank stopped, so the collectives shut down (its own error is above)",
                               consequence=True)
            else:  # a bug: its traceback, and exit 1 as Python would
                traceback.print_exc()
                status = 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            status = 130
        gc.collect()  # the exception's frames are gone: what they held (a loader, a process group) goes now
        sys.exit(status)

    return wrapper


def share_the_cores():
    """Threads per process = cores / processes on this machine, unless OMP_NUM_THREADS says (torchrun sets 1; DeepSpeed's
    and Horovod's launchers set nothing, and N processes with a thread per core each run ~10x slower on a CPU)."""
    names = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "HOROVOD_LOCAL_SIZE")
    local = int(next((os.environ[k] for k in names if k in os.environ), 1))
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


EXIT_WAIT = 30  # seconds the interpreter's exit may take (its threads and exit handlers) before it counts as a hang


def bound_the_exit():
    """An exit of this process still not done EXIT_WAIT seconds after it began (a thread or child process that does not
    end; preempt.py ends the DataLoader workers) ends it with one line and exit status 1, not a silent hang."""
    if not getattr(bound_the_exit, "watching", False):
        bound_the_exit.watching = True
        threading.Thread(target=_watch_the_exit, daemon=True, name="exit-watch").start()


def _watch_the_exit():
    threading.main_thread().join()  # returns when the interpreter's exit begins, before it joins threads and runs atexit
    time.sleep(EXIT_WAIT)
    children = multiprocessing.active_children()
    print(f"error: this process was still exiting {EXIT_WAIT} s after its work ended, waiting for a thread or one of its "
          f"{len(children)} child process(es) (pids {', '.join(str(c.pid) for c in children) or 'none'}); ended it. A bug: "
          "please report it (docs/troubleshooting.md)", file=sys.stderr, flush=True)
    for child in children:
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)
    os._exit(1)


def amp_dtype(choice, device):
    """The autocast dtype of --amp on `device` (None = fp32); amp_choice() says why."""
    return amp_choice(choice, device)[0]


def amp_choice(choice, device):
    """(dtype or None, why). auto: bf16 where `device` computes it natively (CPUs with AVX512-BF16, AMX or ARM BF16, GPUs
    from Ampere on, Intel GPUs), else fp32 on a CPU (bf16 is emulated there) and fp16 with loss scaling on CUDA."""
    if choice == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or --amp off")
    native, name = native_bf16(device)
    if choice != "auto":
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[choice], "as asked" + (
            f"; {name} has no native bf16: emulated, several times slower than fp32" * (choice == "bf16" and not native))
    if native:
        return torch.bfloat16, f"auto: {name} computes bf16 natively"
    if device.type == "cuda":
        return torch.float16, f"auto: {name} has no native bf16, so fp16 with loss scaling"
    return None, f"auto: fp32, as {name} has no native bf16 (emulated, it would be several times slower)"


def native_bf16(device):
    """(True if `device` computes bf16 natively, its name). A CPU's AVX512-BF16 or AMX counts where torch's kernels may
    use it (ATEN_CPU_CAPABILITY=avx2 forbids it)."""
    if device.type == "cpu":
        found, isa = torch.cpu.get_capabilities(), torch.backends.cpu.get_cpu_capability()
        x86 = [name for key, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX")) if found.get(key)]
        if x86 and isa.startswith("AVX512"):
            return True, f"this CPU ({' and '.join(x86)})"
        if found.get("bf16") and not found.get("avx2"):  # an ARM CPU with the BF16 extension
            return True, "this CPU (ARM BF16)"
        return False, f"this CPU ({isa})"
    module = getattr(torch, device.type, None)
    check = getattr(module, "is_bf16_supported", None)
    name = module.get_device_name(device) if hasattr(module, "get_device_name") else device.type.upper()
    return bool(check and check(including_emulation=False)), name
