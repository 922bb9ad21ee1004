"""The command line every step shares: its flags, the precision --amp picks, the processes' share of
the cores, and the error contract (one line, exit status 2, never a traceback) with an exit that
cannot hang."""
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
    """A problem the user can fix: one line (with the fix), exit status 2.
    A step says the same with sys.exit("...")."""


# A collective's failure when a peer is gone (gloo, NCCL, Horovod),
# a group cannot form, or --dist-timeout passed.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "NCCL communicator was aborted", "HorovodInternalError")
CONNECT_FAILED = "connectFullMesh failed"
TIMED_OUT = ("Timed out waiting", "failed to pass monitoredBarrier")
# Batch norm's refusal of a training batch of one sample.
BATCH_OF_ONE = "Expected more than 1 value per channel when training"
# A data set that a DataLoader worker from a forkserver (04-08) cannot receive.
NOT_PICKLABLE = ("Can't pickle", "cannot pickle")


def brief(text, width=200):
    """`text` on one line, shortened at a word boundary to at most `width` characters."""
    one_line = " ".join(str(text).split())
    return textwrap.shorten(one_line, width, placeholder=" ...") or str(text)[:width]


def rank():
    """This process's rank as its launcher set it (RANK, HOROVOD_RANK or Open MPI's);
    0 without one."""
    names = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")
    return int(next((os.environ[k] for k in names if k in os.environ), 0))


def processes():
    """The job's processes as its launcher set them (WORLD_SIZE, HOROVOD_SIZE or Open MPI's);
    1 without one."""
    names = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE")
    return int(next((os.environ[k] for k in names if k in os.environ), 1))


def _number(kind, check, rule):
    """An argparse type: `kind` of the text, which must pass `check` (`rule`: what it must be)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            whole = "whole " * (kind is int)
            raise argparse.ArgumentTypeError(f"expected a {whole}number, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


positive_int = _number(int, lambda value: value >= 1, "positive")
non_negative_int = _number(int, lambda value: value >= 0, "0 or more")
positive_float = _number(float, lambda value: 0 < value < float("inf"), "a positive finite number")


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        """Parse, and note which options were typed (`given`):
        --resume takes the others from the checkpoint's run."""
        parsed, unset = super().parse_args(args, namespace), object()
        # Parsed again into a namespace that has every option already (argparse then sets no
        # default): typed ones change.
        every_option = argparse.Namespace(**{a.dest: unset for a in self._actions})
        typed = vars(super().parse_known_args(args, every_option)[0])
        parsed.given = frozenset(name for name, value in typed.items() if value is not unset)
        return parsed

    def error(self, message):
        """Usage and the error once per job:
        under a launcher every rank parses the same arguments; rank 0 says it."""
        # A rank that ended first would have the launcher stop rank 0 before it says why.
        if rank() != 0:
            time.sleep(30)
            sys.exit(2)
        super().error(message)


def shared_parser(description, step, archs):
    """The flags every step shares (docs/usage.md, "One command line for every step"); a step adds
    its method's. archs: the script's --arch choices (the first is the default)."""
    parser = _Parser(description=description)
    add = parser.add_argument
    add("--data-dir", default="./data",
        help="the data's folder (default ./data; for CIFAR-10 the one holding "
        "cifar-10-batches-py/, downloaded if missing)")
    add("--out-dir", default=f"runs/{step}",
        help=f"checkpoints, metrics.jsonl, curves (default runs/{step})")
    add("--epochs", type=positive_int, default=30, help="total epochs (default 30)")
    add("--batch-size", type=positive_int, default=128,
        help="samples per pass of one process; global batch = this x processes x --grad-accum "
        "(default 128)")
    add("--grad-accum", type=positive_int, default=1, help="passes per optimizer step (default 1)")
    add("--drop-last", action=argparse.BooleanOptionalAction, default=False,
        help="leave out each epoch's last optimizer step where it is short (default: every sample "
        "trains every epoch)")
    add("--lr", type=positive_float, default=0.1,
        help="peak learning rate of the global batch (default 0.1)")
    add("--arch", choices=list(archs), default=next(iter(archs)),
        help=f"the model (default {next(iter(archs))})")
    add("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
        help="mixed precision: auto = what the hardware computes natively (default); off = fp32")
    add("--channels-last", action=argparse.BooleanOptionalAction, default=True,
        help="NHWC layout (default on)")
    add("--compile", action="store_true",
        help="torch.compile the model (the first epoch pays the compile)")
    add("--workers", type=non_negative_int, default=2,
        help="DataLoader worker processes (default 2)")
    add("--seed", type=non_negative_int, default=0,
        help="seed of weights, order and augmentation (default 0)")
    add("--resume", metavar="PATH|auto",
        help="a checkpoint to continue; auto: the newest in --out-dir, if any")
    add("--overwrite", action="store_true",
        help="replace the run already in --out-dir instead of refusing")
    add("--stop-after", type=positive_int, metavar="N",
        help="leave after N epochs of this run (--resume auto goes on)")
    add("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
        help="TensorBoard event files in --out-dir, written by rank 0 (default on; "
        "tensorboard --logdir runs)")
    add("--loss-every", type=positive_int, default=10, metavar="N",
        help="keep every Nth optimizer step's training loss, for TensorBoard and metrics.jsonl "
        "(default 10)")
    add("--profile", type=non_negative_int, default=0, metavar="N",
        help="trace N optimizer steps into --out-dir and say where their time went "
        "(docs/debugging.md)")
    return parser


def exits_cleanly(main):
    """A UserError, sys.exit("message"), a missing path, a broken JSON file, and a collective that
    timed out or lost its peer become one line on stderr (every rank's, prefixed with its rank;
    under torchrun also in its error file, so that its summary shows it) and exit status 2, never a
    traceback. Also bounds the exit and shares the cores."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        bound_the_exit()
        share_the_cores()
        ranked = "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1"
        prefix = f"[rank {rank()}] " if ranked else ""
        try:
            status = main(*args, **kwargs)
            if main.__module__ != "__main__":
                return status
        except SystemExit as error:
            if not isinstance(error.code, str):
                raise
            status = _leave(f"{prefix}error: {error.code}")
        except UserError as error:
            status = _leave(f"{prefix}error: {error}")
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as error:
            # A path given by the user.
            status = _leave(f"{prefix}error: {error.filename}: {error.strerror}: check the path")
        except Exception as error:
            status = _other_error(error, prefix)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            status = 130
        # What main's frames or the exception's held (a loader, a process group) goes now.
        gc.collect()
        sys.exit(status)

    return wrapper


def _leave(line, consequence=False):
    """exits_cleanly's one line, on stderr and in torchrun's error file; exit status 2."""
    # One write: ranks' lines never share a line.
    print(line + "\n", end="", file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # torchrun calls the failure with the smallest timestamp (whole seconds) the root cause: a
        # cause is stamped a second early, a rank that only stopped because another failed a second
        # late.
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            timestamp = int(time.time()) + (1 if consequence else -1)
            json.dump({"message": line, "timestamp": timestamp}, f)
    return 2


def _other_error(error, prefix):
    """exits_cleanly's status for another exception, in its except block (a bug: the traceback)."""
    text = f"{type(error).__name__}: {error}"
    if any(needle in text for needle in TIMED_OUT):
        # gloo's message begins with [source file:line].
        cause = re.sub(r"^\[\S+:\d+\] ", "", str(error).splitlines()[0])
        return _leave(f"{prefix}error: a collective timed out ({brief(cause, 160)}): another rank "
                      "is stuck or skipped it; docs/debugging.md finds which")
    if BATCH_OF_ONE in text:
        return _leave(f"{prefix}error: a training batch of one sample reached a layer that needs "
                      "more (batch norm): pass --drop-last to leave out each epoch's short last "
                      "step, or another --batch-size")
    if any(needle in text for needle in NOT_PICKLABLE):
        cause = brief(str(error), 120)
        return _leave(f"{prefix}error: the DataLoader workers start from a forkserver, which gets "
                      f"the data sets pickled, and this one does not pickle ({cause}): define its "
                      "classes and functions at module level, or pass --workers 0")
    if type(error).__name__ == "JSONDecodeError":  # a file given to be read as JSON
        return _leave(f"{prefix}error: not valid JSON ({error}): check the JSON file you passed")
    if CONNECT_FAILED in text:
        cause = brief(str(error).splitlines()[0], 160)
        return _leave(f"error: cannot connect to the other processes ({cause}): one stopped while "
                      "the group formed, or the address is unreachable (see troubleshooting)",
                      consequence=True)
    if any(needle in text for needle in PEER_LOST):
        return _leave("stopping: another rank stopped, so the collectives shut down (its own error "
                      "is above)", consequence=True)
    # A bug: its traceback, and exit 1 as Python would.
    traceback.print_exc()
    return 1


def share_the_cores():
    """Threads per process = cores / processes on this machine, unless OMP_NUM_THREADS says
    (torchrun sets 1; DeepSpeed's and Horovod's launchers set nothing, and N processes with a thread
    per core each run ~10x slower on a CPU)."""
    names = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "HOROVOD_LOCAL_SIZE")
    local = int(next((os.environ[k] for k in names if k in os.environ), 1))
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


# Seconds the interpreter's exit may take (its threads, exit handlers) before it counts as a hang.
EXIT_WAIT = 30


def bound_the_exit():
    """An exit of this process still not done EXIT_WAIT seconds after it began (a thread or child
    process that does not end; preempt.py ends the DataLoader workers) ends it with one line and
    exit status 1, not a silent hang."""
    if not getattr(bound_the_exit, "watching", False):
        bound_the_exit.watching = True
        threading.Thread(target=_watch_the_exit, daemon=True, name="exit-watch").start()


def _watch_the_exit():
    # This returns when the interpreter's exit begins, before it joins threads and runs atexit.
    threading.main_thread().join()
    time.sleep(EXIT_WAIT)
    children = multiprocessing.active_children()
    pids = ", ".join(str(c.pid) for c in children) or "none"
    print(f"error: this process was still exiting {EXIT_WAIT} s after its work ended, waiting "
          f"for a thread or one of its {len(children)} child process(es) (pids {pids}); ended it. "
          "A bug: please report it (docs/troubleshooting.md)", file=sys.stderr, flush=True)
    for child in children:
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)
    os._exit(1)


def amp_dtype(choice, device):
    """The autocast dtype of --amp on `device` (None = fp32); amp_choice() says why."""
    return amp_choice(choice, device)[0]


def amp_choice(choice, device):
    """(dtype or None, why). auto: bf16 where `device` computes it natively (CPUs with AVX512-BF16,
    AMX or ARM BF16, GPUs from Ampere on, Intel GPUs), else fp32 on a CPU (bf16 is emulated there)
    and fp16 with loss scaling on CUDA."""
    if choice == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or --amp off")
    native, name = native_bf16(device)
    if choice != "auto":
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[choice]
        emulated = f"; {name} has no native bf16: emulated, several times slower than fp32"
        return dtype, "as asked" + emulated * (choice == "bf16" and not native)
    if native:
        return torch.bfloat16, f"auto: {name} computes bf16 natively"
    if device.type == "cuda":
        return torch.float16, f"auto: {name} has no native bf16, so fp16 with loss scaling"
    return None, (f"auto: fp32, as {name} has no native bf16 (emulated, it would be several times "
                  "slower)")


def native_bf16(device):
    """(True if `device` computes bf16 natively, its name). A CPU's AVX512-BF16 or AMX counts where
    torch's kernels may use it (ATEN_CPU_CAPABILITY=avx2 forbids it)."""
    if device.type == "cpu":
        found, isa = torch.cpu.get_capabilities(), torch.backends.cpu.get_cpu_capability()
        extensions = (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
        x86 = [name for key, name in extensions if found.get(key)]
        if x86 and isa.startswith("AVX512"):
            return True, f"this CPU ({' and '.join(x86)})"
        if found.get("bf16") and not found.get("avx2"):  # an ARM CPU with the BF16 extension
            return True, "this CPU (ARM BF16)"
        return False, f"this CPU ({isa})"
    module = getattr(torch, device.type, None)
    check = getattr(module, "is_bf16_supported", None)
    named = hasattr(module, "get_device_name")
    name = module.get_device_name(device) if named else device.type.upper()
    return bool(check and check(including_emulation=False)), name


def check_device(args, device):
    """A distributed step's device settings that cannot run here, as one line: a local rank without
    a GPU of its own (more processes than GPUs on this machine), or --sync-bn where torch's
    SyncBatchNorm has no kernel. `device`: the machine's accelerator, None for the CPU."""
    count = torch.accelerator.device_count()
    if device is not None and args.local_rank >= count:
        raise UserError(f"local rank {args.local_rank} has no GPU: start <= {count} per node")
    kind = "cpu" if device is None else device.type
    if getattr(args, "sync_bn", False) and kind not in ("cuda", "xpu"):
        raise UserError(f"--sync-bn needs CUDA or XPU GPUs (torch's SyncBatchNorm has no {kind} "
                        "kernel); drop it")
