"""Benchmark every step: the same model, data, global batch and hyper-parameters, each through its real launcher.

    python scripts/benchmark.py                          # every step that can run here, --arch cnn, on the CPU
    python scripts/benchmark.py --arch resnet18 --steps 01,02
    python scripts/benchmark.py --quick                  # tiny data, 1 epoch, no extra knob runs (what the tests run)
    python scripts/benchmark.py --gpu --arch resnet18    # on the GPUs of this machine (--nproc defaults to their count)

It writes to --out-dir (default bench/):
    results.md     the results tables, the hardware, the library versions and the exact command
    results.json   the same numbers, machine-readable (a figure that was not measured is null, never 0)
    results.png    images/sec per step and process count, with the pure compute rate as a reference
    runs/NAME/     every run's own out-dir (metrics.jsonl, checkpoints, curves) and log.txt
    data/          the synthetic CIFAR-10 it trains on (unless --data-dir is given)

What is measured, and how:
* Every step is started as the README starts it (python, torchrun, deepspeed, horovodrun,
  torch.distributed.launch) and its figures come from the metrics.jsonl it writes: images/sec of the
  training loop (all processes together), seconds per epoch, peak memory of rank 0, final test
  accuracy and loss. Steady state = the mean over epochs 2..N (epoch 1 pays warm-up and compile).
* The pure compute rate: in this process, the same model, optimizer and precision settings on random
  uint8 batches already in memory (forward + backward + optimizer step, nothing else), with the
  threads of the step's processes. loop/compute = training loop rate / (processes x that rate) shows
  what the data pipeline and the communication cost; train/wall shows the launcher, start-up,
  evaluation and checkpoint overhead.
* The data loader alone: the scripts' DataLoader set-up iterated without a model.
* The speed knobs of step 02, one at a time, on vs off (channels_last, autocast, torch.compile,
  loader workers, persistent workers, a .item() per step, pinned memory).
On the CPU, one process gets all cores as threads and N processes get cores/N threads each (as
torchrun's OMP_NUM_THREADS=1 does on 2 cores), so every step uses the same total threads.
"""
import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `common` lives at the repository root

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402

from common import data, metrics, models  # noqa: E402
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int  # noqa: E402
from common.synthetic import write_synthetic_cifar10  # noqa: E402

BIN = Path(sys.executable).parent  # the venv's bin/: torchrun, deepspeed, horovodrun live next to python
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4  # the optimizer every step uses
SYNTHETIC_NOTE = ("SYNTHETIC DATA (common.synthetic): test accuracy and loss are not CIFAR-10 figures; "
                  "throughput does not depend on the pixel values")


# ----------------------------------------------------------------------------- the steps and their launchers
class Step:
    """How a numbered script is started and what it needs."""

    def __init__(self, number, launcher, multi_process, library=None, launcher_bin=None, install=None):
        self.number = number
        self.launcher = launcher  # python | torchrun | deepspeed | horovodrun | torch.distributed.launch
        self.multi_process = multi_process  # one process per device, --batch-size per process
        self.library = library  # import name the step needs, or None
        self.launcher_bin = launcher_bin  # executable in the venv's bin/, or None for python
        self.install = install  # how to install the library

    @property
    def label(self):
        return f"{self.number:02d}"

    def script(self):
        found = sorted(REPO.glob(f"{self.number:02d}_cifar10_*.py"))
        return found[0] if found else None


STEPS = {s.number: s for s in [
    Step(1, "python", False),
    Step(2, "python", False),
    Step(3, "python", False),
    Step(4, "torchrun", True, launcher_bin="torchrun"),
    Step(5, "deepspeed", True, library="deepspeed", launcher_bin="deepspeed",
         install="pip install -r requirements.txt"),
    Step(6, "horovodrun", True, library="horovod", launcher_bin="horovodrun",
         install="bash scripts/install_horovod.sh"),
    Step(7, "torch.distributed.launch", True),
]}


def why_not_runnable(step):
    """None if the step can be started here, else the reason (one line)."""
    if step.script() is None:
        return f"no {step.label}_cifar10_*.py in {REPO}"
    if step.library and importlib.util.find_spec(step.library) is None:
        return f"{step.library} is not installed for {sys.executable} ({step.install})"
    if step.launcher_bin and not (BIN / step.launcher_bin).exists():
        return f"launcher {step.launcher_bin} not found in {BIN} ({step.install})"
    return None


# ----------------------------------------------------------------------------- argument parsing
def step_list(text):
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers like 01,02,04, got {text!r}") from None
    unknown = [n for n in numbers if n not in STEPS]
    if unknown or not numbers:
        raise argparse.ArgumentTypeError(f"steps are 01-07, got {text!r}")
    return sorted(set(numbers))


def count_list(text):
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected process counts like 2 or 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"process counts must be 1 or more, got {text!r}")
    return counts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Benchmark every step of the collection (see the module docstring).")
    parser.add_argument("--quick", action="store_true",
                        help="tiny synthetic data, 1 epoch, short timings, no extra knob runs (seconds; for tests)")
    parser.add_argument("--arch", choices=sorted(models.ARCHS), default="cnn",
                        help="model of every step (default cnn; resnet18 is ~40-85 img/s per CPU core)")
    parser.add_argument("--steps", type=step_list, default=sorted(STEPS),
                        help="steps to run, e.g. 01,02,04 (default all)")
    parser.add_argument("--nproc", type=count_list,
                        help="process counts for the multi-process steps 04-07, e.g. 2 or 1,2 "
                             "(default: 2 on the CPU, the number of GPUs with --gpu)")
    parser.add_argument("--epochs", type=positive_int, help="epochs per run (default 3, --quick 1); 2 or more "
                        "gives a steady-state figure without epoch 1")
    parser.add_argument("--batch-size", type=positive_int, help="GLOBAL batch of every step (default 128, --quick 32); "
                        "04-07 get batch / processes each")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="peak learning rate (default 0.1)")
    parser.add_argument("--workers", type=non_negative_int, default=2,
                        help="DataLoader workers per process (default 2, the scripts' default)")
    parser.add_argument("--amp", choices=["off", "bf16", "fp16", "auto"], default="off",
                        help="--amp of steps 02-07 (default off: 01 has no autocast, so all steps compute alike)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False,
                        help="--channels-last of steps 02-07 (default off, like 01)")
    parser.add_argument("--knob-runs", action=argparse.BooleanOptionalAction,
                        help="measure 02's knobs also as full training runs (default on; off with --quick)")
    parser.add_argument("--gpu", action="store_true",
                        help="use the CUDA GPUs (default: the CPU only, GPUs hidden from the runs)")
    parser.add_argument("--data-dir", help="an existing CIFAR-10 root (default: generate synthetic data in OUT/data)")
    parser.add_argument("--train-size", type=positive_int, help="synthetic training images (default 5000, --quick 256)")
    parser.add_argument("--test-size", type=positive_int, help="synthetic test images (default 1000, --quick 64)")
    parser.add_argument("--out-dir", default="bench", help="where results.md/.json/.png and runs/ go (default bench)")
    parser.add_argument("--timeout", type=positive_int, default=1800, help="seconds before a run counts as failed")
    parser.add_argument("--quiet-wait", type=non_negative_int, default=0, metavar="SECONDS",
                        help="on a shared machine: before each run wait up to this long for other work to stop "
                             "(default 0: do not wait; every run reports how busy the machine was anyway)")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, small in [("epochs", 3, 1), ("batch_size", 128, 32), ("train_size", 5000, 256),
                              ("test_size", 1000, 64)]:
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.knob_runs is None:
        args.knob_runs = not quick
    args.out_dir = os.path.abspath(args.out_dir)  # the runs start in the repository root, not here
    # Pure compute: warm-up steps, then at least min_steps timed steps lasting about compute_seconds,
    # repeated (best of).
    args.warmup, args.min_steps, args.compute_seconds, args.repeats = (1, 2, 0.2, 1) if quick else (3, 5, 1.5, 5)
    return args


# ----------------------------------------------------------------------------- machine, versions, environment
def cpu_model():
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def usable_cores():
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def memory_gib():
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2**20, 1)
    return None


def version(name):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(name)
    return None


def hardware(gpu):
    info = {"cpu": cpu_model(), "cores": usable_cores(), "memory_gib": memory_gib(),
            "platform": platform.platform(), "gpus": []}
    if gpu:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def versions():
    apex_spec = importlib.util.find_spec("apex")
    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": version("torchvision"),
            "deepspeed": version("deepspeed"), "horovod": version("horovod"),
            "apex": (version("apex") or "installed") if apex_spec else None,
            "cuda": torch.version.cuda}


def load_average():
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def machine_cpu_seconds():
    """CPU seconds the whole machine has been busy (steal included) since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process and of every child process it has waited for (runs and their ranks)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def become_subreaper():
    """Linux: descendants of a run that outlive their parent (a DataLoader forkserver outlives its rank by a
    moment) are handed to this process instead of init, so that reap_orphans() counts their CPU time."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans(timeout=10):
    """Wait for the orphaned descendants of the run that just ended (at most timeout seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.05)


class OtherWork:
    """Measures how many cores OTHER work on the machine kept busy, on average, during a with-block."""

    def __enter__(self):
        self.start = (time.perf_counter(), machine_cpu_seconds(), own_cpu_seconds())
        return self

    def __exit__(self, *exc):
        wall, machine, own = (b - a if a is not None else None for a, b in zip(
            self.start, (time.perf_counter(), machine_cpu_seconds(), own_cpu_seconds())))
        self.cores = None if machine is None else max(0.0, (machine - own) / max(wall, 1e-9))
        return False


def wait_for_quiet(max_seconds, cores):
    """Wait (at most max_seconds) until other work uses less than a tenth of the cores. Returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_seconds:
        with OtherWork() as other:
            time.sleep(2)
        if other.cores is None or other.cores < 0.1 * cores:
            break
        print(f"   waiting for a quiet machine: other work keeps {other.cores:.2f} cores busy", flush=True)
    return time.perf_counter() - start


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(threads, gpu, extra=None):
    """The environment of one run: the launcher's threads, the venv's bin first, GPUs hidden on the CPU."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU benchmark stays on the CPU also on a GPU machine
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed: without it, it probes for GPUs and warns
    env.update(extra or {})
    return env


# ----------------------------------------------------------------------------- data
def prepare_data(args):
    if args.data_dir:
        data_dir = Path(args.data_dir)
    else:
        data_dir = Path(args.out_dir) / "data"
        meta = data_dir / data.FOLDER / "batches.meta"
        sizes = data_dir / "sizes.json"
        wanted = {"train": args.train_size, "test": args.test_size}
        if not (meta.is_file() and sizes.is_file() and json.loads(sizes.read_text()) == wanted):
            write_synthetic_cifar10(str(data_dir), train_size=args.train_size, test_size=args.test_size)
            sizes.write_text(json.dumps(wanted))
    data.prepare_cifar10(str(data_dir), download=False)  # a UserError with the fix if it is not there
    return data_dir


# ----------------------------------------------------------------------------- in-process measurements
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_amp(amp, device):
    return {"auto": "fp16" if device.type == "cuda" else "bf16"}.get(amp, amp)


def compute_rate(arch, batch, threads, device, amp="off", channels_last=False, sync_each_step=False,
                 warmup=3, min_steps=5, seconds=3.0, repeats=3):
    """Images/sec of forward + backward + optimizer step on batches already in memory.

    The best of `repeats` timings: other work on the machine only ever slows a timing down, so the
    fastest one is the closest to what the model itself can do."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the scripts do
    amp_dtype = AMP_DTYPES[resolve_amp(amp, device)]
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = models.build_model(arch).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                                nesterov=True)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, generator=generator)
                .to(device, memory_format=memory_format),
                torch.randint(0, 10, (batch,), generator=generator).to(device)) for _ in range(4)]

    def train_step(i):
        images, labels = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    start = time.perf_counter()
    for i in range(warmup):  # allocator, oneDNN/cuDNN algorithm choice
        train_step(i)
    synchronize(device)
    per_step = (time.perf_counter() - start) / warmup
    steps = max(min_steps, min(1000, int(seconds / max(per_step, 1e-6))))
    rates = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for i in range(steps):
            loss = train_step(i)
            if sync_each_step:
                loss.item()  # what a per-step print or log does: the host waits for the device
        synchronize(device)
        rates.append(steps * batch / (time.perf_counter() - start))
    return max(rates)


def loader_rate(data_dir, batch, workers, threads, device, persistent=True, pin_memory=False, epochs=2):
    """The scripts' training DataLoader without a model: (steady images/sec, mean seconds per epoch incl. start).

    Steady = the last epoch; with device=cuda each batch is also copied to the GPU (pinned + non_blocking
    when pin_memory)."""
    torch.set_num_threads(threads)
    train_set, _ = data.cifar10_datasets(str(data_dir), seed=0)
    loader = DataLoader(train_set, batch_size=batch, sampler=RandomSampler(train_set, generator=torch.Generator()),
                        num_workers=workers, persistent_workers=persistent and workers > 0, drop_last=True,
                        pin_memory=pin_memory)
    if len(loader) == 0:
        return None, None
    seconds = []
    for epoch in range(1, epochs + 1):
        loader.sampler.generator.manual_seed(epoch)
        train_set.set_epoch(epoch)
        seen, start = 0, time.perf_counter()
        for images, labels in loader:
            if device.type == "cuda":
                images = images.to(device, non_blocking=pin_memory)
                labels = labels.to(device, non_blocking=pin_memory)
            seen += len(labels)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    del loader  # stops persistent workers
    return seen / seconds[-1], sum(seconds) / len(seconds)


# ----------------------------------------------------------------------------- running the steps
def script_flags(path):
    """Which optional flags a script has (read from its source: cheaper than starting it with --help)."""
    text = path.read_text()
    return {"amp": '"--amp"' in text, "channels_last": '"--channels-last"' in text, "compile": '"--compile"' in text,
            "deepspeed_config": "deepspeed_config" in text or "deepspeed-config" in text}


def deepspeed_notes(config_path):
    """What ds_config.json sets beyond the common hyper-parameters (the command line overrides batch, lr, amp)."""
    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError):
        return []
    notes = [f"ZeRO stage {config.get('zero_optimization', {}).get('stage', 0)} from ds_config.json"]
    if config.get("gradient_clipping"):
        notes.append(f"gradient clipping {config['gradient_clipping']} (the other steps do not clip)")
    return notes


def launch_command(step, nproc, script, script_args):
    port = str(free_port())
    if step.launcher == "python":
        return [sys.executable, str(script), *script_args]
    if step.launcher == "torchrun":
        return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={port}", str(script), *script_args]
    if step.launcher == "torch.distributed.launch":
        return [sys.executable, "-m", "torch.distributed.launch", f"--nproc_per_node={nproc}", f"--master_port={port}",
                str(script), *script_args]
    if step.launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, str(script), *script_args]
    if step.launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", sys.executable, str(script),
                *script_args]
    raise ValueError(step.launcher)


def error_line(output):
    """The one-line error of a script (common.cli.exits_cleanly prints 'error: ...'), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        match = re.match(r"^(?:\[rank \d+\] )?error: (.*)$", line)
        if match:
            return match.group(1)
    return lines[-1][:300] if lines else "no output"


def steady(rows):
    """Rows that show the steady state: epochs 2..N (epoch 1 pays warm-up and compile), or epoch 1 alone."""
    return rows[1:] if len(rows) > 1 else rows


def run_step(step, nproc, args, ctx, name=None, amp=None, channels_last=None, workers=None, compile_model=False):
    """Start one step through its launcher; returns its result row (status ran / not run / failed)."""
    gpu = args.gpu
    amp = args.amp if amp is None else amp
    channels_last = args.channels_last if channels_last is None else channels_last
    workers = args.workers if workers is None else workers
    name = name or (f"{step.label}-np{nproc}" if step.multi_process else step.label)
    threads = max(1, ctx["cores"] // nproc)
    row = {"step": step.label, "name": name, "launcher": step.launcher, "processes": nproc,
           "threads_per_process": threads, "global_batch": args.batch_size, "workers": workers,
           "amp": amp, "channels_last": channels_last, "compile": compile_model, "status": "not run",
           "reason": None, "notes": []}
    if gpu and step.number > 1:  # 01 is the CPU baseline and stays on the CPU
        row.update(device="cuda", devices=ctx["gpus"] if step.number == 3 else nproc)
    else:
        row.update(device="cpu", devices=1)  # the whole CPU: every run uses all its cores
    reason = why_not_runnable(step)
    if reason is None and gpu and step.multi_process and nproc > ctx["gpus"]:
        reason = f"{nproc} processes need {nproc} GPUs; this machine has {ctx['gpus']}"
    if reason is None and args.batch_size % nproc:
        reason = f"global batch {args.batch_size} does not split into {nproc} processes"
    if reason:
        row["reason"] = reason
        return row
    script = step.script()
    flags = script_flags(script)
    out_dir = Path(args.out_dir) / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    per_process = args.batch_size // nproc if step.multi_process else args.batch_size
    script_args = ["--data-dir", str(ctx["data_dir"]), "--out-dir", str(out_dir), "--epochs", str(args.epochs),
                   "--batch-size", str(per_process), "--lr", str(args.lr), "--arch", args.arch,
                   "--workers", str(workers), "--seed", "0"]
    if flags["amp"]:
        script_args += ["--amp", amp]
    elif amp != "off":
        row["notes"].append("no --amp in this step: fp32")
    if flags["channels_last"]:
        script_args.append("--channels-last" if channels_last else "--no-channels-last")
    elif channels_last:
        row["notes"].append("no --channels-last in this step: NCHW")
    if compile_model:
        if not flags["compile"]:
            row["reason"] = "this step has no --compile"
            return row
        script_args.append("--compile")
    extra_env = {}
    if compile_model:  # a fresh cache, so the first epoch shows the real cold-start cost
        extra_env["TORCHINDUCTOR_CACHE_DIR"] = str((out_dir / "inductor-cache").resolve())
    if step.number == 5 and flags["deepspeed_config"] and (REPO / "ds_config.json").is_file():
        script_args += ["--deepspeed_config", str(REPO / "ds_config.json")]  # as the README runs it
        row["notes"] += deepspeed_notes(REPO / "ds_config.json")
    if step.number == 3 and not gpu:
        row["notes"].append("DataParallel without a GPU runs the model as it is")
    command = launch_command(step, nproc, script, script_args)
    row["command"] = shlex.join(command)
    print(f"== {name}: {row['command']}", flush=True)
    row["waited_for_quiet_seconds"] = wait_for_quiet(args.quiet_wait, ctx["cores"]) if args.quiet_wait else 0.0
    row["load_average"] = load_average()
    start = time.perf_counter()
    with OtherWork() as other:
        try:
            proc = subprocess.run(command, cwd=REPO, env=run_env(threads, gpu, extra_env), timeout=args.timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            output, returncode = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as error:
            output = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
            returncode = None
        wall = time.perf_counter() - start
        reap_orphans()
    row["other_work_cores"] = other.cores
    (out_dir / "log.txt").write_text(output)
    row.update(out_dir=str(out_dir), wall_seconds=wall)
    rows = metrics.read(str(out_dir / metrics.FILE))
    if returncode is None:
        row.update(status="failed", reason=f"timed out after {args.timeout} s (log: {out_dir / 'log.txt'})")
    elif returncode == 2 and "error: " in output:
        row.update(status="not run", reason=error_line(output))  # the script's own one-line reason (missing library...)
    elif returncode != 0:
        row.update(status="failed", reason=f"exit {returncode}: {error_line(output)}")
    elif [r["epoch"] for r in rows] != list(range(1, args.epochs + 1)):
        row.update(status="failed", reason=f"exit 0 but metrics.jsonl has epochs {[r['epoch'] for r in rows]}")
    else:
        row["status"] = "ran"
    for line in output.splitlines():
        if line.startswith("amp backend:"):  # 07 says which backend --amp-backend auto chose
            row["notes"].append(line.strip()[:160])
    if row["status"] != "ran":
        print(f"   {row['status']}: {row['reason']}", flush=True)
        return row
    timed = steady(rows)
    row.update(
        # images over seconds of the timed epochs (a mean of per-epoch rates would overweight fast epochs)
        images_per_sec=sum(r["images_per_sec"] * r["epoch_seconds"] for r in timed)
        / sum(r["epoch_seconds"] for r in timed),
        epoch_seconds=statistics.mean(r["epoch_seconds"] for r in timed),
        epoch_images_per_sec=[r["images_per_sec"] for r in rows],
        first_epoch_seconds=rows[0]["epoch_seconds"],
        timed_epochs=[r["epoch"] for r in timed],
        peak_memory_mb=rows[-1].get("peak_memory_mb"),
        test_acc=rows[-1]["test_acc"], test_loss=rows[-1]["test_loss"], train_loss=rows[-1]["train_loss"],
        synthetic=bool(rows[-1].get("synthetic")),
        train_share_of_wall=sum(r["epoch_seconds"] for r in rows) / wall)
    # The pure compute reference, measured right after the run: on a shared machine the load changes by the minute.
    amp, channels_last = ("off", False) if step.number == 1 else (amp, channels_last)
    device = torch.device(row["device"])
    row["compute_images_per_sec"] = nproc * ctx["compute"](per_process, threads, device, amp, channels_last)
    row["loop_vs_compute"] = ratio(row["images_per_sec"], row["compute_images_per_sec"])
    print(f"   {row['images_per_sec']:.0f} img/s, {row['epoch_seconds']:.2f} s/epoch, {row['loop_vs_compute']:.0%} of "
          f"pure compute, test_acc {row['test_acc']:.3f}, {wall:.0f} s wall, other work on "
          f"{fmt(row['other_work_cores'], 2)} cores", flush=True)
    return row


def ratio(a, b):
    return a / b if a is not None and b else None


def add_comparisons(runs, args):
    """Per run: scaling efficiency vs 02 and speed vs 01."""
    by_name = {r["name"]: r for r in runs}
    base02 = by_name.get("02") if by_name.get("02", {}).get("status") == "ran" else None
    base01 = by_name.get("01") if by_name.get("01", {}).get("status") == "ran" else None
    for row in runs:
        if row["status"] != "ran":
            continue
        same_device = base02 is not None and row["device"] == base02["device"]
        row["scaling_efficiency_vs_02"] = (ratio(row["images_per_sec"], row["devices"] * base02["images_per_sec"])
                                           if same_device else None)
        # Data-parallel overhead on the CPU: the same total threads and global batch as 01.
        row["speed_vs_01"] = ratio(row["images_per_sec"], base01["images_per_sec"]) if (
            base01 is not None and not args.gpu) else None


# ----------------------------------------------------------------------------- the knobs of step 02
def measure_knobs(args, ctx, runs):
    """Each speed knob on vs off; in-process where that measures it, plus full 02 runs with --knob-runs."""
    device, cores, batch = ctx["device"], ctx["cores"], args.batch_size
    compute = ctx["compute"]
    knobs = []

    def add(knob, measured, off, on, off_value, on_value, unit="img/s", note=None):
        knobs.append({"knob": knob, "measured": measured, "off": off, "on": on, "off_value": off_value,
                      "on_value": on_value, "unit": unit, "ratio": ratio(on_value, off_value), "note": note})

    def skipped(knob, measured, off, on, note):
        knobs.append({"knob": knob, "measured": measured, "off": off, "on": on, "off_value": None,
                      "on_value": None, "unit": "img/s", "ratio": None, "note": note})

    fast_amp = "fp16" if device.type == "cuda" else "bf16"
    print("== knobs: pure compute on vs off", flush=True)
    # (amp, channels_last, .item() every step) of each setting, measured in turns so that a busy moment of
    # the machine slows all of them alike; each keeps its best turn.
    settings = {"base": ("off", False, False), "channels_last": ("off", True, False),
                fast_amp: (fast_amp, False, False), "sync": ("off", False, True)}
    if device.type == "cuda":
        settings["bf16"] = ("bf16", False, False)
    best = dict.fromkeys(settings, 0.0)
    for _ in range(args.repeats):
        for name, (amp, channels_last, sync) in settings.items():
            best[name] = max(best[name], compute(batch, cores, device, amp, channels_last, sync, repeats=1))
    add("channels_last", "pure compute", "NCHW", "channels_last", best["base"], best["channels_last"])
    add("autocast", "pure compute", "fp32", fast_amp, best["base"], best[fast_amp])
    if device.type == "cuda":
        add("autocast", "pure compute", "fp32", "bf16", best["base"], best["bf16"])
    else:
        skipped("autocast", "pure compute", "fp32", "fp16", "n/a (CPU): the scripts refuse fp16 without a GPU")
    add("no .item() per step", "pure compute", ".item() every step", "no per-step sync", best["sync"], best["base"],
        note="on the CPU every op already runs synchronously, so the difference is noise" if device.type == "cpu"
        else "the host waits for the GPU every step, so the next step cannot be queued")

    print("== knobs: data loader alone", flush=True)
    loader_args = dict(batch=batch, threads=cores, device=device)
    rate0, _ = loader_rate(ctx["data_dir"], workers=0, **loader_args)
    rate2, _ = loader_rate(ctx["data_dir"], workers=2, **loader_args)
    add("loader workers", "loader alone", "0 workers", "2 workers", rate0, rate2)
    _, start_off = loader_rate(ctx["data_dir"], workers=2, persistent=False, epochs=3, **loader_args)
    _, start_on = loader_rate(ctx["data_dir"], workers=2, persistent=True, epochs=3, **loader_args)
    add("persistent workers", "loader alone, s/epoch incl. worker start", "re-started per epoch", "persistent",
        start_off, start_on, unit="s/epoch", note="lower is better; ratio < 1 = time saved")
    if device.type == "cuda":
        pageable, _ = loader_rate(ctx["data_dir"], workers=args.workers, pin_memory=False, **loader_args)
        pinned, _ = loader_rate(ctx["data_dir"], workers=args.workers, pin_memory=True, **loader_args)
        add("pinned memory + non_blocking", "loader + copy to GPU", "pageable, blocking", "pinned, non_blocking",
            pageable, pinned)
    else:
        skipped("pinned memory + non_blocking", "loader + copy to device", "pageable", "pinned",
                "n/a (CPU): there is no host-to-device copy")

    base_run = next((r for r in runs if r["name"] == "02"), None)
    if not args.knob_runs:
        note = "not measured: full 02 runs are off (--quick or --no-knob-runs)"
        skipped("torch.compile", "02 full loop", "eager", "--compile", note + "; the cold compile alone takes 30-60 s")
        return knobs
    if base_run is None or base_run["status"] != "ran":
        skipped("torch.compile", "02 full loop", "eager", "--compile", "not measured: step 02 did not run")
        return knobs
    step02 = STEPS[2]
    print("== knobs: full 02 runs, one knob flipped at a time", flush=True)
    base_value = base_run["images_per_sec"]
    on_amp = resolve_amp(args.amp, device) if args.amp != "off" else fast_amp
    # (knob, off, on, whether the base 02 run has it on, the flip that the extra run makes)
    flips = [("channels_last", "NCHW", "channels_last", args.channels_last, dict(channels_last=not args.channels_last)),
             ("autocast", "fp32", on_amp, args.amp != "off", dict(amp="off" if args.amp != "off" else fast_amp)),
             ("loader workers", "0 workers", f"{args.workers or 2} workers", args.workers > 0,
              dict(workers=0 if args.workers else 2)),
             ("torch.compile", "eager", "--compile", False, dict(compile_model=True))]
    for knob, off, on, base_on, change in flips:
        run = run_step(step02, 1, args, ctx, name="02-knob-" + knob.replace(" ", "-").replace(".", ""), **change)
        runs.append(run)
        if run["status"] != "ran":
            skipped(knob, "02 full loop", off, on, f"{run['status']}: {run['reason']}")
            continue
        note = None
        if knob == "torch.compile":
            cold = run["cold_start_seconds"] = run["first_epoch_seconds"] - run["epoch_seconds"]
            note = (f"cold start (epoch 1 minus a steady epoch, fresh inductor cache): {cold:.1f} s"
                    if run["timed_epochs"][0] > 1 else "cold start not separable with 1 epoch (use --epochs 2 or more)")
        values = (run["images_per_sec"], base_value) if base_on else (base_value, run["images_per_sec"])
        add(knob, "02 full loop", off, on, *values, note=note)
    return knobs


# ----------------------------------------------------------------------------- reporting
def fmt(value, digits=0, suffix=""):
    if value is None:
        return "—"
    return f"{value:,.{digits}f}{suffix}"


def pct(value):
    return "—" if value is None else f"{100 * value:.0f}%"


STEP_COLUMNS = ["step", "launcher", "processes x threads", "status", "img/s", "s/epoch", "loop/compute",
                "train/wall", "scaling eff. vs 02", "speed vs 01", "peak MB", "test acc", "test loss", "others"]


def step_table(runs):
    lines = ["| " + " | ".join(STEP_COLUMNS) + " |", "|" + "---|" * len(STEP_COLUMNS)]
    for r in runs:
        if r["name"].startswith("02-knob"):
            continue
        procs = f"{r['processes']} x {r['threads_per_process']}" + (" (GPU)" if r["device"] == "cuda" else "")
        status = "ran" if r["status"] == "ran" else f"{r['status']}: {r['reason']}"
        if r["notes"]:
            status += " (" + "; ".join(r["notes"]) + ")"
        status = status.replace("|", "/")
        if r["status"] != "ran":
            cells = [r["step"], r["launcher"], procs, status] + ["—"] * (len(STEP_COLUMNS) - 4)
        else:
            cells = [r["step"], r["launcher"], procs, status, fmt(r["images_per_sec"]), fmt(r["epoch_seconds"], 2),
                     pct(r.get("loop_vs_compute")), pct(r.get("train_share_of_wall")),
                     pct(r.get("scaling_efficiency_vs_02")), fmt(r.get("speed_vs_01"), 2, "x"),
                     fmt(r["peak_memory_mb"]), fmt(r["test_acc"], 3), fmt(r["test_loss"], 3),
                     fmt(r.get("other_work_cores"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def knob_table(knobs):
    lines = ["| knob | measured in | off | on | off value | on value | on/off | note |", "|" + "---|" * 8]
    for k in knobs:
        unit = f" {k['unit']}"
        lines.append(f"| {k['knob']} | {k['measured']} | {k['off']} | {k['on']} | {fmt(k['off_value'], 1, unit)} | "
                     f"{fmt(k['on_value'], 1, unit)} | {fmt(k['ratio'], 2, 'x')} | {k['note'] or ''} |")
    return lines


def targets(results):
    """The issue's targets, checked on this run's figures."""
    runs = {r["name"]: r for r in results["runs"] if r["status"] == "ran"}
    lines = []
    for name in ("01", "02"):
        r = runs.get(name)
        if r:
            ok = r["loop_vs_compute"] >= 0.9
            lines.append(f"- full training loop of {name}: {pct(r['loop_vs_compute'])} of the pure compute rate "
                         f"({fmt(r['images_per_sec'])} vs {fmt(r['compute_images_per_sec'])} img/s); "
                         f"target >= 90%: {'met' if ok else 'NOT met'}")
    loader = results["pipeline"]
    # The model's training rate: the faster of its pure compute rate and the loops of 01/02, so the check is strict.
    model_rate = max([loader["compute_images_per_sec"] or 0] + [runs[n]["images_per_sec"] for n in ("01", "02")
                                                                if n in runs])
    if loader["loader_images_per_sec"] and model_rate:
        x = loader["loader_images_per_sec"] / model_rate
        lines.append(f"- data loader alone ({results['settings']['workers']} workers, batch "
                     f"{results['settings']['global_batch']}): {fmt(loader['loader_images_per_sec'])} img/s = "
                     f"{x:.1f}x the model's training rate ({fmt(model_rate)} img/s, the faster of pure compute and "
                     f"the 01/02 loops); target >= 5x: {'met' if x >= 5 else 'NOT met'}")
    return lines


def write_markdown(results, path):
    s, hw, v = results["settings"], results["hardware"], results["versions"]
    gpus = ", ".join(hw["gpus"]) if hw["gpus"] else "none used (CPU benchmark)"
    load = results["load_average"]
    lines = [
        "# Benchmark of every step", "",
        f"> {SYNTHETIC_NOTE}." if results["synthetic"] else "> Real CIFAR-10 data.", "",
        f"Command: `{results['command']}`", "",
        f"- Hardware: {hw['cpu']}, {hw['cores']} cores, {fmt(hw['memory_gib'], 1)} GiB memory; GPUs: {gpus}",
        f"- Versions: Python {v['python']}, torch {v['torch']}, torchvision {v['torchvision']}, "
        f"deepspeed {v['deepspeed'] or 'not installed'}, horovod {v['horovod'] or 'not installed'}, "
        f"apex {v['apex'] or 'not installed'}" + (f", CUDA {v['cuda']}" if v["cuda"] else ""),
        f"- Load average (1/5/15 min) at start {load['start']}, at end {load['end']} for {hw['cores']} cores"
        + (f"; other work kept up to {load['max_other_work_cores']:.2f} cores busy during a measurement "
           "**(timings are disturbed where the others column is high)**" if load["busy"] else ""),
        f"- Settings: --arch {s['arch']}, global batch {s['global_batch']}, {s['epochs']} epoch(s) per run "
        f"(timed: {'epochs 2..N' if s['epochs'] > 1 else 'epoch 1, which includes warm-up'}), lr {s['lr']}, "
        f"{s['train_images']} train / {s['test_images']} test images, --workers {s['workers']}, --amp {s['amp']}, "
        f"channels_last {'on' if s['channels_last'] else 'off'}, seed 0",
        f"- Threads: 1 process x {hw['cores']} threads, N processes x {hw['cores']}/N threads (OMP_NUM_THREADS)",
        "", "## Steps", "", *step_table(results["runs"]), "",
        "img/s and s/epoch: training loop of all processes together over the timed epochs (metrics.jsonl). "
        "loop/compute: that rate over processes x the pure compute rate of one process (same model, per-process "
        "batch, threads and precision, batches already in memory; best of a few timings taken right after the run): "
        "the rest is data pipeline, communication and interference. train/wall: "
        "training-loop seconds over the whole command's wall time (the rest is launcher and interpreter start, "
        "data reading, evaluation, checkpoints). scaling eff. vs 02: img/s / (devices x img/s of 02) on the same "
        "device (on the CPU the device is the whole CPU). speed vs 01: img/s / img/s of 01 with the same total "
        "threads and global batch (CPU; < 1 is the data-parallel overhead). peak MB: rank 0, max RSS on the CPU, "
        "CUDA allocator peak on a GPU. others: cores kept busy by OTHER work on the "
        "machine during the run, on average (machine CPU time minus the benchmark's own processes; 0 = it had the "
        "machine to itself). A step that could not run says why; its figures are "
        "absent, not zero.", "",
        "## Pipeline: pure compute, data loader, full loop", "", *targets(results), "",
        "## Speed knobs of step 02, one at a time", "", *knob_table(results["knobs"]), "",
    ]
    Path(path).write_text("\n".join(lines))


def write_chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if not r["name"].startswith("02-knob")]
    knobs = [k for k in results["knobs"] if k["ratio"] is not None]
    fig, (ax, ax_knobs) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    labels = [r["step"] + (f" x{r['processes']}" if r["processes"] > 1 or r["launcher"] != "python" else "")
              for r in runs]
    ran = [r["status"] == "ran" for r in runs]
    values = [r["images_per_sec"] if ok else 0 for r, ok in zip(runs, ran)]
    ax.bar(range(len(runs)), values, color=["tab:blue" if ok else "none" for ok in ran])
    references = [r["compute_images_per_sec"] for r, ok in zip(runs, ran) if ok]
    top = max(values + references + [results["pipeline"]["compute_images_per_sec"] or 0]) or 1
    for i, (r, ok) in enumerate(zip(runs, ran)):
        if ok:
            ax.plot([i - 0.4, i + 0.4], [r["compute_images_per_sec"]] * 2, color="black", lw=1)
            ax.text(i, r["images_per_sec"], f"{r['images_per_sec']:.0f}", ha="center", va="bottom", fontsize=8)
        else:
            ax.text(i, top * 0.02, r["status"], rotation=90, ha="center", va="bottom", fontsize=9, color="tab:red")
    if results["pipeline"]["compute_images_per_sec"]:
        ax.axhline(results["pipeline"]["compute_images_per_sec"], ls="--", color="tab:orange",
                   label="pure compute rate, 1 process")
    ax.plot([], [], color="black", lw=1, label="pure compute x processes (per bar)")
    ax.set_xticks(range(len(runs)), labels)
    ax.set(xlabel="step (x processes)", ylabel="training images/sec", title="training loop throughput")
    ax.set_ylim(0, top * 1.15)
    ax.legend(loc="upper right", fontsize=8)
    if knobs:
        names = [f"{k['knob']}\n({k['measured'].split(',')[0]})" for k in knobs]
        speedups = [1 / k["ratio"] if k["unit"] == "s/epoch" else k["ratio"] for k in knobs]
        ax_knobs.barh(range(len(knobs)), speedups, color=["tab:green" if x >= 1 else "tab:gray" for x in speedups])
        ax_knobs.axvline(1.0, color="black", lw=1)
        ax_knobs.set_yticks(range(len(knobs)), names, fontsize=7)
        ax_knobs.invert_yaxis()
    ax_knobs.set(xlabel="speed-up, on / off", title="knobs of step 02")
    hw = results["hardware"]
    device = ", ".join(hw["gpus"]) if hw["gpus"] else f"{hw['cpu']}, {hw['cores']} cores"
    title = f"{results['settings']['arch']}, global batch {results['settings']['global_batch']}, {device}"
    if results["synthetic"]:
        title += "  (SYNTHETIC DATA, not CIFAR-10)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    command = shlex.join(["python", os.path.relpath(__file__, os.getcwd()), *(sys.argv[1:] if argv is None else argv)])
    if args.gpu and not torch.cuda.is_available():
        raise UserError("--gpu: no CUDA GPU is visible to this torch (CPU build, or no driver); drop --gpu for the CPU")
    device = torch.device("cuda" if args.gpu else "cpu")
    cores = usable_cores()
    gpus = torch.cuda.device_count() if args.gpu else 0
    if args.nproc is None:
        args.nproc = [gpus] if args.gpu else [2]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    start_load = load_average()
    data_dir = prepare_data(args)
    synthetic = data.is_synthetic(str(data_dir))
    train_set, test_set = data.cifar10_datasets(str(data_dir))
    print(f"benchmark: {args.arch}, global batch {args.batch_size}, {args.epochs} epoch(s), steps "
          f"{','.join(f'{n:02d}' for n in args.steps)}, processes {args.nproc}, on {device.type}, {cores} cores"
          + (f"  [{SYNTHETIC_NOTE}]" if synthetic else ""), flush=True)

    measured = []  # every pure compute measurement, in order

    def compute(batch, threads, dev, amp, channels_last, sync_each_step=False, repeats=None):
        """Measure the pure compute rate of one process now (and keep the measurement)."""
        if args.quiet_wait:
            wait_for_quiet(min(args.quiet_wait, 60), cores)
        key = {"batch": batch, "threads": threads, "device": dev.type, "amp": amp, "channels_last": channels_last,
               "sync_each_step": sync_each_step}
        with OtherWork() as other:
            rate = compute_rate(args.arch, batch, threads, dev, amp, channels_last, sync_each_step,
                                warmup=args.warmup, min_steps=args.min_steps, seconds=args.compute_seconds,
                                repeats=repeats or args.repeats)
        measured.append({**key, "images_per_sec": rate, "other_work_cores": other.cores})
        return rate

    def best_compute(batch, threads, dev, amp, channels_last):
        """The best measurement of these settings so far (measured now if there is none)."""
        key = {"batch": batch, "threads": threads, "device": dev.type, "amp": amp, "channels_last": channels_last,
               "sync_each_step": False}
        rates = [m["images_per_sec"] for m in measured if all(m[k] == v for k, v in key.items())]
        return max(rates) if rates else compute(batch, threads, dev, amp, channels_last)

    ctx = {"cores": cores, "gpus": gpus, "device": device, "data_dir": data_dir.resolve(), "compute": compute}
    runs = []
    for number in args.steps:
        step = STEPS[number]
        for nproc in (args.nproc if step.multi_process else [1]):
            runs.append(run_step(step, nproc, args, ctx))

    knobs = measure_knobs(args, ctx, runs)
    print("== data loader", flush=True)
    pipeline = {"compute_images_per_sec": best_compute(args.batch_size, cores, device, args.amp, args.channels_last),
                "loader_images_per_sec": loader_rate(data_dir, args.batch_size, args.workers, cores, device,
                                                     pin_memory=device.type == "cuda")[0],
                "threads": cores, "batch": args.batch_size, "workers": args.workers}
    add_comparisons(runs, args)
    end_load = load_average()
    others = [r["other_work_cores"] for r in runs if r.get("other_work_cores") is not None]
    others += [m["other_work_cores"] for m in measured if m["other_work_cores"] is not None]
    busy = bool(others) and max(others) > 0.1 * cores
    results = {
        "command": command, "synthetic": synthetic, "note": SYNTHETIC_NOTE if synthetic else None,
        "hardware": hardware(args.gpu), "versions": versions(),
        "load_average": {"start": start_load, "end": end_load, "busy": busy,
                         "max_other_work_cores": max(others) if others else None},
        "settings": {"arch": args.arch, "global_batch": args.batch_size, "epochs": args.epochs, "lr": args.lr,
                     "workers": args.workers, "amp": args.amp, "channels_last": args.channels_last,
                     "steps": [f"{n:02d}" for n in args.steps], "nproc": args.nproc, "device": device.type,
                     "train_images": len(train_set), "test_images": len(test_set),
                     "data_dir": str(data_dir), "quick": args.quick},
        "pipeline": pipeline,
        "runs": runs,
        "knobs": knobs,
        "pure_compute": measured,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    write_markdown(results, out_dir / "results.md")
    write_chart(results, out_dir / "results.png")
    print("\n".join(step_table(runs)))
    print("\n".join(targets(results)))
    print(f"wrote {out_dir / 'results.md'}, {out_dir / 'results.json'}, {out_dir / 'results.png'}")


if __name__ == "__main__":
    main()
