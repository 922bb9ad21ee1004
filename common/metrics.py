"""metrics.jsonl (one JSON object per epoch), console lines, the training-curve PNG, and --profile's trace."""
import contextlib
import json
import os
import re
import statistics
import sys
import time

FILE = "metrics.jsonl"
PLOT = "training_curves.png"


class MetricsLog:
    """Appends one row per epoch to out_dir/metrics.jsonl.

    A resumed run keeps the rows up to the epoch it resumes from and drops later ones (written
    after that checkpoint by the run that crashed), so the file always matches the weights. The
    resumed epoch's row, lost if the run was killed between its checkpoint and its row, comes back
    from that checkpoint (which holds it).
    """

    def __init__(self, out_dir, start_epoch=0, synthetic=False):
        self.path = os.path.join(out_dir, FILE)
        self.synthetic = synthetic
        rows = [row for row in read(self.path) if row["epoch"] <= start_epoch] if start_epoch else []
        if start_epoch and start_epoch not in [row["epoch"] for row in rows]:
            rows += _row_of_checkpoint(out_dir, start_epoch)
        os.makedirs(out_dir, exist_ok=True)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    def append(self, row):
        """Write a finished epoch's row; a part-way epoch's row (saved in its checkpoint instead) is not written."""
        row = {**row, "synthetic": self.synthetic}
        if not row.get("partial"):
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def _row_of_checkpoint(out_dir, epoch):
    """[the metrics row that out_dir's checkpoint of `epoch` holds], or [] without one."""
    from .checkpoint import checkpoint_path, load
    from .cli import UserError

    path = checkpoint_path(out_dir, epoch)
    try:
        state = load(path, mmap=True) if os.path.isfile(path) else {}
    except UserError:
        return []
    return [{**state["metrics"], "synthetic": state["synthetic"]}] if state.get("metrics", {}).get("epoch") else []


def read(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


_PRECISION = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "None": "off"}


def start_line(step, args, device, precision, train_loader, synthetic, processes=None, prefix=""):
    """The run's first line: model, devices, precision, batch arithmetic, data. `processes` None: one process."""
    steps, images = len(train_loader) // args.grad_accum, len(train_loader.dataset)
    if not isinstance(precision, str):  # say what auto chose and why, or that bf16 is emulated here
        from .cli import amp_choice

        why = amp_choice(args.amp, device)[1]
        precision = _PRECISION[str(precision)] + (f" ({why})" if why != "as asked" else "")
    if processes is None:
        batch = f"batch {args.batch_size} x {args.grad_accum} accumulation"
        where = device
    else:
        batch = (f"batch {args.batch_size} per process x {processes} process{'es' * (processes != 1)} x "
                 f"{args.grad_accum} accumulation = "
                 f"{args.batch_size * processes * args.grad_accum} global")
        where = f"{processes} x {device.type}"
    return (f"{step}: {args.arch} on {where}, {prefix}amp {precision}, {batch}, {images} training images, "
            f"{steps} steps/epoch" + ("  [SYNTHETIC DATA, not CIFAR-10]" if synthetic else ""))


def train_row(totals, batches):
    """The training half of an epoch's row from totals = (loss sum, images) and that epoch's preempt.Batches (when it
    started, steps done of how many). Fewer steps than the epoch has: it stopped part-way ("partial"). The row a
    stopped run saved for the start of this epoch is merged in, so that the epoch's loss covers all of it. Several
    processes: "ranks" holds each rank's timing of this run's part of the epoch (preempt.Batches.timings)."""
    part = batches.part or {}
    loss_sum, seen = totals.tolist()
    loss_sum, seen = loss_sum + part.get("train_loss", 0.0) * part.get("images", 0), seen + part.get("images", 0)
    seconds = time.perf_counter() - batches.start + part.get("epoch_seconds", 0.0)
    row = {"train_loss": loss_sum / seen, "images_per_sec": seen / seconds, "epoch_seconds": seconds,
           "peak_memory_mb": max(peak_memory_mb(totals.device), part.get("peak_memory_mb", 0.0)),
           "steps": batches.steps, "images": int(seen), **({"ranks": batches.ranks} if batches.ranks else {})}
    return {**row, "partial": True, "of_steps": batches.of_steps} if batches.steps < batches.of_steps else row


def epoch_line(row, epochs):
    tag = "  [SYNTHETIC DATA]" if row.get("synthetic") else ""
    if row.get("partial"):
        return (f"epoch {row['epoch']:>3}/{epochs}  stopped after step {row['steps']}/{row['of_steps']}  "
                f"train_loss so far {row['train_loss']:.4f}  (saved; no evaluation){tag}")
    return (f"epoch {row['epoch']:>3}/{epochs}  train_loss {row['train_loss']:.4f}  "
            f"test_loss {row['test_loss']:.4f}  test_acc {100 * row['test_acc']:.2f}%  "
            f"{row['images_per_sec']:.0f} img/s  {row['epoch_seconds']:.1f} s{tag}{slowest_rank(row.get('ranks'))}")


SLOWER = 1.2  # a rank whose own time is more than 20% over the median rank's is named


def slowest_rank(ranks):
    """"  slowest rank R: ..." when a rank's own time (its train_s less its wait_s: the time it did not wait for a later
    rank) is more than 20% over the median rank's (for an even count, the lower of the middle two), else ""."""
    if not ranks:
        return ""
    own = [train - wait for train, wait in zip(ranks["train_s"], ranks["wait_s"])]
    median, slow = statistics.median_low(own), max(range(len(own)), key=own.__getitem__)
    if own[slow] <= SLOWER * median:
        return ""
    return (f"  slowest rank {slow}: {own[slow]:.1f} s of its own, the median rank {median:.1f} s "
            f"({ranks['data_s'][slow]:.1f} s of it waiting for data)")


def plot(out_dir, title):
    """Draw loss and accuracy per epoch from metrics.jsonl into training_curves.png."""
    rows = read(os.path.join(out_dir, FILE))
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    ax_loss.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * r["test_acc"] for r in rows], "o-", color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if any(r.get("synthetic") for r in rows):
        title += "  (SYNTHETIC DATA, not CIFAR-10)"
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, PLOT)
    try:
        fig.savefig(path, dpi=100)
    except OSError as error:  # the checkpoints and metrics.jsonl are written already: say so, do not fail the run
        print(f"warning: could not draw {path} ({error.strerror or error}); the checkpoints are complete",
              file=sys.stderr)
        path = None
    plt.close(fig)
    return path


def peak_memory_mb(device):
    """Peak memory of this process so far: the accelerator's allocator peak on a GPU, else the peak
    resident set size (which includes the Python interpreter and libraries). On Linux that is VmHWM: ru_maxrss
    survives exec, so a process started from a large parent (a notebook, a benchmark) would report the parent's."""
    import torch

    if device.type != "cpu":
        with contextlib.suppress(RuntimeError, NotImplementedError):  # an accelerator without memory statistics
            return torch.accelerator.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# Events of a collective in a torch.profiler trace: gloo's and NCCL's own spans (the time the collective was in flight,
# waiting for the other ranks included), c10d's operators, Horovod's.
COLLECTIVE = re.compile(r"gloo:|nccl|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|horovod", re.I)
PROFILE_AFTER = 3  # optimizer steps before the trace: DDP regroups its buckets after the first, caches settle


class Profile:
    """--profile N: a torch.profiler trace of N optimizer steps (from step PROFILE_AFTER + 1 of the run), written to
    out_dir/profile-rankR.json (open it in https://ui.perfetto.dev or chrome://tracing), and a line per rank that says
    where the steps' time went (docs/debugging.md): compute (the operators of the training loop's thread),
    communication (a collective in flight while that thread computes nothing: waiting for the other ranks), data
    (waiting for the next batch: the DATA spans) and other (Python, and whatever else held the rank up).
    preempt.Batches calls step() as each optimizer step begins, wraps each wait for a batch in data() and calls
    finish() when the epoch ends or stops: the loop does not change. On a GPU the operators are launched
    asynchronously: there the shares are the host's; the trace's GPU rows show the kernels and NCCL's."""

    DATA = "Batches: waiting for data"

    def __init__(self, args):
        self.steps, self.out_dir, self.count, self.profiler = args.profile, args.out_dir, 0, None

    def __bool__(self):
        """Something left to do: without --profile, or once its trace is written, Batches leaves it alone."""
        return bool(self.steps or self.profiler)

    def step(self):
        """An optimizer step begins."""
        self.count += 1
        if self.steps and self.count == PROFILE_AFTER + 1:
            import torch.profiler as tp

            activities = tp.supported_activities() if _accelerator_in_use() else [tp.ProfilerActivity.CPU]
            self.profiler, self.start = tp.profile(activities=activities), time.perf_counter()
            self.profiler.__enter__()
        elif self.profiler and self.count == PROFILE_AFTER + 1 + self.steps:
            self.finish(this_step_ran=False)

    def data(self):
        """A context around the loop's wait for its next batch: a DATA span in the trace."""
        import contextlib

        import torch.profiler as tp

        return tp.record_function(self.DATA) if self.profiler else contextlib.nullcontext()

    def finish(self, this_step_ran=True):
        """Stop the trace (as step N + 1 begins, or when the epoch ends or stops first), write it, say the shares."""
        if not self.profiler:
            return
        from .cli import rank

        seconds, profiler = time.perf_counter() - self.start, self.profiler
        steps = self.count - PROFILE_AFTER - (0 if this_step_ran else 1)
        profiler.__exit__(None, None, None)
        self.profiler, self.steps = None, 0  # once per run
        path = os.path.join(self.out_dir, f"profile-rank{rank()}.json")
        profiler.export_chrome_trace(path)
        shares = {name: part / seconds for name, part in _shares(profiler.events(), self.DATA).items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        print(f"profile rank {rank()}: {steps} steps, {1000 * seconds / max(steps, 1):.1f} ms each: "
              + ", ".join(f"{name} {100 * share:.0f}%" for name, share in shares.items()) + f" (trace: {path})",
              flush=True)


def _accelerator_in_use():
    import torch

    return torch.accelerator.is_available() and getattr(torch.get_device_module(), "is_initialized", bool)()


def _shares(events, data_name):
    """{compute, communication, data}: seconds of a trace. data: the loop's DATA spans. compute: its thread's
    operators (aten::, or a torch.compile'd region), outside them. communication: a collective in flight on any
    thread (gloo's run on threads of their own) while that thread computes nothing and waits for no data."""
    from collections import Counter

    main = next((e.thread for e in events if e.name.startswith("Optimizer.step")),  # the training loop's thread
                Counter(e.thread for e in events).most_common(1)[0][0] if events else None)
    cpu = [e for e in events if e.device_type.name == "CPU"]

    def spans(keep):  # an event still in flight when the trace stopped (a collective on its own thread) has no end
        return _union([(e.time_range.start, e.time_range.end) for e in cpu
                       if keep(e) and e.time_range.end >= e.time_range.start])

    data = spans(lambda e: e.thread == main and e.name == data_name)
    compute = spans(lambda e: e.thread == main and e.name.startswith(("aten::", "Torch-Compiled Region"))
                    and not COLLECTIVE.search(e.name))
    talk = spans(lambda e: COLLECTIVE.search(e.name))
    busy = _union(compute + data)
    seconds = {"compute": _length(compute) - _overlap(compute, data),
               "communication": _length(talk) - _overlap(talk, busy), "data": _length(data)}
    return {name: value / 1e6 for name, value in seconds.items()}  # microseconds


def _union(spans):
    """Disjoint, sorted [start, end] spans covering the same time as `spans`."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(spans):
    return sum(end - start for start, end in spans)


def _overlap(a, b):
    """Time two lists of disjoint, sorted spans share (one pass over both)."""
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
