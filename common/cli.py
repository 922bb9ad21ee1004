"""Command-line helpers shared by every step: the shared flags, argument types and the one-line error contract."""
import argparse
import contextlib
import functools
import gc
import os
import re
import sys
import time
import traceback


class UserError(Exception):
    """A problem the user can fix. Printed as one line (with the fix), exit status 2."""


# Exception types that mean "another rank failed" (a collective lost its peer), added by the steps' libraries, and
# what torch.distributed's RuntimeErrors say when a peer process is gone (gloo, NCCL).
PEER_FAILURES = []
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "NCCL communicator was aborted")
CONNECT_FAILED = "connectFullMesh failed"  # gloo, while the group forms: a peer is gone or cannot be reached
TIMED_OUT = ("Timed out waiting", "failed to pass monitoredBarrier")  # gloo's collectives past --dist-timeout; NCCL's
# watchdog ends the process itself (docs/debugging.md)


def brief(text, width=200):
    """`text` on one line, shortened at a word boundary (never cut mid-word) to at most `width` characters."""
    import textwrap

    return textwrap.shorten(" ".join(str(text).split()), width, placeholder=" ...") or str(text)[:width]


def rank():
    """This process's rank as its launcher set it (RANK; horovodrun: HOROVOD_RANK, or Open MPI's under its MPI
    controller); 0 without a launcher."""
    return int(next((os.environ[k] for k in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK") if k in os.environ), 0))


def processes():
    """Processes of this job as its launcher set them (WORLD_SIZE; horovodrun: HOROVOD_SIZE, or Open MPI's under
    its MPI controller); 1 without one."""
    return int(next((os.environ[k] for k in ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE")
                     if k in os.environ), 1))


def _whole_number(text, minimum, rule):
    try:
        value = int(text)
    except ValueError:
        raise _arg_error(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise _arg_error(f"must be {rule}, got {value}")
    return value


def positive_int(text):
    return _whole_number(text, 1, "positive")


def non_negative_int(text):
    return _whole_number(text, 0, "0 or more")


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise _arg_error(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise _arg_error(f"must be a positive finite number, got {text}")
    return value


def _arg_error(message):
    return argparse.ArgumentTypeError(message)


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        """Parse, and note which options were typed (`given`): --resume takes the others from the checkpoint's run
        (checkpoint.continue_run, once the processes can share what rank 0 reads). Parsing reads no file."""
        parsed = super().parse_args(args, namespace)
        parsed.given = frozenset(self._given(args))
        return parsed

    def _given(self, args):
        """The dests of the options on the command line (parsed again with every default suppressed)."""
        defaults = {action: action.default for action in self._actions}
        try:
            for action in self._actions:
                action.default = argparse.SUPPRESS
            return set(vars(super().parse_known_args(args)[0]))
        finally:
            for action, default in defaults.items():
                action.default = default

    def error(self, message):
        """Usage and the error once per job: under a launcher every rank parses the same arguments; rank 0 says it."""
        if rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        else:  # a rank that ended first would have the launcher stop rank 0 before it says why: let rank 0 end first
            time.sleep(30)
        sys.exit(2)


def shared_parser(description, step, archs):
    """The flags every step shares (the README's "Shared flags"); a step adds the flags of its method. archs: the
    script's --arch choices (the first is the default)."""
    parser = _Parser(description=description)
    parser.add_argument("--data-dir", default="./data",
                        help="where build_data finds the data (CIFAR-10: the folder holding cifar-10-batches-py/, "
                             "downloaded if missing; default ./data)")
    parser.add_argument("--out-dir", default=f"runs/{step}",
                        help=f"checkpoints, metrics.jsonl, training_curves.png (default runs/{step})")
    parser.add_argument("--epochs", type=positive_int, default=30, help="total epochs (default 30)")
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="images per forward pass of one process; global batch = this x processes x "
                             "--grad-accum (default 128)")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="forward/backward passes per optimizer step (gradient accumulation; default 1)")
    parser.add_argument("--lr", type=positive_float, default=0.1,
                        help="peak learning rate of SGD for the global batch (default 0.1)")
    parser.add_argument("--arch", choices=list(archs), default=next(iter(archs)),
                        help=f"the model: {' or '.join(archs)} (default {next(iter(archs))})")
    parser.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
                        help="mixed precision: auto = bf16 on the CPU and on GPUs with native bf16 (Ampere on), fp16 on older GPUs; "
                             "off = fp32 (default auto)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                        help="NHWC memory layout, faster convolutions on tensor cores and CPUs (default on)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (the first epoch pays a one-time compile, 30-60 s on CPU)")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for weights, order and augmentation")
    parser.add_argument("--resume", metavar="PATH|auto",
                        help="checkpoint to continue from; 'auto' = newest in --out-dir (fresh start if none)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run already in --out-dir (its checkpoints and metrics) instead of refusing")
    parser.add_argument("--stop-after", type=positive_int, metavar="N",
                        help="leave after N epochs of this run (time-limited jobs); continue with --resume auto")
    parser.add_argument("--profile", type=non_negative_int, default=0, metavar="N",
                        help="trace N optimizer steps with torch.profiler (from the 4th step on) into --out-dir "
                             "(profile-rankR.json) and print each rank's shares of compute, communication and data "
                             "(docs/debugging.md)")
    return parser


def exits_cleanly(main):
    """Turn a UserError, and a collective that timed out, into one line on stderr and exit status 2, never a traceback.

    Under a launcher every rank prints its own line, prefixed with its rank, so the launcher's
    log says which process gave up and why. Under torchrun the line also goes into the error file it
    names (TORCHELASTIC_ERROR_FILE), so that its closing summary shows it instead of `<N/A>`.
    """

    def leave(line, consequence=False):
        print(line, file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            import json

            # torchrun's summary calls the failure with the smallest timestamp (whole seconds) the root cause; a tie
            # goes to the one it lists first (ranks that exited by themselves, in rank order). A cause is stamped a
            # second early, a rank that only stopped because another failed a second late: the cause wins the tie.
            with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": line, "timestamp": int(time.time()) + (1 if consequence else -1)}, f)
        return 2

    def prefix():
        return f"[rank {rank()}] " if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else ""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        bound_the_exit()
        try:
            return main(*args, **kwargs)
        except UserError as error:
            status = leave(f"{prefix()}error: {error}")
        except Exception as error:
            if any(text in str(error) for text in TIMED_OUT):
                cause = re.sub(r"^\[\S+:\d+\] ", "", str(error).splitlines()[0])  # gloo's: [source file:line] text
                status = leave(f"{prefix()}error: a collective timed out ({brief(cause, 160)}): another rank is stuck "
                               "or skipped it; docs/debugging.md finds which")
            elif CONNECT_FAILED in str(error):
                status = leave(f"error: cannot connect to the other processes ({brief(str(error).splitlines()[0], 160)})"
                               ": one stopped while the group formed, or the address is unreachable (see "
                               "troubleshooting)", consequence=True)
            elif isinstance(error, tuple(PEER_FAILURES)) or any(text in str(error) for text in PEER_LOST):
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


EXIT_WAIT = 30  # seconds the interpreter's exit may take (its threads and exit handlers) before it counts as a hang


def bound_the_exit():
    """From now on this process cannot hang silently at its exit (once per process): an exit still not done EXIT_WAIT
    seconds after it began (a thread or child process that does not end) ends the process with one line and exit
    status 1. The DataLoader workers, which could hold it forever, are ended by common/preempt.py."""
    import threading

    if not getattr(bound_the_exit, "watching", False):
        bound_the_exit.watching = True
        threading.Thread(target=_watch_the_exit, daemon=True, name="exit-watch").start()


def _watch_the_exit():
    import multiprocessing
    import signal
    import threading

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
    """(dtype or None, why). auto: what `device` computes natively: bf16 where it does (CPUs with AVX512-BF16 or AMX,
    ARM CPUs with BF16, GPUs from Ampere on, Intel GPUs), else fp32 on a CPU (there bf16 is emulated, several times
    slower) and fp16 with loss scaling (GradScaler) on older CUDA GPUs."""
    import torch

    if choice == "fp16" and device.type == "cpu":
        raise UserError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or --amp off")
    native, name = native_bf16(device)
    if choice != "auto":
        emulated = choice == "bf16" and not native
        return ({"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[choice],
                f"as asked; {name} has no native bf16: emulated, several times slower than fp32" if emulated
                else "as asked")
    if native:
        return torch.bfloat16, f"auto: {name} computes bf16 natively"
    if device.type == "cuda":
        return torch.float16, f"auto: {name} has no native bf16, so fp16 with loss scaling"
    return None, f"auto: fp32, as {name} has no native bf16 (emulated, it would be several times slower)"


def native_bf16(device):
    """(True if `device` computes bf16 natively, its name). A CPU's AVX512-BF16 or AMX counts where torch's kernels may
    use it (ATEN_CPU_CAPABILITY=avx2 forbids it)."""
    import torch

    if device.type == "cpu":
        found, isa = torch.cpu.get_capabilities(), torch.backends.cpu.get_cpu_capability()
        x86 = [name for key, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX")) if found.get(key)]
        if x86 and isa.startswith("AVX512"):
            return True, f"this CPU ({' and '.join(x86)})"
        if found.get("bf16") and not found.get("avx2"):  # an ARM CPU with the BF16 extension
            return True, "this CPU (ARM BF16)"
        return False, f"this CPU ({isa})"
    module = getattr(torch, device.type, None)
    name = module.get_device_name(device) if hasattr(module, "get_device_name") else device.type.upper()
    check = getattr(module, "is_bf16_supported", None)
    return bool(check and check(including_emulation=False)), name
