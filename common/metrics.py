"""What a run reports: Log (metrics.jsonl, the console's lines, TensorBoard's event files, the
training curves, each rank's weight digest), and Meter (one rank's figures of an epoch's loop: its
timing, every --loss-every'th step's loss, and --profile's trace)."""
import contextlib
import json
import math
import os
import re
import resource
import statistics
import sys
import time

import torch
import torch.profiler as tp
from torch.optim.optimizer import register_optimizer_step_post_hook
from tqdm import tqdm

from .checkpoint import checkpoint_path, load, write_digest
from .cli import UserError, amp_choice, processes, rank

FILE, PLOT = "metrics.jsonl", "training_curves.png"


class Log:
    """The run's record, written by rank 0; metrics.jsonl has a row per finished epoch. A resumed
    run keeps the rows up to its checkpoint's epoch (whose row, if the run was killed before writing
    it, comes from the checkpoint)."""

    def __init__(self, step, args, start_epoch, info):
        self.step, self.args, self.info = step, args, info
        self.path, self.board = os.path.join(args.out_dir, FILE), None
        if rank() == 0:
            kept = read(self.path) if start_epoch else []
            rows = [row for row in kept if row["epoch"] <= start_epoch]
            recovered = []
            if start_epoch and start_epoch not in [row["epoch"] for row in rows]:
                with contextlib.suppress(UserError):
                    state = load(checkpoint_path(args.out_dir, start_epoch), mmap=True)
                    if state["metrics"]:
                        recovered = [{**state["metrics"], "synthetic": state["synthetic"]}]
            os.makedirs(args.out_dir, exist_ok=True)
            with open(self.path, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows + recovered)
            if args.tensorboard:
                self.board = Board.open(args.out_dir, sum(row.get("steps", 0) for row in rows))
            for row in recovered if self.board else ():
                self.board.epoch(row)

    def start(self, device, precision, loader, prefix=""):
        """The run's first line: model, devices, precision (what --amp auto chose, and why),
        batch arithmetic, data."""
        args, world = self.args, processes()
        if not isinstance(precision, str):
            why = amp_choice(args.amp, device)[1]
            precision = {torch.float16: "fp16", torch.bfloat16: "bf16", None: "off"}[precision] + (
                f" ({why})" if why != "as asked" else "")
        batch = (f"batch {args.batch_size} x {args.grad_accum} accumulation" if world == 1 else
                 f"batch {args.batch_size} per process x {world} processes x {args.grad_accum} "
                 f"accumulation = {args.batch_size * world * args.grad_accum} global")
        if rank() == 0:
            where = device if world == 1 else f"{world} x {device.type}"
            tag = "  [SYNTHETIC DATA, not CIFAR-10]" if self.info.synthetic else ""
            print(f"{self.step}: {args.arch} on {where}, {prefix}amp {precision}, {batch}, "
                  f"{len(loader.dataset)} training {self.info.unit}, "
                  f"{math.ceil(len(loader) / args.grad_accum)} steps/epoch" + tag, flush=True)

    def epoch(self, row):
        """A finished epoch's row into metrics.jsonl (a part-way one is in its checkpoint instead),
        and its line."""
        row = {**row, "synthetic": self.info.synthetic}
        if rank() == 0:
            if not row.get("partial"):
                with open(self.path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if self.board:
                    self.board.epoch(row)
            print(epoch_line(row, self.args.epochs, self.info.unit), flush=True)

    def finish(self, model_state):
        """The training curves (rank 0), and this rank's weights-rankN.sha256:
        equal files = equal states."""
        if rank() == 0:
            many = f", {processes()} processes" * (processes() > 1)
            plot(self.args.out_dir, f"{self.step} ({self.args.arch}{many})")
            if self.board:
                self.board.writer.close()
        write_digest(self.args.out_dir, rank(), model_state)


class Board:
    """TensorBoard's view of a run, in its --out-dir (rank 0 writes it): each finished epoch's row
    of metrics.jsonl as scalars "epoch/<key>" at the optimizer step that ended the epoch, and its
    kept steps' losses as "step/train_loss", all on one axis of optimizer steps. A resumed run goes
    on from the steps of the epochs it keeps and hides what an earlier attempt wrote from there on
    (SummaryWriter's purge_step); a part-way epoch is written once it finishes, so it shows once."""
    EPOCH = ("train_loss", "test_loss", "test_acc", "lr", "images_per_sec", "epoch_seconds")

    def __init__(self, writer, steps):
        self.writer, self.steps = writer, steps

    @classmethod
    def open(cls, out_dir, steps):
        """The board of a run whose finished epochs took `steps` optimizer steps, or None (one line
        says so) where the tensorboard package is missing."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            print(f"note: no TensorBoard files ({error}): pip install tensorboard, or pass "
                  "--no-tensorboard", file=sys.stderr)
            return None
        # The finished epochs' scalars sit at their last step: what comes after them goes.
        return cls(SummaryWriter(out_dir, purge_step=steps + 1), steps)

    def epoch(self, row):
        start, self.steps = self.steps, self.steps + row["steps"]
        for step, loss in row.get("loss_steps", []):
            self.writer.add_scalar("step/train_loss", loss, start + step)
        for key in [key for key in self.EPOCH if row.get(key) is not None]:
            self.writer.add_scalar(f"epoch/{key}", row[key], self.steps)
        self.writer.add_scalar("epoch/epoch", row["epoch"], self.steps)
        if row.get("ranks"):
            slowest = max(row["ranks"]["train_s"])
            self.writer.add_scalar("epoch/slowest_rank_seconds", slowest, self.steps)
        self.writer.flush()


def read(path):
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
    return []


# The rate's unit on an epoch's line, by what build_data calls a sample (data.Info.unit).
RATE = {"images": "img/s"}


def epoch_line(row, epochs, unit="images"):
    tag = "  [SYNTHETIC DATA]" if row.get("synthetic") else ""
    if row.get("partial"):
        return (f"epoch {row['epoch']:>3}/{epochs}  stopped after step "
                f"{row['steps']}/{row['of_steps']}  train_loss so far {row['train_loss']:.4f}  "
                f"(saved; no evaluation){tag}")
    return (f"epoch {row['epoch']:>3}/{epochs}  train_loss {row['train_loss']:.4f}  "
            f"test_loss {row['test_loss']:.4f}  test_acc {100 * row['test_acc']:.2f}%  "
            f"{row['images_per_sec']:.0f} {RATE.get(unit, unit + '/s')}  "
            f"{row['epoch_seconds']:.1f} s"
            f"{tag}{slowest_rank(row.get('ranks'))}")


def slowest_rank(ranks, slower=1.2):
    """"  slowest rank R: ..." when a rank's own time (train_s less wait_s, its wait for a later
    rank) is over 20% more than the median rank's (of an even count, the lower middle one), else
    ""."""
    if not ranks:
        return ""
    own = [train - wait for train, wait in zip(ranks["train_s"], ranks["wait_s"])]
    median, slow = statistics.median_low(own), max(range(len(own)), key=own.__getitem__)
    return "" if own[slow] <= slower * median else (
        f"  slowest rank {slow}: {own[slow]:.1f} s of its own, the median rank {median:.1f} s "
        f"({ranks['data_s'][slow]:.1f} s of it waiting for data)")


def plot(out_dir, title):
    """Loss and accuracy per epoch from metrics.jsonl, drawn into training_curves.png."""
    rows, path = read(os.path.join(out_dir, FILE)), os.path.join(out_dir, PLOT)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs, synthetic = [r["epoch"] for r in rows], any(r.get("synthetic") for r in rows)
    fig, (loss, acc) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("train", "test"):
        loss.plot(epochs, [r[f"{name}_loss"] for r in rows], "o-", label=name)
    acc.plot(epochs, [100 * r["test_acc"] for r in rows], "o-", color="tab:green")
    loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (loss, acc):
        # pyplot imports matplotlib.ticker.
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    loss.legend()
    fig.suptitle(title + ("  (SYNTHETIC DATA, not CIFAR-10)" if synthetic else ""))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as error:
        # The checkpoints and metrics.jsonl are written already: say so, do not fail the run.
        print(f"warning: could not draw {path} ({error.strerror or error}); the checkpoints are "
              "complete", file=sys.stderr)
        path = None
    plt.close(fig)
    return path


def peak_memory_mb(device):
    """Peak memory of this process so far: the accelerator's allocator peak, else the peak resident
    set size (interpreter and libraries included): Linux's VmHWM, as ru_maxrss survives exec and
    would report a large parent's."""
    # These come from an accelerator without memory statistics.
    with contextlib.suppress(RuntimeError, NotImplementedError):
        if device.type != "cpu":
            return torch.accelerator.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError, StopIteration), open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# The learning rate of the process's last optimizer step, noted by a hook on every optimizer's step
# (torch's global one), so that no step's loop hands it over.
LEARNING_RATE = {}


def note_learning_rate(optimizer, args, kwargs):
    LEARNING_RATE["last"] = optimizer.param_groups[0]["lr"]


# Arrival times count from here (2023-11), not 1970: sums of them keep their precision.
ARRIVALS_FROM = 1.7e9
# Optimizer steps before --profile's trace: DDP regroups its buckets after the first, caches settle.
PROFILE_AFTER = 3


class Bar(tqdm):
    """tqdm without its monitor thread. tqdm starts one with every bar (a hidden one too) and ends
    it when the bar closes, just before evaluation forks its DataLoader workers: a fork while a
    thread is ending can leave the child blocked for ever in CPython 3.11 (seen here as a rank
    waiting for a test batch its worker never sent)."""
    monitor_interval = 0


class Meter:
    """One rank's figures of each epoch's loop, for its row of metrics.jsonl. The loop calls
    batch_in_hand() as a batch arrives and batch_done() after its pass: the time between is spent
    waiting for data (data_s). Each optimizer step's last batch notes when it arrived (one clock for
    every rank): gathered once per epoch (timing()), the arrivals say which rank held the others up
    (wait_s). --profile N traces optimizer steps PROFILE_AFTER + 1 to PROFILE_AFTER + N into
    --out-dir/profile-rankR.json and says where their time went (docs/debugging.md)."""

    def __init__(self, args, steps_per_epoch):
        self.grad_accum, self.of_steps = args.grad_accum, steps_per_epoch
        self.out_dir, self.loss_every = args.out_dir, args.loss_every
        self.profile_steps, self.optimizer_steps, self.profiler = args.profile, 0, None
        if "hook" not in LEARNING_RATE:
            LEARNING_RATE["hook"] = register_optimizer_step_post_hook(note_learning_rate)

    def start(self, part, skipped):
        """An epoch begins; `part`: the row a stopped run saved for it,
        whose `skipped` steps this run does not do."""
        self.part, self.skipped, self.passes = part or {}, skipped, 0
        self.data_seconds, self.arrivals, self.losses, self.group_loss = 0.0, [], [], 0.0
        self.bar = Bar(total=self.of_steps, initial=skipped, unit="step", leave=False,
                       disable=rank() != 0 or not sys.stderr.isatty())  # by rank 0, on a terminal
        self.begin = self.ready = time.perf_counter()

    def batch_in_hand(self):
        self.data_seconds += time.perf_counter() - self.ready
        if self.passes % self.grad_accum == 0:  # an optimizer step begins
            self._profile_step()
        # The pass whose backward meets the other ranks (timing() adds a short last step's).
        self.arrived = time.time() - ARRIVALS_FROM
        if self.passes % self.grad_accum == self.grad_accum - 1:
            self.arrivals.append(self.arrived)
        self.passes += 1

    def batch_done(self, loss=None):
        """After a pass; `loss`: its loss, whose mean over the passes of every --loss-every'th
        optimizer step is kept on the device until the epoch's row."""
        done = self.passes % self.grad_accum == 0
        if loss is not None:
            self.group_loss = self.group_loss + loss.detach().float()
        step = self.skipped + math.ceil(self.passes / self.grad_accum)
        if loss is not None and done and step % self.loss_every == 0:
            self.losses.append((step, self.group_loss / self.grad_accum))
        self.group_loss = 0.0 if done else self.group_loss
        self.bar.update(done)  # an optimizer step is done
        self.ready = time.perf_counter()

    def timing(self):
        """This rank's timing of the epoch in its own slots of a vector that a max over ranks
        (collective) fills with every rank's: each step's last arrival, then (train_s, data_s, the
        sum of its arrivals) per rank. Called once, after the epoch's loop."""
        if self.passes % self.grad_accum:  # the epoch's last step was short: its last pass
            self.arrivals.append(self.arrived)
        steps, me = len(self.arrivals), len(self.arrivals) + 3 * rank()
        row = torch.zeros(steps + 3 * processes(), dtype=torch.float64)
        # float64, as every figure here: sums of arrivals stay exact.
        row[:steps] = row.new_tensor(self.arrivals)
        mine = [time.perf_counter() - self.begin, self.data_seconds, sum(self.arrivals)]
        row[me:me + 3] = row.new_tensor(mine)
        return row

    def row(self, totals, timing=None):
        """The training half of the epoch's row from totals = (loss sum, samples) summed over ranks
        and `timing` gathered (None: one process), the part a stopped run saved merged in; "partial"
        if it stopped part-way."""
        self._profile_stop()
        self.bar.close()
        # An epoch's last optimizer step may have fewer passes: it counts as one.
        part, steps = self.part, self.skipped + math.ceil(self.passes / self.grad_accum)
        loss_sum, seen = totals.tolist()
        loss_sum += part.get("train_loss", 0.0) * part.get("images", 0)
        seen += part.get("images", 0)
        seconds = time.perf_counter() - self.begin + part.get("epoch_seconds", 0.0)
        peak = max(peak_memory_mb(totals.device), part.get("peak_memory_mb", 0.0))
        row = {"train_loss": loss_sum / seen, "images_per_sec": seen / seconds,
               "epoch_seconds": seconds, "peak_memory_mb": peak, "steps": steps,
               "images": int(seen), "lr": LEARNING_RATE.get("last")}
        kept = torch.stack([loss for _, loss in self.losses]).tolist() if self.losses else []
        row["loss_steps"] = part.get("loss_steps", []) + [
            [step, loss] for (step, _), loss in zip(self.losses, kept)]
        if timing is not None:
            # Summed as a list: apex.amp O1 makes a CUDA tensor's sum() fp32 (seen on an H100).
            last, done = sum(timing[:len(self.arrivals)].tolist()), len(self.arrivals)
            train, data, arrived = timing[done:].view(processes(), 3).T.tolist()
            waits = [max(0.0, last - mine) for mine in arrived]
            row["ranks"] = {name: [round(seconds, 3) for seconds in values] for name, values in (
                ("train_s", train), ("data_s", data), ("wait_s", waits))}
        return {**row, "partial": True, "of_steps": self.of_steps} if steps < self.of_steps else row

    def _profile_step(self):
        self.optimizer_steps += 1
        if self.profile_steps and self.optimizer_steps == PROFILE_AFTER + 1:
            gpu = torch.accelerator.is_available() and getattr(
                torch.get_device_module(), "is_initialized", bool)()
            activities = tp.supported_activities() if gpu else [tp.ProfilerActivity.CPU]
            self.profiler = tp.profile(activities=activities)
            self.profiler.__enter__()
            self.traced, self.profile_begin = 0, time.perf_counter()
        elif self.profiler:
            self.traced += 1
            if self.traced == self.profile_steps:
                self._profile_stop(steps=self.traced)

    def _profile_stop(self, steps=None):
        """Stop the trace (as step N + 1 begins, or when the epoch ends or stops first),
        write it, say the shares."""
        if not self.profiler:
            return
        seconds, profiler = time.perf_counter() - self.profile_begin, self.profiler
        steps = steps or self.traced + 1
        profiler.__exit__(None, None, None)
        self.profiler, self.profile_steps = None, 0  # once per run
        path = os.path.join(self.out_dir, f"profile-rank{rank()}.json")
        profiler.export_chrome_trace(path)
        shares = {name: part / seconds for name, part in _shares(profiler.events()).items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        parts = ", ".join(f"{name} {100 * share:.0f}%" for name, share in shares.items())
        # One write: ranks' lines never share a line.
        print(f"profile rank {rank()}: {steps} steps, {1000 * seconds / steps:.1f} ms each: "
              f"{parts} (trace: {path})\n", end="", flush=True)


# Events of a collective in a torch.profiler trace: gloo's and NCCL's own spans (the time the
# collective was in flight, waiting for the other ranks included), c10d's operators, FSDP's
# (Broadcast: DataParallel's copies). DATA: the DataLoader's wait for a batch.
COLLECTIVE = re.compile(r"gloo:|nccl:|c10d::|FSDP::(all_|reduce_)|Broadcast")
DATA = "enumerate(DataLoader)#"


def _shares(events):
    """Seconds of a trace: data, the loop's waits for batches; compute, its thread's operators
    outside them; communication, a collective in flight on any thread (gloo's have their own) while
    the loop computes nothing and has its data."""
    from collections import Counter

    # The training loop's thread.
    main = next((e.thread for e in events if e.name.startswith("Optimizer.step")),
                Counter(e.thread for e in events).most_common(1)[0][0] if events else None)

    # An event still in flight when the trace stopped (a collective on its own thread) has no end.
    def spans(keep):
        return [(e.time_range.start, e.time_range.end) for e in events
                if e.device_type.name == "CPU" and keep(e)
                and e.time_range.end >= e.time_range.start]

    data = spans(lambda e: e.thread == main and e.name.startswith(DATA))
    compute = spans(lambda e: e.thread == main
                    and e.name.startswith(("aten::", "Torch-Compiled Region"))
                    and not COLLECTIVE.search(e.name))
    talk = spans(lambda e: COLLECTIVE.search(e.name))
    # The time covered by A, not B: |A u B| - |B|.
    seconds = {"compute": _covered(compute + data) - _covered(data),
               "communication": _covered(talk + compute + data) - _covered(compute + data),
               "data": _covered(data)}
    return {name: value / 1e6 for name, value in seconds.items()}  # microseconds


def _covered(spans):
    """The time that the [start, end] `spans` cover, overlaps counted once."""
    total, reach = 0, float("-inf")
    for start, end in sorted(spans):
        total += max(0, end - max(start, reach))
        reach = max(reach, end)
    return total
