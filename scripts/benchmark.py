"""Benchmark the steps: every real script via its launcher, equal work, figures from metrics.jsonl.

    # the CPU table
    python scripts/benchmark.py --quiet-wait 60 --markdown docs/benchmark-cpu.md --readme README.md
    # seconds (the tests)
    python scripts/benchmark.py --arch cnn:01,04 --arch resnet18:01 --quick --workers 0
    # this machine's GPUs (--nproc: their count); 01 stays on the CPU
    python scripts/benchmark.py --gpu

It writes results.md (table, hardware, versions, command), results.json (null where not measured,
never 0), runs/ (each run's out-dir and log) and data/ to --out-dir. Each step starts as the README
starts it (scripts/launchers.py) and does the same work as the others of its model: data, global
batch, lr, epochs, seed, precision, total threads (1 process: the batch and all cores; N: batch/N
and cores/N each). Every configuration runs --repeats times, the repeats interleaved (all
configurations once, then again) so that a drift of the machine hits every step alike; the table
gives the median and the range. Figures: epochs 2..N of each run's metrics.jsonl.
"""
import argparse
import collections
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# `common` lives at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import launchers  # noqa: E402
from common import data, metrics  # noqa: E402
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int  # noqa: E402
from launchers import BIN, REPO  # noqa: E402
from synthetic import write_synthetic_cifar10  # noqa: E402

NOTE = ("SYNTHETIC DATA (scripts/synthetic.py, textures): test accuracy and loss are not CIFAR-10 "
        "figures; throughput does not depend on the pixel values")
# launcher: launchers.py'
Step = collections.namedtuple("Step", "number launcher multi_process library")
# One row of the table: a step with its processes (None: --nproc) and its ZeRO stage (05; None:
# ds_config.json's).
Config = collections.namedtuple("Config", "arch step nproc zero units", defaults=[None])
MODELS = ["cnn", "resnet18"]  # the --arch choices of the numbered scripts that the benchmark runs
STEPS = {s.number: s for s in [Step(1, "python", False, None), Step(2, "python", False, None),
                               Step(3, "python", False, None), Step(4, "torchrun", True, None),
                               Step(5, "deepspeed", True, "deepspeed"),
                               Step(6, "horovodrun", True, "horovod"),
                               Step(7, "legacy", True, None), Step(8, "torchrun", True, None)]}
# Per model: synthetic images (train, test) and epochs. A resnet18 image costs ~40x the cnn's on the
# CPU.
SIZES = {"cnn": (5000, 1000, 3), "resnet18": (256, 128, 2)}
QUICK_SIZE = (64, 32, 1)
# on a CPU 02 and 03 run 01's code
DEFAULT_ARCH = "cnn:01,04,05,06,07,08 resnet18:01,04,05,05z1,05z3,08,08x4"
TARGET_ACC = 0.80  # time to this test accuracy
BUSY = 0.2  # cores of other work above which a run's figures do not count for the docs
TIMEOUT = 1800  # seconds before a run counts as failed
HOROVOD = r"(?:\[\d+\]<std(?:out|err)>:)?"  # horovodrun's prefix of its ranks' lines
COLUMNS = ["model", "step", "launcher", "processes x threads", "status", "runs", "img/s (median)",
           "img/s (range)", "vs 01", "loop / compute", "train/wall", f"s to {TARGET_ACC:.0%}",
           "peak MB per process", "test acc", "others (max)"]
README_COLUMNS = ["model", "step", "processes x threads", "img/s (median)", "img/s (range)",
                  "vs 01", "loop / compute", f"s to {TARGET_ACC:.0%}", "peak MB per process",
                  "others (max)"]


def why_not_runnable(step):
    """None if the step can be started here, else the reason (one line)."""
    if not list(REPO.glob(f"{step.number:02d}_cifar10_*.py")):
        return f"no {step.number:02d}_cifar10_*.py in {REPO}"
    if step.library and importlib.util.find_spec(step.library) is None:
        return f"{step.library} is not installed for {sys.executable} (see requirements.txt)"
    if (launcher := launchers.LAUNCHERS[step.launcher]) and not (BIN / launcher).exists():
        return f"launcher {launcher} not found in {BIN}"


# 05z3: step 05 with --zero-stage 3; 08x4: 4 processes; 08ublocks: 08 with other FSDP units
# (scripts/fsdp_units.py)
STEP_TOKEN = r"(\d+)(?:z([0-3]))?(?:x(\d+))?(?:u(blocks|stages|whole))?"


def step_tokens(text):
    """01,05z3,08x4ublocks -> [(1, None, None, None), (5, None, 3, None), (8, 4, None, "blocks")]
    as (step, nproc, zero, units)."""
    tokens = text.split(",")
    parsed = [re.fullmatch(STEP_TOKEN, token) for token in tokens]
    if not all(parsed) or not {int(m[1]) for m in parsed} <= set(STEPS) or any(
            (m[2] and int(m[1]) != 5) or (m[4] and int(m[1]) != 8)
            or (m[3] and (int(m[3]) < 1 or not STEPS[int(m[1])].multi_process)) for m in parsed):
        raise argparse.ArgumentTypeError(f"expected steps of {sorted(STEPS)} like 01,04,05z3,08x4 "
                                         "(zN: 05's ZeRO stage; xN: processes of a multi-process "
                                         "step; ublocks, ustages or uwhole: 08's units), got "
                                         f"{text!r}")
    return list(dict.fromkeys((int(m[1]), m[3] and int(m[3]), m[2] and int(m[2]), m[4])
                              for m in parsed))


def model_steps(text):
    """--arch value: MODEL or MODEL:STEPS, e.g. resnet18:01,04,05z3 (no STEPS: those of --steps)."""
    arch, _, steps = text.partition(":")
    if arch not in MODELS:
        raise argparse.ArgumentTypeError(f"expected MODEL[:STEPS], MODEL in {MODELS}; got {text!r}")
    return arch, step_tokens(steps) if steps else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_SIZE[0]} images, 1 epoch, batch 32, 1 repeat (tests)")
    p.add_argument("--arch", type=model_steps, action="append", metavar="MODEL[:STEPS]",
                   help=f"a model and its steps, repeatable (default: {DEFAULT_ARCH})")
    p.add_argument("--steps", type=step_tokens, default=step_tokens("01,04,05,06,07,08"),
                   help="steps of an --arch without :STEPS (default 01,04,05,06,07,08)")
    p.add_argument("--nproc", type=positive_int,
                   help="processes of steps 04 on (default 2; --gpu: the GPUs)")
    p.add_argument("--repeats", type=positive_int,
                   help="runs of each configuration, interleaved (default 3; --quick 1)")
    p.add_argument("--epochs", type=positive_int,
                   help="epochs per run (default cnn 3, resnet18 2, --quick 1)")
    p.add_argument("--batch-size", type=positive_int, help="GLOBAL batch (default 128, --quick 32)")
    p.add_argument("--lr", type=positive_float, default=0.1,
                   help="peak learning rate (default 0.1)")
    p.add_argument("--workers", type=non_negative_int, default=2,
                   help="DataLoader workers per process (default 2)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16", "auto"], default="off",
                   help="of every step (default off)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False,
                   help="(default off)")
    p.add_argument("--gpu", action="store_true",
                   help="use the CUDA GPUs (default: the CPU only, GPUs hidden)")
    p.add_argument("--train-size", type=positive_int,
                   help="synthetic training images (default: cnn "
                   f"{SIZES['cnn'][0]}, resnet18 {SIZES['resnet18'][0]})")
    p.add_argument("--test-size", type=positive_int,
                   help="synthetic test images (default: see --train-size)")
    p.add_argument("--out-dir", default="bench", help="where the results go (default bench)")
    p.add_argument("--quiet-wait", type=non_negative_int, default=0,
                   help="seconds to wait for a quiet machine per run")
    p.add_argument("--markdown", type=Path,
                   help="also write results.md here (as docs/benchmark-cpu.md is written); refused "
                   f"unless every run had the machine to itself (others <= {BUSY}) and ran, "
                   "--repeats >= 3")
    p.add_argument("--readme", type=Path,
                   help="also replace the table between <!-- speed-table --> marks in this file")
    args = p.parse_args(argv)
    default = [model_steps(text) for text in DEFAULT_ARCH.split()]
    args.arch = [(arch, steps or args.steps) for arch, steps in args.arch or default]
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.batch_size = args.batch_size or (32 if args.quick else 128)
    args.out_dir = Path(args.out_dir).resolve()  # the runs start in the repository root, not here
    return args


def plan(args):
    """The runs in the order they start: every configuration once, then again (--repeats rounds)."""
    configs = [Config(arch, n, nproc or args.nproc or 2, zero, units)
               for arch, tokens in args.arch for n, nproc, zero, units in tokens]
    configs = [c if STEPS[c.step].multi_process else c._replace(nproc=1) for c in configs]
    # 08,08x2 or 05,05z2 (as shipped): one row each
    configs = list(dict.fromkeys(
        c._replace(zero=None) if c.zero == zero_stage_of_ds_config() and c.zero is not None else c
        for c in configs))
    return [(repeat, config) for repeat in range(args.repeats) for config in configs]


def zero_stage_of_ds_config():
    return json.loads((REPO / "ds_config.json").read_text()).get("zero_optimization", {}).get(
        "stage")


def machine(gpu):
    """(hardware, versions) of this machine, for the report."""
    import torch

    if gpu and not torch.cuda.is_available():
        raise UserError("--gpu: no CUDA GPU is visible to this torch (CPU build, or no driver); "
                        "drop --gpu for the CPU")
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   platform.machine())
    return ({"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
             "memory_gib": round(
                 os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
             "gpus": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                      if gpu else [])},
            {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda,
             **{name: importlib.util.find_spec(name) and importlib.metadata.version(name)
                for name in ("torchvision", "deepspeed", "horovod", "apex")}})


def busy_seconds():
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its finished
    descendants)."""
    with open("/proc/stat") as f:
        # user nice system idle iowait irq softirq steal
        ticks = [int(x) for x in f.readline().split()[1:9]]
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return ((sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"),
            sum(u.ru_utime + u.ru_stime for u in own))


def wait_for_quiet(seconds, cores):
    """Wait (at most `seconds`) until other work keeps under a tenth of the cores busy; returns
    seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        busy = busy_seconds()[0]
        time.sleep(2)
        if (busy_seconds()[0] - busy) / 2 < 0.1 * cores:
            break
    return time.monotonic() - start


def prepare_data(args, arch):
    """Synthetic data of the model's size for `arch`'s runs (written once): (root, (train, test),
    epochs)."""
    sizes = QUICK_SIZE if args.quick else SIZES.get(arch, SIZES["cnn"])
    train, test = args.train_size or sizes[0], args.test_size or sizes[1]
    root = args.out_dir / "data" / f"{train}-{test}"
    if not (root / data.FOLDER / "batches.meta").is_file():
        write_synthetic_cifar10(str(root), train, test)
    return root, (train, test), args.epochs or sizes[2]


def pure_compute(arch, batch, threads, args, seconds=3.0, min_steps=3):
    """Images/s of the model's forward + backward + optimizer step alone (SGD as the steps), on one
    batch already in memory, `threads` threads, the run's precision and layout: what the training
    loop would reach with no data, communication or bookkeeping. On the CPU only (the table's column
    is empty for GPU runs)."""
    import torch
    import torch.nn.functional as F

    from common import cli, models

    torch.manual_seed(0)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    model = getattr(models, arch)(num_classes=10, mean=data.MEAN, std=data.STD).to(
        memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                                nesterov=True)
    images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8).to(memory_format=layout)
    labels = torch.randint(0, 10, (batch,))
    dtype = cli.amp_dtype(args.amp, torch.device("cpu"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps, start = 0, None
        while start is None or time.perf_counter() - start < seconds or steps < min_steps:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            # step 1: warm-up
            steps, start = (0, time.perf_counter()) if start is None else (steps + 1, start)
        return steps * batch / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)


def command_of(step, config, args, ctx, out_dir, notes):
    """The README's command of the step with this benchmark's settings; adds to `notes` what
    differs."""
    (script,) = REPO.glob(f"{step.number:02d}_cifar10_*.py")
    # its optional flags, with common/cli.py's if it uses that shared parser:
    source = script.read_text()
    source += (REPO / "common" / "cli.py").read_text() if "shared_parser(" in source else ""
    flags = {flag for flag in ("--amp", "--channels-last", "--deepspeed_config", "--zero-stage")
             if f'"{flag}"' in source}
    # 08 with other units: scripts/fsdp_units.py CHOICE, then 08's arguments
    wrapper = [config.units] if config.units else []
    command = launchers.launch_command(step.launcher, config.nproc, (
        REPO / "scripts" / "fsdp_units.py" if config.units else script)) + wrapper + [
        "--data-dir", str(ctx["data"][config.arch]), "--out-dir", str(out_dir),
        "--arch", config.arch, "--epochs", str(ctx["epochs"][config.arch]),
        "--batch-size", str(args.batch_size // config.nproc),
        "--lr", str(args.lr), "--workers", str(args.workers), "--seed", "0"]
    command += ["--amp", args.amp] if "--amp" in flags else []
    command += ([("--" if args.channels_last else "--no-") + "channels-last"]
                if "--channels-last" in flags else [])
    # as the README
    command += ["--deepspeed_config", "ds_config.json"] if "--deepspeed_config" in flags else []
    command += (["--zero-stage", str(config.zero)]
                if config.zero is not None and "--zero-stage" in flags else [])
    notes += [f"no {flag} in this step: left at its default" for flag, wanted in
              [("--amp", args.amp != "off"), ("--channels-last", args.channels_last),
               ("--zero-stage", config.zero is not None)] if wanted and flag not in flags]
    notes += (["DataParallel without a GPU runs the model as it is"]
              if step.number == 3 and not args.gpu else [])
    return command, script.stem


def label(config):
    return (f"{config.step:02d}" + (f" ZeRO-{config.zero}" if config.zero is not None else "")
            + (f" units={config.units}" if config.units else ""))


def run_step(step, config, args, ctx, repeat=0):
    """Start one step through its launcher; returns its run (status ran / not run / failed)."""
    row = {"model": config.arch, "step": label(config), "launcher": step.launcher,
           "processes": config.nproc, "threads_per_process": max(1, ctx["cores"] // config.nproc),
           "status": "not run", "reason": None, "notes": [], "repeat": repeat,
           "device": "cuda" if args.gpu and step.number > 1 else "cpu"}
    reason = why_not_runnable(step)
    if (reason is None and row["device"] == "cuda" and step.multi_process
            and config.nproc > ctx["gpus"]):
        reason = (f"{config.nproc} processes need {config.nproc} GPUs; this machine has "
                  f"{ctx['gpus']}")
    if reason is None and args.batch_size % config.nproc:
        reason = f"global batch {args.batch_size} does not split into {config.nproc} processes"
    if reason:
        return {**row, "reason": reason}
    out_dir = args.out_dir / "runs" / (
        f"{config.arch}-{row['step'].replace(' ', '-')}-x{config.nproc}-{repeat + 1}")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    command, stem = command_of(step, config, args, ctx, out_dir, row["notes"])
    row["command"] = shlex.join(command)
    print(f"== {config.arch} {row['step']} x{config.nproc} (run {repeat + 1}/{args.repeats}): "
          f"{row['command']}", flush=True)
    cpu_only = {} if args.gpu else {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    row["waited_for_quiet_seconds"] = wait_for_quiet(args.quiet_wait, ctx["cores"])
    busy, start = busy_seconds(), time.perf_counter()
    try:
        proc = launchers.run(command, TIMEOUT, OMP_NUM_THREADS=row["threads_per_process"],
                             **cpu_only)
        output, returncode = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as error:
        output, returncode = (error.stdout or b"").decode(errors="replace"), None
    wall = time.perf_counter() - start
    # reap the run's orphans (a DataLoader forkserver): their CPU time is its own
    deadline = time.monotonic() + 10
    with contextlib.suppress(ChildProcessError):  # raised once none is left
        while time.monotonic() < deadline:
            time.sleep(0 if os.waitpid(-1, os.WNOHANG)[0] else 0.05)
    machine_busy, own = (b - a for a, b in zip(busy, busy_seconds()))
    (out_dir / "log.txt").write_text(output)
    row.update(out_dir=str(out_dir), wall_seconds=wall,
               other_work_cores=max(0.0, (machine_busy - own) / wall),
               start_line=(re.findall(rf"^{HOROVOD}({re.escape(stem)}: .*)$", output, re.M)
                           or [None])[0])
    rows = metrics.read(str(out_dir / metrics.FILE))
    errors = re.findall(rf"^{HOROVOD}(?:\[rank \d+\] )?error: (.*)$", output, re.M)
    epochs = ctx["epochs"][config.arch]
    if returncode is None:
        row.update(status="failed",
                   reason=f"timed out after {TIMEOUT} s (log: {out_dir / 'log.txt'})")
    elif returncode == 2 and errors:
        # the script's own one-line reason (no GPU, a missing library...)
        row.update(reason=errors[0])
    elif returncode != 0:
        row.update(status="failed", reason=f"exit {returncode}: "
                   + (errors or output.splitlines() or ["-"])[-1][:300])
    elif [r["epoch"] for r in rows] != list(range(1, epochs + 1)):
        row.update(status="failed",
                   reason=f"exit 0, but metrics.jsonl has epochs {[r['epoch'] for r in rows]}")
    else:
        row["status"] = "ran"
    if row["status"] != "ran":
        print(f"   {row['status']}: {row['reason']}", flush=True)
        return row
    # the steady state: epochs 2..N (epoch 1 pays warm-up), or epoch 1 alone
    timed = rows[1:] or rows
    seconds = sum(r["epoch_seconds"] for r in timed)
    reached = next((i for i, r in enumerate(rows) if r["test_acc"] >= TARGET_ACC), None)
    row.update(images_per_sec=sum(r["images_per_sec"] * r["epoch_seconds"]
                                  for r in timed) / seconds,
               epoch_seconds=seconds / len(timed), timed_epochs=[r["epoch"] for r in timed],
               first_epoch_seconds=rows[0]["epoch_seconds"],
               peak_memory_mb=rows[-1].get("peak_memory_mb"),
               test_acc=rows[-1]["test_acc"], test_loss=rows[-1]["test_loss"],
               train_loss=rows[-1]["train_loss"],
               train_share_of_wall=sum(r["epoch_seconds"] for r in rows) / wall,
               seconds_to_target=(None if reached is None
                                  else sum(r["epoch_seconds"] for r in rows[:reached + 1])))
    print(f"   {row['images_per_sec']:.1f} img/s, {wall:.0f} s wall, "
          f"others {row['other_work_cores']:.2f}", flush=True)
    return row


def summarize(runs, compute, cores):
    """One row per configuration (in the order of the first round) from its runs: medians, the img/s
    range, the figures against 01 of the same model and against the model's pure compute rate."""
    groups = {}
    for run in runs:
        groups.setdefault((run["model"], run["step"], run["processes"]), []).append(run)
    summary = []
    for (arch, step, nproc), group in groups.items():
        ran = [r for r in group if r["status"] == "ran"]
        failed = [r for r in group if r["status"] != "ran"]
        row = {key: group[0][key] for key in ("model", "step", "launcher", "processes",
                                              "threads_per_process", "device")}
        row.update(runs=len(ran), notes=group[0]["notes"],
                   status=failed[0]["status"] if failed else "ran",
                   reason=failed[0]["reason"] if failed else None,
                   busy=any(r["other_work_cores"] > BUSY for r in ran),
                   other_work_cores=max((r["other_work_cores"] for r in ran), default=None))
        if not failed:
            def median(key):
                values = [r[key] for r in ran if r.get(key) is not None]
                # all runs, or none
                return statistics.median(values) if len(values) == len(ran) else None

            speeds = [r["images_per_sec"] for r in ran]
            rate = compute.get((arch, row["threads_per_process"], nproc))
            # processes that get cores of their own
            parallel = min(nproc, max(1, cores // row["threads_per_process"]))
            # not reached: inf
            to_target = statistics.median([r["seconds_to_target"] or float("inf") for r in ran])
            row.update({key: median(key) for key in ("images_per_sec", "epoch_seconds",
                                                     "train_share_of_wall", "peak_memory_mb",
                                                     "test_acc")},
                       seconds_to_target=None if to_target == float("inf") else to_target,
                       images_per_sec_range=[min(speeds), max(speeds)],
                       compute_images_per_sec=rate and parallel * statistics.median(rate))
            rate = row["compute_images_per_sec"]
            row["loop_vs_compute"] = rate and row["images_per_sec"] / rate
        summary.append(row)
    for row in summary:  # same model, global batch and total threads as step 01
        base = next((b for b in summary
                     if b["model"] == row["model"] and b["step"] == "01" and b["status"] == "ran"),
                    None)
        row["speed_vs_01"] = (base and row.get("images_per_sec")
                              and row["images_per_sec"] / base["images_per_sec"])
    return summary


def fmt(value, digits=0, suffix=""):
    return "—" if value is None else f"{value:,.{digits}f}{suffix}"


def cells(r):
    """{column: cell} of a summary row."""
    status = ("ran" if r["status"] == "ran" else f"{r['status']}: {r['reason']}").replace("|", "/")
    status += f" ({'; '.join(r['notes'])})" if r["notes"] else ""
    out = {"model": r["model"], "step": r["step"],
           "launcher": r["launcher"].replace("legacy", "torch.distributed.launch"),
           "processes x threads": f"{r['processes']} x {r['threads_per_process']}" + (
               " (GPU)" if r["device"] == "cuda" else ""), "status": status, "runs": str(r["runs"])}
    if r["status"] == "ran":
        low, high = r["images_per_sec_range"]
        reached = r["seconds_to_target"]
        out.update({"img/s (median)": fmt(r["images_per_sec"], 1),
                    "img/s (range)": f"{low:,.1f}–{high:,.1f}",
                    "vs 01": fmt(r["speed_vs_01"], 2, "x"), "loop / compute": fmt(
                        r["loop_vs_compute"] and 100 * r["loop_vs_compute"], 0, "%"),
                    "train/wall": fmt(100 * r["train_share_of_wall"], 0, "%"),
                    f"s to {TARGET_ACC:.0%}": "not reached" if reached is None else fmt(reached, 1),
                    "peak MB per process": fmt(r["peak_memory_mb"]),
                    "test acc": fmt(r["test_acc"], 3),
                    "others (max)": fmt(r["other_work_cores"], 2) + (" BUSY" if r["busy"] else "")})
    return out


def step_table(summary, columns=COLUMNS):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in summary:
        row = cells(r)
        lines.append("| " + " | ".join(row.get(column, "—") for column in columns) + " |")
    return lines


def header_lines(results):
    s, hw = results["settings"], results["hardware"]
    return [
        f"Command: `{results['command']}`", "",
        f"- Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB memory; GPUs: "
        f"{', '.join(hw['gpus']) or 'none used (CPU benchmark)'}",
        f"- Settings: {s['repeats']} runs per row, interleaved; global batch {s['batch_size']}, "
        f"lr {s['lr']}, --workers {s['workers']}, --amp {s['amp']}, channels_last "
        f"{'on' if s['channels_last'] else 'off'}, seed 0; "
        + "; ".join(
            f"{arch}: {n[0]} train / {n[1]} test images, {s['epochs'][arch]} epochs (timed: "
            f"{'epochs 2..N' if s['epochs'][arch] > 1 else 'epoch 1, warm-up included'})"
            for arch, n in s["images"].items())]


def write_markdown(results, path):
    v = results["versions"]
    old = Path(path).read_text() if Path(path).is_file() else ""
    kept = (old[old.index("## What these numbers say"):] if "## What these numbers say" in old
            else "")
    lines = [
        "# Benchmark of the steps", "", f"> {NOTE}.", "", *header_lines(results),
        "- Versions: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in v
                                   if k != "cuda" or v[k]),
        f"- Load average (1/5/15 min) at start {results['load_average'][0]}, at end "
        f"{results['load_average'][1]}; other work kept up to "
        f"{results['max_other_work_cores']:.2f} cores busy during a run (column others)",
        f"- Threads: 1 process x {results['hardware']['cores']} threads, N processes x cores/N "
        "threads (OMP_NUM_THREADS; at least 1)",
        "", "## Steps", "", *step_table(results["summary"]), "",
        "img/s: the training loop of all processes together, timed epochs (metrics.jsonl): the "
        "median of the runs and their range. vs 01: median img/s over step 01's (same model, "
        "global batch, total threads). loop / compute: img/s over the model's pure compute rate "
        "(forward + backward + optimizer step on a batch already in memory, the same per-process "
        "batch, threads and precision, times the processes that have cores of their own; measured "
        "in every round on the CPU, — on a GPU; the rates are in the .json beside this page). "
        "train/wall: training-loop seconds over the command's wall time (the rest: start-up, data "
        f"reading, evaluation, checkpoints). s to {TARGET_ACC:.0%}: training-loop seconds (epoch "
        "1's warm-up included) until the first epoch whose test accuracy reached "
        f"{TARGET_ACC:.0%}. peak MB per process: rank 0, max RSS on the CPU, CUDA allocator peak "
        "on a GPU. others: cores kept busy by OTHER work on the machine during a run, the largest "
        f"of the runs (0 = it had the machine to itself; BUSY: above {BUSY}). A step that could "
        "not run says why; its figures are absent, not zero.", ""]
    Path(path).write_text("\n".join(lines) + ("\n" + kept if kept else ""))


def write_readme_table(results, path, markdown):
    """Replace the block between <!-- speed-table --> marks: the command, hardware and settings, the
    table."""
    text = Path(path).read_text()
    begin, end = "<!-- speed-table -->\n", "<!-- /speed-table -->"
    head, _, rest = text.partition(begin)
    if not rest or end not in rest:
        raise UserError(f"--readme {path}: no {begin.strip()} ... {end} block to replace")
    link = (os.path.relpath(Path(markdown).resolve(), Path(path).resolve().parent) if markdown
            else None)
    block = [*header_lines(results), "", *step_table(results["summary"], README_COLUMNS), "",
             (f"All columns and what each means: [{Path(markdown).name}]({link})." if markdown
              else "")]
    Path(path).write_text(head + begin + "\n".join(block).rstrip() + "\n" + end
                          + rest.split(end, 1)[1])


def refuse_busy_runs(runs, path, repeats=None, compute_others=()):
    """The docs' tables come only from runs that had the machine to themselves, every row from all
    its runs."""
    busy = ([r for r in runs if (r.get("other_work_cores") or 0) > BUSY]
            + [o for o in compute_others if o > BUSY])
    if busy:
        raise UserError(f"{len(busy)} of {len(runs) + len(compute_others)} runs and compute "
                        f"measurements shared the machine with other work (others > {BUSY} cores), "
                        f"so {path} is left as it was: rerun on a quiet machine (--quiet-wait 60 "
                        "waits for one)")
    short = sorted({f"{r['model']} {r['step']} x{r['processes']}" for r in runs
                    if r["status"] != "ran"})
    if repeats and short:
        raise UserError(f"{', '.join(short)}: fewer than {repeats} runs ran, so {path} is left as "
                        "it was (see results.md for why)")


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    command = shlex.join(["python", "scripts/benchmark.py",
                          *(sys.argv[1:] if argv is None else argv)])
    if (args.markdown or args.readme) and args.repeats < 3:
        raise UserError("--markdown/--readme write the docs' tables, which take 3 or more runs "
                        "per row: drop --repeats (default 3) or raise it")
    hardware, versions = machine(args.gpu)
    ctx = {"cores": hardware["cores"], "gpus": len(hardware["gpus"]), "data": {}, "images": {},
           "epochs": {}}
    args.nproc = args.nproc or ctx["gpus"] or 2
    # Linux: a run's orphaned descendants come to this process
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    for arch, _ in args.arch:
        ctx["data"][arch], ctx["images"][arch], ctx["epochs"][arch] = prepare_data(args, arch)
    load_start, runs, compute, compute_others = [round(x, 2) for x in os.getloadavg()], [], {}, []
    for repeat, config in plan(args):
        step = STEPS[config.step]
        runs.append(run_step(step, config, args, ctx, repeat))
        threads = runs[-1]["threads_per_process"]
        # the model's pure compute rate at this batch and threads, once per round
        if (runs[-1]["status"] == "ran" and not args.gpu
                and len(compute.get((config.arch, threads, config.nproc), [])) <= repeat):
            wait_for_quiet(args.quiet_wait, ctx["cores"])
            busy, start = busy_seconds(), time.perf_counter()
            rate = pure_compute(config.arch, args.batch_size // config.nproc, threads, args,
                                **({"seconds": 0.5, "min_steps": 1} if args.quick else {}))
            machine_busy, own = (b - a for a, b in zip(busy, busy_seconds()))
            compute_others.append(max(0.0, (machine_busy - own) / (time.perf_counter() - start)))
            compute.setdefault((config.arch, threads, config.nproc), []).append(rate)
    summary = summarize(runs, compute, ctx["cores"])
    results = {"command": command, "synthetic": True, "note": NOTE, "hardware": hardware,
               "versions": versions,
               "load_average": [load_start, [round(x, 2) for x in os.getloadavg()]],
               "max_other_work_cores": max([r.get("other_work_cores", 0) for r in runs] + [0]),
               "settings": {**{k: getattr(args, k)
                               for k in ("batch_size", "lr", "amp", "workers", "nproc", "repeats")},
                            "channels_last": args.channels_last, "images": ctx["images"],
                            "epochs": ctx["epochs"]},
               "compute_images_per_sec": [{"model": a, "threads": t, "processes": n,
                                           "per_process": rates}
                                          for (a, t, n), rates in compute.items()],
               "compute_other_work_cores": compute_others,
               "summary": summary, "runs": runs}
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=2))
    write_markdown(results, args.out_dir / "results.md")
    print("\n".join(step_table(summary)) + f"\nwrote {args.out_dir}/results.md and results.json")
    if args.markdown or args.readme:
        refuse_busy_runs(runs, args.markdown or args.readme, args.repeats, compute_others)
    if args.markdown:  # and every figure behind it, next to it (docs/benchmark-cpu.json)
        write_markdown(results, args.markdown)
        args.markdown.with_suffix(".json").write_text(json.dumps(results, indent=2))
    if args.readme:
        write_readme_table(results, args.readme, args.markdown)


if __name__ == "__main__":
    main()
