"""Benchmark the steps: every real script through its launcher, the same work for each, figures from metrics.jsonl.

    python scripts/benchmark.py --markdown docs/benchmark-cpu.md   # CPU: cnn on every step, resnet18 on 01, 04, 05
    python scripts/benchmark.py --arch cnn:01,04 --arch resnet18:01 --quick --workers 0   # seconds (the tests)
    python scripts/benchmark.py --gpu            # this machine's GPUs (--nproc: their count); 01 stays on the CPU

It writes results.md (table, hardware, versions, command), results.json (null where not measured, never 0), runs/
(each run's out-dir and log) and data/ to --out-dir. Each step starts as the README starts it (common/launchers.py)
and does the same work as the others of its model: data, global batch, lr, epochs, seed, precision, total threads
(1 process: the batch and all cores; N: batch/N and cores/N each). Figures: epochs 2..N of its metrics.jsonl.
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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` lives at the repository root

from common import data, launchers, metrics  # noqa: E402
from common.cli import UserError, exits_cleanly, non_negative_int, positive_float, positive_int  # noqa: E402
from common.launchers import BIN, REPO  # noqa: E402
from common.synthetic import write_synthetic_cifar10  # noqa: E402

NOTE = ("SYNTHETIC DATA (common.synthetic): test accuracy and loss are not CIFAR-10 figures; "
        "throughput does not depend on the pixel values")
Step = collections.namedtuple("Step", "number launcher multi_process library")  # launcher: common.launchers'
MODELS = ["cnn", "resnet18"]  # the --arch choices of the numbered scripts that the benchmark runs
STEPS = {s.number: s for s in [Step(1, "python", False, None), Step(2, "python", False, None),
                               Step(3, "python", False, None), Step(4, "torchrun", True, None),
                               Step(5, "deepspeed", True, "deepspeed"), Step(6, "horovodrun", True, "horovod"),
                               Step(7, "legacy", True, None), Step(8, "torchrun", True, None)]}
# Synthetic images (train, test) per model: a resnet18 image costs ~30x the cnn's on the CPU.
SIZES = {"cnn": (5000, 1000), "resnet18": (768, 256)}
QUICK_SIZE = (128, 32)
TIMEOUT = 1800  # seconds before a run counts as failed
HOROVOD = r"(?:\[\d+\]<std(?:out|err)>:)?"  # horovodrun's prefix of its ranks' lines
COLUMNS = ["model", "step", "launcher", "processes x threads", "status", "img/s", "s/epoch", "vs 01", "train/wall",
           "peak MB", "test acc", "others"]


def why_not_runnable(step):
    """None if the step can be started here, else the reason (one line)."""
    if not list(REPO.glob(f"{step.number:02d}_cifar10_*.py")):
        return f"no {step.number:02d}_cifar10_*.py in {REPO}"
    if step.library and importlib.util.find_spec(step.library) is None:
        return f"{step.library} is not installed for {sys.executable} (see requirements.txt)"
    if (launcher := launchers.LAUNCHERS[step.launcher]) and not (BIN / launcher).exists():
        return f"launcher {launcher} not found in {BIN}"


def step_numbers(text):
    if not re.fullmatch(r"\d+(,\d+)*", text) or not {int(s) for s in text.split(",")} <= set(STEPS):
        raise argparse.ArgumentTypeError(f"expected steps of {sorted(STEPS)} like 01,04,05, got {text!r}")
    return sorted({int(s) for s in text.split(",")})


def model_steps(text):
    """--arch value: MODEL or MODEL:STEPS, e.g. resnet18:01,04,05 (no STEPS: those of --steps)."""
    arch, _, steps = text.partition(":")
    if arch not in MODELS:
        raise argparse.ArgumentTypeError(f"expected MODEL[:STEPS], MODEL in {MODELS}; got {text!r}")
    return arch, step_numbers(steps) if steps else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_SIZE[0]} images, 1 epoch, batch 32 (for tests)")
    p.add_argument("--arch", type=model_steps, action="append", metavar="MODEL[:STEPS]",
                   help="a model and its steps, repeatable (default: cnn on --steps, and resnet18:01,04,05)")
    p.add_argument("--steps", type=step_numbers, default=sorted(STEPS), help="steps of an --arch without :STEPS")
    p.add_argument("--nproc", type=positive_int, help="processes of steps 04 on (default 2; --gpu: the GPUs)")
    p.add_argument("--epochs", type=positive_int, help="epochs per run (default 3, --quick 1); timed: 2..N")
    p.add_argument("--batch-size", type=positive_int, help="GLOBAL batch (default 128, --quick 32)")
    p.add_argument("--lr", type=positive_float, default=0.1, help="peak learning rate (default 0.1)")
    p.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader workers per process (default 2)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16", "auto"], default="off", help="of every step (default off)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False, help="(default off)")
    p.add_argument("--gpu", action="store_true", help="use the CUDA GPUs (default: the CPU only, GPUs hidden)")
    p.add_argument("--train-size", type=positive_int, help=f"synthetic training images (default {SIZES})")
    p.add_argument("--test-size", type=positive_int, help="synthetic test images (default: see --train-size)")
    p.add_argument("--out-dir", default="bench", help="where the results go (default bench)")
    p.add_argument("--quiet-wait", type=non_negative_int, default=0, help="seconds to wait for a quiet machine per run")
    p.add_argument("--markdown", type=Path, help="also write results.md here (as docs/benchmark-cpu.md is written)")
    args = p.parse_args(argv)
    args.arch = [(arch, steps or args.steps) for arch, steps in args.arch or [("cnn", None), ("resnet18", [1, 4, 5])]]
    args.epochs = args.epochs or (1 if args.quick else 3)
    args.batch_size = args.batch_size or (32 if args.quick else 128)
    args.out_dir = Path(args.out_dir).resolve()  # the runs start in the repository root, not here
    return args


def machine(gpu):
    """(hardware, versions) of this machine, for the report."""
    import torch

    if gpu and not torch.cuda.is_available():
        raise UserError("--gpu: no CUDA GPU is visible to this torch (CPU build, or no driver); drop --gpu for the CPU")
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    return ({"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
             "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
             "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if gpu else []},
            {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             **{name: importlib.util.find_spec(name) and importlib.metadata.version(name)
                for name in ("torchvision", "deepspeed", "horovod", "apex")}})


def busy_seconds():
    """(CPU seconds the whole machine has been busy, CPU seconds of this process's finished descendants)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def wait_for_quiet(seconds, cores):
    """Wait (at most `seconds`) until other work keeps under a tenth of the cores busy; returns seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        busy = busy_seconds()[0]
        time.sleep(2)
        if (busy_seconds()[0] - busy) / 2 < 0.1 * cores:
            break
    return time.monotonic() - start


def prepare_data(args, arch):
    """Synthetic data of the model's size for `arch`'s runs (written once): (root, (train, test))."""
    sizes = QUICK_SIZE if args.quick else SIZES.get(arch, SIZES["cnn"])
    sizes = (args.train_size or sizes[0], args.test_size or sizes[1])
    root = args.out_dir / "data" / "{}-{}".format(*sizes)
    if not (root / data.FOLDER / "batches.meta").is_file():
        write_synthetic_cifar10(str(root), *sizes)
    return root, sizes


def command_of(step, arch, nproc, args, ctx, out_dir, notes):
    """The README's command of the step with this benchmark's settings; adds to `notes` what differs."""
    (script,) = REPO.glob(f"{step.number:02d}_cifar10_*.py")
    source = script.read_text()  # its optional flags, with common/cli.py's if it uses that shared parser:
    source += (REPO / "common" / "cli.py").read_text() if "shared_parser(" in source else ""
    flags = {flag for flag in ("--amp", "--channels-last", "--deepspeed_config") if f'"{flag}"' in source}
    command = launchers.launch_command(step.launcher, nproc, script) + [
        "--data-dir", str(ctx["data"][arch]), "--out-dir", str(out_dir), "--arch", arch, "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size // nproc), "--lr", str(args.lr), "--workers", str(args.workers),
        "--seed", "0"]
    command += ["--amp", args.amp] if "--amp" in flags else []
    command += [("--" if args.channels_last else "--no-") + "channels-last"] if "--channels-last" in flags else []
    command += ["--deepspeed_config", "ds_config.json"] if "--deepspeed_config" in flags else []  # as the README
    notes += [f"no {flag} in this step: left at its default" for flag, wanted in
              [("--amp", args.amp != "off"), ("--channels-last", args.channels_last)] if wanted and flag not in flags]
    notes += ["DataParallel without a GPU runs the model as it is"] if step.number == 3 and not args.gpu else []
    return command, script.stem


def run_step(step, arch, nproc, args, ctx):
    """Start one step through its launcher; returns its row (status ran / not run / failed)."""
    nproc = nproc if step.multi_process else 1
    row = {"model": arch, "step": f"{step.number:02d}", "launcher": step.launcher, "processes": nproc,
           "threads_per_process": max(1, ctx["cores"] // nproc), "status": "not run", "reason": None, "notes": [],
           "device": "cuda" if args.gpu and step.number > 1 else "cpu"}
    reason = why_not_runnable(step)
    if reason is None and row["device"] == "cuda" and step.multi_process and nproc > ctx["gpus"]:
        reason = f"{nproc} processes need {nproc} GPUs; this machine has {ctx['gpus']}"
    if reason is None and args.batch_size % nproc:
        reason = f"global batch {args.batch_size} does not split into {nproc} processes"
    if reason:
        return {**row, "reason": reason}
    out_dir = args.out_dir / "runs" / f"{arch}-{row['step']}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    command, stem = command_of(step, arch, nproc, args, ctx, out_dir, row["notes"])
    row["command"] = shlex.join(command)
    print(f"== {arch} {row['step']}: {row['command']}", flush=True)
    cpu_only = {} if args.gpu else {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    row["waited_for_quiet_seconds"] = wait_for_quiet(args.quiet_wait, ctx["cores"])
    busy, start = busy_seconds(), time.perf_counter()
    try:
        proc = launchers.run(command, TIMEOUT, OMP_NUM_THREADS=row["threads_per_process"], **cpu_only)
        output, returncode = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as error:
        output, returncode = (error.stdout or b"").decode(errors="replace"), None
    wall = time.perf_counter() - start
    deadline = time.monotonic() + 10  # reap the run's orphans (a DataLoader forkserver): their CPU time is its own
    with contextlib.suppress(ChildProcessError):  # raised once none is left
        while time.monotonic() < deadline:
            time.sleep(0 if os.waitpid(-1, os.WNOHANG)[0] else 0.05)
    machine_busy, own = (b - a for a, b in zip(busy, busy_seconds()))
    (out_dir / "log.txt").write_text(output)
    row.update(out_dir=str(out_dir), wall_seconds=wall, other_work_cores=max(0.0, (machine_busy - own) / wall),
               start_line=(re.findall(rf"^{HOROVOD}({re.escape(stem)}: .*)$", output, re.M) or [None])[0])
    rows = metrics.read(str(out_dir / metrics.FILE))
    errors = re.findall(rf"^{HOROVOD}(?:\[rank \d+\] )?error: (.*)$", output, re.M)
    if returncode is None:
        row.update(status="failed", reason=f"timed out after {TIMEOUT} s (log: {out_dir / 'log.txt'})")
    elif returncode == 2 and errors:
        row.update(reason=errors[0])  # the script's own one-line reason (no GPU, a missing library...)
    elif returncode != 0:
        row.update(status="failed", reason=f"exit {returncode}: " + (errors or output.splitlines() or ["-"])[-1][:300])
    elif [r["epoch"] for r in rows] != list(range(1, args.epochs + 1)):
        row.update(status="failed", reason=f"exit 0, but metrics.jsonl has epochs {[r['epoch'] for r in rows]}")
    else:
        row["status"] = "ran"
    if row["status"] != "ran":
        print(f"   {row['status']}: {row['reason']}", flush=True)
        return row
    timed = rows[1:] or rows  # the steady state: epochs 2..N (epoch 1 pays warm-up), or epoch 1 alone
    seconds = sum(r["epoch_seconds"] for r in timed)
    row.update(images_per_sec=sum(r["images_per_sec"] * r["epoch_seconds"] for r in timed) / seconds,
               epoch_seconds=seconds / len(timed), timed_epochs=[r["epoch"] for r in timed],
               first_epoch_seconds=rows[0]["epoch_seconds"], peak_memory_mb=rows[-1].get("peak_memory_mb"),
               test_acc=rows[-1]["test_acc"], test_loss=rows[-1]["test_loss"], train_loss=rows[-1]["train_loss"],
               train_share_of_wall=sum(r["epoch_seconds"] for r in rows) / wall)
    print(f"   {row['images_per_sec']:.1f} img/s, {wall:.0f} s wall, others {row['other_work_cores']:.2f}", flush=True)
    return row


def fmt(value, digits=0, suffix=""):
    return "—" if value is None else f"{value:,.{digits}f}{suffix}"


def step_table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        status = ("ran" if r["status"] == "ran" else f"{r['status']}: {r['reason']}").replace("|", "/")
        status += f" ({'; '.join(r['notes'])})" if r["notes"] else ""
        cells = [r["model"], r["step"], r["launcher"].replace("legacy", "torch.distributed.launch"),
                 f"{r['processes']} x {r['threads_per_process']}" + (" (GPU)" if r["device"] == "cuda" else ""), status]
        if r["status"] == "ran":
            cells += [fmt(r["images_per_sec"], 1), fmt(r["epoch_seconds"], 2), fmt(r.get("speed_vs_01"), 2, "x"),
                      fmt(100 * r["train_share_of_wall"], 0, "%"), fmt(r["peak_memory_mb"]), fmt(r["test_acc"], 3),
                      fmt(r["other_work_cores"], 2)]
        lines.append("| " + " | ".join(cells + ["—"] * (len(COLUMNS) - len(cells))) + " |")
    return lines


def write_markdown(results, path):
    s, hw, v = results["settings"], results["hardware"], results["versions"]
    lines = [
        "# Benchmark of the steps", "", f"> {NOTE}.", "", f"Command: `{results['command']}`", "",
        f"- Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB memory; GPUs: "
        f"{', '.join(hw['gpus']) or 'none used (CPU benchmark)'}",
        "- Versions: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in v if k != "cuda" or v[k]),
        f"- Load average (1/5/15 min) at start {results['load_average'][0]}, at end {results['load_average'][1]}; "
        f"other work kept up to {results['max_other_work_cores']:.2f} cores busy during a run (column others)",
        f"- Settings: global batch {s['batch_size']}, {s['epochs']} epoch(s) per run (timed: "
        f"{'epochs 2..N' if s['epochs'] > 1 else 'epoch 1, warm-up included'}), lr {s['lr']}, --workers "
        f"{s['workers']}, --amp {s['amp']}, channels_last {'on' if s['channels_last'] else 'off'}, seed 0; "
        + "; ".join(f"{arch}: {n[0]} train / {n[1]} test images" for arch, n in s["images"].items()),
        f"- Threads: 1 process x {hw['cores']} threads, N processes x {hw['cores']}/N threads (OMP_NUM_THREADS)",
        "", "## Steps", "", *step_table(results["runs"]), "",
        "img/s, s/epoch: the training loop of all processes together, timed epochs (metrics.jsonl). vs 01: img/s over "
        "step 01's (same model, global batch, total threads). train/wall: training-loop seconds over the command's "
        "wall time (the rest: start-up, data reading, evaluation, checkpoints). peak MB: rank 0, max RSS on the CPU, "
        "CUDA allocator peak on a GPU. others: cores kept busy by OTHER work on the machine during the run, on average "
        "(0 = it had the machine to itself). A step that could not run says why; its figures are absent, not zero.", ""]
    Path(path).write_text("\n".join(lines))


@exits_cleanly
def main(argv=None):
    args = parse_args(argv)
    command = shlex.join(["python", "scripts/benchmark.py", *(sys.argv[1:] if argv is None else argv)])
    hardware, versions = machine(args.gpu)
    ctx = {"cores": hardware["cores"], "gpus": len(hardware["gpus"]), "data": {}, "images": {}}
    args.nproc = args.nproc or ctx["gpus"] or 2
    with contextlib.suppress(OSError, AttributeError):  # Linux: a run's orphaned descendants come to this process
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    load_start, runs = [round(x, 2) for x in os.getloadavg()], []
    for arch, numbers in args.arch:
        ctx["data"][arch], ctx["images"][arch] = prepare_data(args, arch)
        runs += [run_step(STEPS[n], arch, args.nproc, args, ctx) for n in numbers]
        ran = [r for r in runs if r["model"] == arch and r["status"] == "ran"]
        for r in ran:  # same model, global batch and total threads as step 01
            r["speed_vs_01"] = next((r["images_per_sec"] / b["images_per_sec"] for b in ran if b["step"] == "01"), None)
    results = {"command": command, "synthetic": True, "note": NOTE, "hardware": hardware, "versions": versions,
               "load_average": [load_start, [round(x, 2) for x in os.getloadavg()]],
               "max_other_work_cores": max([r.get("other_work_cores", 0) for r in runs] + [0]),
               "settings": {**{k: getattr(args, k) for k in ("batch_size", "epochs", "lr", "amp", "workers", "nproc")},
                            "channels_last": args.channels_last, "images": ctx["images"]}, "runs": runs}
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=2))
    for path in filter(None, [args.out_dir / "results.md", args.markdown]):
        write_markdown(results, path)
    print("\n".join(step_table(runs)) + f"\nwrote {args.out_dir}/results.md and results.json")


if __name__ == "__main__":
    main()
