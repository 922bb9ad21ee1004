"""The GPU check: every step's default path and every GPU-only path, on this machine's NVIDIA GPUs.

    # docs/benchmark-gpu.md
    bash scripts/gpu_check.sh [--steps 02,04] [--dry-run --gpus 4] [-- flags for every run]
    # its machinery
    python scripts/gpu_check.py --rehearse-on-cpu --steps 02 -- --arch cnn --amp off --workers 0

On generated data (scripts/synthetic.py --easy), each step as the README starts it (02 also with
--amp fp16, and --amp bf16 where the GPU computes it natively); after each default run (and 02
--amp fp16) a resume check: 2 epochs uninterrupted against --stop-after 1 then --resume auto, with
fixed kernels (cuDNN deterministic, no per-process algorithm search, no Horovod fusion), every
rank's weights-rank*.sha256 equal in both. Measured: img/s of epochs 2..E, peak GPU memory, and for
02 its loop against its own train_one_epoch on batches already on the GPU (pure compute). Then
PATHS, each a 2-epoch run on the small data that must exit 0 with equal weights on every rank (those
whose checkpoints hold a loss scale, fp16 and apex.amp, or O2's master weights: and then resume bit
for bit). Any failure fails the check; only no GPU (a CPU rehearsal), too few GPUs, emulated or
native bf16 where a row needs the other, or a library not installed (DeepSpeed, Horovod, Apex) is a
skip, with why. Results: a table, WORK/results.json, docs/benchmark-gpu.md.
Exit status: 0 every check that ran passed; 1 one failed; 2 it cannot start here (no GPU, no CUDA
torch, a package every step needs is missing).
"""
import argparse
import functools
import itertools
import json
import math
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata, util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `common` lives at the repository root
import launchers  # noqa: E402  (the standard library only: the checks below come before torch and common/)

DOC, RESULTS = REPO / "docs" / "benchmark-gpu.md", "## Results"
LAUNCHER = {2: "python", 3: "python", 4: "torchrun", 5: "deepspeed", 6: "horovodrun", 7: "torchrun",
            8: "torchrun"}
# a launcher that is not next to python, started by its python
MODULE = {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner",
          "horovodrun": "horovod.runner.launch"}
LIBRARY = {5: ("deepspeed", "DeepSpeed"), 6: ("horovod", "Horovod")}
# skips, not failures
NOT_INSTALLED = ("DeepSpeed is not importable", "Horovod is not importable", "needs NVIDIA Apex")
# our scripts' one line, after a launcher's prefix
ERROR = re.compile(r"^(?:.*?[]:>] ?)?error: (.+)$", re.M)
RESUME = [("reference", []), ("resumed", ["--stop-after", "1"]), ("resumed", ["--resume", "auto"])]
# On the PYTHONPATH of the resume runs: cuDNN's fastest kernels may add up in another order on every
# run, and with benchmark=True (every step sets it) each process times and picks its own among the
# deterministic ones.
DETERMINISTIC = (
    "import torch  # scripts/gpu_check.py: resume runs\n"
    "torch.backends.cudnn.deterministic = True\n"
    "type(torch.backends.cudnn).benchmark = property(lambda self: False, lambda self, value: None)"
    "  # the steps' = True\n")
# what every step imports (requirements.txt's pins)
NEEDED = ("torch", "torchvision", "numpy", "matplotlib", "tqdm")
# The paths a default run leaves unproven: (label, step, launcher (None: the step's), flags, GPUs it
# needs at least).
PATHS = [
    # runs, and says it is emulated
    ("02 --amp bf16 where emulated", 2, None, ["--amp", "bf16"], 1),
    ("04 --amp fp16", 4, None, ["--amp", "fp16"], 1),  # GradScaler
    ("04 --sync-bn", 4, None, ["--sync-bn"], 2),
    ("04 --compile", 4, None, ["--compile"], 1),
    ("04 --grad-accum 2", 4, None, ["--grad-accum", "2"], 1),  # no_sync
    ("04 --spawn N", 4, "python", ["--spawn", "N"], 1),
    ("04 legacy launcher", 4, "legacy", [], 1),
    # DeepSpeed's scaler
    ("05 --amp fp16", 5, None, ["--deepspeed_config", "ds_config.json", "--amp", "fp16"], 1),
    # uneven test
    ("05 --zero-stage 3", 5, None,
     ["--deepspeed_config", "ds_config.json", "--zero-stage", "3"], 2),
    ("06 --amp fp16", 6, None, ["--amp", "fp16"], 1),
    ("06 --sync-bn", 6, None, ["--sync-bn"], 2),
    ("06 --fp16-allreduce", 6, None, ["--fp16-allreduce"], 2),
    ("07 --amp fp16", 7, None, ["--amp-backend", "torch", "--amp", "fp16"], 1),
    ("07 --amp-backend apex", 7, None, ["--amp-backend", "apex"], 1),
    ("07 --amp-backend apex --opt-level O2", 7, None,
     ["--amp-backend", "apex", "--opt-level", "O2"], 1),
    ("07 --amp-backend apex --sync-bn", 7, None, ["--amp-backend", "apex", "--sync-bn"], 2),
    ("08 --amp fp16", 8, None, ["--amp", "fp16"], 1),  # ShardedGradScaler
    ("08 --sync-bn", 8, None, ["--sync-bn"], 2),
    # HSDP: a 2-D mesh, 2 replicas of N/2 shards
    ("08 --replicate 2", 8, None, ["--replicate", "2"], 4),
]
# Paths whose checkpoints hold what a default run's do not (a loss scale: fp16 and apex.amp; O2's
# fp32 master weights): the resume check after their run too.
RESUMED_PATHS = {"04 --amp fp16", "05 --amp fp16", "06 --amp fp16", "07 --amp fp16",
                 "08 --amp fp16", "07 --amp-backend apex", "07 --amp-backend apex --opt-level O2",
                 "07 --amp-backend apex --sync-bn"}
say = functools.partial(print, flush=True)


def plan(steps, gpus):
    """The timed runs: each step through its launcher as the README starts it, 02 also with
    --amp fp16 and bf16; then the PATHS of those steps (path=True), each with every GPU (--spawn N:
    N = the GPUs). resume: a resume check too."""
    timed = [types.SimpleNamespace(
        step=step, amp=amp, launcher=LAUNCHER[step],
        nproc=1 if LAUNCHER[step] == "python" else gpus,
        # the default runs and 02's fp16 run (its GradScaler's state) are resume-checked
        resume=amp != "bf16",
        script=next(REPO.glob(f"{step:02d}_cifar10_*.py")), slug=f"{step:02d}-{amp or 'auto'}",
        label=f"{step:02d}" + (f" --amp {amp}" if amp else ""), path=False, needs=1,
        args=(["--deepspeed_config", "ds_config.json"] if step == 5 else []) + (
            ["--amp", amp] if amp else []))
        for step in steps for amp in ([None, "fp16", "bf16"] if step == 2 else [None])]
    return timed + [types.SimpleNamespace(
        step=step, amp=None, launcher=launcher or LAUNCHER[step],
        script=next(REPO.glob(f"{step:02d}_cifar10_*.py")),
        nproc=1 if (launcher or LAUNCHER[step]) == "python" and "--spawn" not in flags else gpus,
        needs=needs, slug=re.sub(r"\W+", "-", label).strip("-"), label=label, path=True,
        resume=label in RESUMED_PATHS, args=[str(gpus) if flag == "N" else flag for flag in flags])
        for label, step, launcher, flags, needs in PATHS if step in steps]


def command(run, data, out, epochs, flags, *more):
    """`run` on `data` into `out`; `flags`: those after the check's --; `more`: the resume
    check's."""
    cmd = launchers.launch_command(run.launcher, run.nproc, run.script)
    # e.g. /usr/bin/python3 with /usr/local/bin/torchrun
    if run.launcher in MODULE and not os.path.exists(cmd[0]):
        cmd[:1] = [sys.executable, "-m", MODULE[run.launcher]]
    return [*cmd, "--data-dir", data, "--out-dir", out, "--epochs", str(epochs), *flags, *run.args,
            *more]


def shown(cmd):
    """A command as a reader types it: python, launchers by name, paths relative to the
    repository."""
    return shlex.join("python" if w == sys.executable
                      else Path(w).name if Path(w).parent == launchers.BIN
                      else os.path.relpath(w, REPO) if w.startswith(str(REPO) + os.sep) else w
                      for w in map(str, cmd))


def launch(cmd, log, timeout, env):
    """(exit status, output) of a command run from the repository root; the output is added to
    `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=launchers.env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        output = proc.communicate()[0] + f"\nerror: timed out after {timeout} s\n"
    with open(log, "a") as f:
        f.write(f"$ {shown(cmd)}\n{output}\n")
    return proc.returncode, output


def verdict(status, output):
    """None if the run exited 0, else (outcome, why): "skipped" if a library it needs is not
    installed, else "failed": a step that stops with its one-line `error: ...` on a GPU fails the
    check as a traceback does."""
    if status == 0:
        return None
    why = (ERROR.findall(output) or [ln for ln in output.splitlines() if "Error" in ln][-1:]
           or [output[-300:]])[0]
    return ("skipped" if any(text in why for text in NOT_INSTALLED) else "failed",
            f"{why.strip()[:300]} (exit {status})")


def skip_reason(run, device, gpus=1):
    """Why `run` is not started here (None: it is): fp16/bf16 or a path without a GPU, bf16 that the
    GPU would only emulate (torch's default is_bf16_supported() counts emulation as support) or, for
    the emulated row, computes natively, a path that needs more GPUs, or a library that is not
    installed."""
    import torch

    if (run.amp or run.path) and device.type != "cuda":
        return f"{'--amp ' + run.amp if run.amp else 'this path'} is for a GPU (a CPU rehearsal)"
    native = "bf16" in (run.amp, *run.args) and torch.cuda.is_bf16_supported(
        including_emulation=False)
    if run.amp == "bf16" and not native:
        return (f"{torch.cuda.get_device_name(device)} has no native bf16 "
                "(it would only be emulated)")
    if run.path and run.step == 2 and native:
        return (f"{torch.cuda.get_device_name(device)} computes bf16 natively "
                "(this row is for GPUs without)")
    if run.needs > gpus:
        return f"needs {run.needs} GPUs (it shows what one cannot), this machine has {gpus}"
    if run.step in LIBRARY and util.find_spec(LIBRARY[run.step][0]) is None:
        return (f"{LIBRARY[run.step][1]} is not installed for {sys.executable} "
                "(docs/benchmark-gpu.md says how)")


def resume_check(run, c):
    """"equal", or why not: on the small data, 2 epochs uninterrupted against --stop-after 1 then
    --resume auto."""
    # Horovod's fusion packs tensors by arrival: sums over 3+ GPUs in another order each run; none
    # makes them exact.
    base, env = c.work / "runs" / run.slug, {
        **c.env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HOROVOD_FUSION_THRESHOLD": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(c.work / "deterministic"),
                                                    os.environ.get("PYTHONPATH")]))}
    digests = lambda out: {p.name: p.read_text() for p in (base / out).glob("weights-rank*.sha256")}  # noqa: E731

    # a check cut short and continued: what its resume runs left is started again
    for out in {out for out, _ in RESUME}:
        shutil.rmtree(base / out, ignore_errors=True)

    def go(out, *more):
        status, output = launch(command(run, c.small, base / out, 2, c.flags, *more),
                                base / "log.txt", c.timeout, env)
        return output, status and f"{' '.join([out, *more])} failed: {verdict(status, output)[1]}"

    for out, more in RESUME:
        output, failed = go(out, *more)
        if failed:
            return failed
    if not re.search(r"resumed from epoch 1\b", output):
        return "--resume auto did not say `resumed from epoch 1`"
    reference, resumed, ranks = digests("reference"), digests("resumed"), run.nproc
    if (set(reference) != set(resumed)
            or set(reference) != {f"weights-rank{r}.sha256" for r in range(ranks)}):
        return (f"expected weights-rank0..{ranks - 1}.sha256, found {sorted(reference)} and "
                f"{sorted(resumed)}")
    if len(set(reference.values())) > 1 or len(set(resumed.values())) > 1:
        return "differs: the ranks ended with different weights"
    return "equal" if reference == resumed else (
        "differs: other weights than the uninterrupted run's (kernels were deterministic: a resume "
        "that is not exact, or a kernel that is not deterministic still)")


def compute_rate(flags, data, device):
    """Images/s of step 02's own train_one_epoch (forward, backward, optimizer step) on batches
    already on the device, with the run's flags and threads: its loop's rate if data cost nothing.
    Best of 2 after a warm-up."""
    import torch

    from common import metrics

    step = runpy.run_path(str(next(REPO.glob("02_cifar10_*.py"))), run_name="gpu_check_step02")
    args = step["parse_args"](["--data-dir", str(data), *flags])
    train_set, test_set, info = step["build_data"](args)
    loader = step["build_loaders"](args, train_set, test_set)[0]
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    batches = [(x.to(device, memory_format=memory_format), y.to(device))
               for x, y in itertools.islice(loader, 4)]
    batches = (batches * 25)[:min(100, len(loader))]
    torch.backends.cudnn.benchmark = True  # as 02 does on a GPU
    # 02's own precision and model
    dtype, model = step["amp_dtype"](args.amp, device), step["prepare_model"](
        args, step["build_model"](args, info), device)
    optimizer, scheduler, scaler = step["build_optimizer"](args, model, len(batches), device, dtype)
    training = step["Training"](model, optimizer, scheduler, scaler, device, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(launchers.env()["OMP_NUM_THREADS"]))  # as a run has

    def rate():  # one epoch of 02's loop over the batches on the device, no stop
        meter = metrics.Meter(args, len(batches) // args.grad_accum)
        meter.start(None, 0)
        no_stop = types.SimpleNamespace(requested=lambda steps: False)
        return step["train_one_epoch"](args, training, batches, no_stop, meter)["images_per_sec"]

    rates = [rate() for _ in range(3)]
    torch.set_num_threads(threads)
    return max(rates[1:])  # the first pays cuDNN's algorithm search and the allocator


def loader_rates(flags, data):
    """{workers: images/s} of step 02's training DataLoader alone (its transforms in its workers,
    into pinned memory on a GPU) for --workers 2, 4, 8, 16 (as many as there are cores): one epoch,
    from its second batch on (the workers have started)."""
    step = runpy.run_path(str(next(REPO.glob("02_cifar10_*.py"))), run_name="gpu_check_step02")
    rates = {}
    for workers in [w for w in (2, 4, 8, 16) if w <= (os.cpu_count() or 1)] or [2]:
        args = step["parse_args"](["--data-dir", str(data), *flags, "--workers", str(workers)])
        train_set, test_set, _ = step["build_data"](args)
        batches = iter(step["build_loaders"](args, train_set, test_set)[0])
        next(batches)
        start, images = time.perf_counter(), sum(len(x) for x, _ in batches)
        rates[workers] = images / (time.perf_counter() - start)
        del batches  # its workers stop
    return rates


def run_problem(run, status, output, rows, epochs, digests):
    """(outcome, why) of a run that did not end as it must, else None: its exit status and epochs
    and, for a path, equal weights on every rank, finite losses, and 02's emulated bf16 said so."""
    bad = verdict(status, output)
    if bad:
        return bad
    if [r["epoch"] for r in rows] != list(range(1, epochs + 1)):
        return "failed", "exit 0, but metrics.jsonl lacks epochs"
    if not run.path:
        return None
    ranks = {f"weights-rank{r}.sha256" for r in range(run.nproc)}
    if set(digests) != ranks or len(set(digests.values())) > 1:
        return "failed", f"not every rank ended with the same weights: {sorted(digests)}"
    if not all(math.isfinite(r[key]) for r in rows for key in ("train_loss", "test_loss")):
        return "failed", "a loss is not finite"
    if run.step == 2 and "emulated" not in output:
        return "failed", "--amp bf16 did not say it is emulated"
    return None


def check(run, c):
    """(the row of one run, whether its resume check is still due): the timed run, its
    measurements (main runs the resume checks of the timed runs after all of them, beside the
    paths); a path's run (2 epochs on the small data: a few steps on many GPUs, so no accuracy is
    asked) must log finite losses and end with equal weights on every rank, then, where run.resume
    (RESUMED_PATHS), the resume check."""
    from common import metrics

    base, out, epochs = (c.work / "runs" / run.slug, "run" if run.path else "timed",
                         2 if run.path else c.epochs)
    row = {"run": run.label, "outcome": "skipped", "why": skip_reason(run, c.device, c.gpus),
           "resume": None}
    if row["why"]:
        say(f"== {run.label}: skipped: {row['why']}")
        return row, False
    shutil.rmtree(base, ignore_errors=True)
    cmd = command(run, c.small if run.path else c.data, base / out, epochs, c.flags)
    say(f"== {run.label}: {shown(cmd)}")
    status, output = launch(cmd, base / "log.txt", c.timeout, c.env)
    rows = metrics.read(base / out / metrics.FILE)
    digests = {path.name: path.read_text() for path in (base / out).glob("weights-rank*.sha256")}
    bad = run_problem(run, status, output, rows, epochs, digests)
    if bad or run.path:
        row.update(outcome=bad[0] if bad else "ok", why=bad[1] if bad else None,
                   test_acc=rows[-1]["test_acc"] if rows else None,
                   resume=None if bad or not run.resume else resume_check(run, c))
        return row, False
    timed = rows[1:] or rows  # epoch 1 pays the start: workers, cuDNN's algorithm search
    amp = re.search(r"\bamp (\w+(?: \([^)]*\))?), .*steps/epoch", output)
    row.update(outcome="ok", why=None, precision=amp and amp[1], test_acc=rows[-1]["test_acc"],
               images_per_sec=sum(r["images"] for r in timed)
               / sum(r["epoch_seconds"] for r in timed),
               peak_memory_mb=max(r["peak_memory_mb"] for r in rows))
    if row["test_acc"] < c.min_acc:
        row.update(outcome="failed", why=f"did not learn: test accuracy {row['test_acc']:.3f} "
                                         f"< --min-acc {c.min_acc}")
    if run.step == 2:
        try:
            row["compute_images_per_sec"] = compute_rate([*c.flags, *run.args], c.data, c.device)
            row["loop_vs_compute"] = row["images_per_sec"] / row["compute_images_per_sec"]
        except Exception as error:  # a failure the report shows, like a run's
            row.update(outcome="failed", why=f"pure compute rate: {type(error).__name__}: {error}")
    row["resume_due"] = run.resume  # main runs it after the timed runs
    return row, run.resume


def failures(rows):
    """'run: why' of every failed row; a resume that is not exact fails its row (so the counts say
    so too)."""
    for r in rows:
        if r["resume"] not in (None, "equal"):
            before = [r["why"]] if r["outcome"] == "failed" else []
            r.update(outcome="failed", why="; ".join([*before, f"resume: {r['resume']}"]))
    return [f"{r['run']}: {r['why']}" for r in rows if r["outcome"] == "failed"]


def table(rows):
    formats = {"test_acc": ".3f", "images_per_sec": ",.0f", "compute_images_per_sec": ",.0f",
               "loop_vs_compute": ".0%", "peak_memory_mb": ",.0f"}
    lines = ["| run | outcome | precision | test acc | img/s | pure compute img/s | loop/compute "
             "| peak MB | resume |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["run"], r["outcome"] + (f": {r['why']}" if r["why"] else ""), r.get("precision"),
                 *(None if r.get(key) is None else format(r[key], spec)
                   for key, spec in formats.items()), r["resume"]]
        lines.append("| " + " | ".join((cell or "").replace("|", "/") for cell in cells) + " |")
    return lines


def report(rows, planned, c):
    """Write results.json and the page's Results (the rehearsal's copy in the work dir) from the
    rows so far, `planned` in all; return the results."""
    rows = [dict(r) for r in rows]  # failures() marks a row failed by its resume: copies
    failed = failures(rows)
    counts = {outcome: sum(r["outcome"] == outcome for r in rows)
              for outcome in ("ok", "failed", "skipped")}
    # a check cut short: runs not started, or a timed run's resume check not run yet
    due = sum(bool(r.get("resume_due")) for r in rows)
    left = [f"{len(rows)} of {planned} runs done"] if len(rows) < planned else []
    left += [f"{due} resume check{'s' * (due > 1)} still due"] if due else []
    verdict = ("FAILED: " + "; ".join(failed) if failed else "passed") + (
        f" so far, {', '.join(left)}" if left else "")
    results = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "device": c.name, "failed": failed,
               "runs": rows, "verdict": verdict, "command": c.report.command,
               "data": c.report.data, "loader": c.report.loader,
               "loader_against": c.report.loader_against, "planned": c.report.planned}
    results["summary"] = (f"{verdict} ({', '.join(f'{n} {k}' for k, n in counts.items())}; "
                          f"{results['date']})")
    (c.work / "results.json").write_text(json.dumps(results, indent=2))
    c.report.doc.write_text(DOC.read_text().split(RESULTS)[0] + "\n".join([
        RESULTS, "", f"**{results['summary'].split(' (')[0]}** (" + results["summary"].split(
            " (", 1)[1], "", f"- Device: {c.name}", f"- Command: `{c.report.command}`",
        f"- Data: {c.report.data}", "", *table(rows), *loader_table(c.report)]) + "\n")
    return results


def loader_table(report):
    """The loader alone against 02's training (its first timed run), if measured."""
    if not report.loader:
        return []
    if "error" in report.loader:
        return ["", f"Step 02's DataLoader alone: not measured ({report.loader['error']})."]
    label, trained, compute = report.loader_against or (None, None, None)
    return ["", "Step 02's training DataLoader alone (its transforms in its workers, into pinned "
                "memory), one epoch of the timed data" + (
                    f", against `{label}`: {trained:,.0f} img/s training" if label else "")
            + (f", {compute:,.0f} img/s pure compute" if compute else "") + ".",
            "", "| --workers | loader img/s |", "|---|---|",
            *(f"| {workers} | {rate:,.0f} |" for workers, rate in report.loader.items())]


def stop(why, fix="it needs an NVIDIA GPU and a CUDA build of torch; PYTHON=/path/to/python "
                  "picks another Python"):
    print(f"gpu_check: {why}; nothing was run ({fix})", file=sys.stderr, flush=True)
    sys.exit(2)


def check_packages():
    """One line and exit 2 when this Python lacks what every step imports, with the command that
    installs it."""
    missing = [name for name in NEEDED if util.find_spec(name) is None]
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    install = shlex.join([sys.executable, "-m", "pip", "install",
                          *(f"{name}=={pins[name]}" for name in missing)])
    if missing:
        stop(f"{', '.join(missing)} not installed in {sys.executable}, and every step imports "
             + ("it" if len(missing) == 1 else "them"),
             f"fix: {install}; without a registry: docs/benchmark-gpu.md")


def find_device(args):
    """(device, processes, what it runs on); one line and exit 2 when there is no GPU to check."""
    import torch

    if not (torch.cuda.is_available() or args.rehearse_on_cpu):
        stop(f"no CUDA GPU: torch {torch.__version__} in {sys.executable} "
             + ("is a CPU build" if torch.version.cuda is None
                else f"(CUDA {torch.version.cuda}) sees none"))
    device = torch.device("cpu") if args.rehearse_on_cpu else torch.device("cuda", 0)
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    found = ", ".join(f"{n} {metadata.version(n)}" for n in ("torch", "deepspeed", "horovod")
                      if util.find_spec(n))
    driver = shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.split()
    where = (f"{count} x {torch.cuda.get_device_name(device)}"
             + (f" (driver {driver[0]})" if driver else "") if count
             else "CPU (rehearsal: not GPU figures)")
    return device, args.gpus or count or 1, f"{where}; {found}, CUDA {torch.version.cuda}"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh",
                                     usage="%(prog)s [options] [-- run flags]",
                                     description=__doc__.split("\n\n")[2].replace("\n", " "))
    parser.add_argument("--steps", default="02,03,04,05,06,07,08",
                        help="e.g. 02,04, run in that order (default: 02 to 08)",
                        type=lambda text: (
                            list(dict.fromkeys(int(s) for s in text.split(",")))
                            if re.fullmatch(r"0?[2-8](,0?[2-8])*", text)
                            else parser.error(f"--steps: 02 to 08 like 02,04, not {text}")))
    parser.add_argument("--gpus", type=int,
                        help="processes of 04-08 (default: every GPU; 1 without one)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="of a timed run (default 3; img/s: 2..E)")
    parser.add_argument("--train-size", type=int, default=50000,
                        help="(default 50000; resume, paths: <= 5000)")
    parser.add_argument("--test-size", type=int, default=10000,
                        help="(default 10000; resume, paths: <= 1025)")
    parser.add_argument("--min-acc", type=float, default=0.3,
                        help="learned: last test accuracy (default 0.3)")
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds per run (default 1800)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "bench" / "gpu-check",
                        help="(default bench/gpu-check)")
    parser.add_argument("--jobs", type=int, default=min(4, max(1, (os.cpu_count() or 1) // 4)),
                        help="resume checks and paths run side by side after the timed runs "
                             "(default: a quarter of the cores, at most 4)")
    parser.add_argument("--continue-from", type=Path, metavar="RESULTS_JSON",
                        help="a check cut short (its results.json): keep its ok rows, run the "
                             "rest (and resume checks it lacks); the report holds both")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every command it would start; needs no GPU")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="all on the CPU (report: WORK/benchmark-gpu.md)")
    return parser.parse_args(argv)


def dry_run(args, work, flags):
    say(f"gpu_check --dry-run with {args.gpus or 1} GPU(s): each timed run; after a default "
        "run and 02 --amp fp16, its resume check; then each path (and the resume check of "
        "those whose checkpoints hold more)")
    for run in plan(args.steps, args.gpus or 1):
        base, out = work / "runs" / run.slug, "run" if run.path else "timed"
        timed = command(run, work / "data" / ("resume" if run.path else "timed"), base / out,
                        2 if run.path else args.epochs, flags)
        needs = f"  (needs {run.needs} GPUs)" if run.needs > (args.gpus or 1) else ""
        say(f"{run.label}:\n  {shown(timed)}{needs}")
        for out, more in RESUME if run.resume else []:
            resume = command(run, work / "data" / "resume", base / out, 2, flags, *more)
            say(f"  {shown(resume)}")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, flags = parse_args(argv[:split]), argv[split + 1:]
    work = args.work_dir.resolve()
    check_packages()
    if args.dry_run:
        return dry_run(args, work, flags)
    device, gpus, name = find_device(args)
    from synthetic import write_synthetic_cifar10

    # all on the CPU
    hide = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"} if args.rehearse_on_cpu else {}
    c = types.SimpleNamespace(**{**vars(args), "gpus": gpus}, work=work, device=device,
                              flags=flags, env=hide, data=work / "data" / "timed", name=name,
                              small=work / "data" / "resume")
    # 1,025: 513 and 512 test images on 2 GPUs
    small = (min(args.train_size, 5000), min(args.test_size, 1025))
    say(f"gpu_check: {name}")
    write_synthetic_cifar10(str(c.data), args.train_size, args.test_size, kind="easy")
    write_synthetic_cifar10(str(c.small), *small, kind="easy")
    (work / "deterministic").mkdir(exist_ok=True)
    (work / "deterministic" / "sitecustomize.py").write_text(DETERMINISTIC)
    previous = json.loads(args.continue_from.read_text()) if args.continue_from else {}
    runs, rows, lock = plan(args.steps, gpus), {r["run"]: r for r in previous.get("runs", [])}, \
        threading.Lock()
    # the rows planned before (a run cut short leaves some out), then this run's new ones
    order = list(dict.fromkeys([*previous.get("planned", rows), *(r.label for r in runs)]))
    kept = {label: row for label, row in rows.items() if row["outcome"] == "ok"}
    this = shlex.join(["bash", "scripts/gpu_check.sh", *argv])
    c.report = types.SimpleNamespace(
        command=f"{previous['command']}`, then `{this}" if previous else this,
        doc=work / DOC.name if args.rehearse_on_cpu else DOC, loader=previous.get("loader", {}),
        loader_against=previous.get("loader_against"), planned=order,
        data=f"scripts/synthetic.py --easy, {args.train_size} / {args.test_size} images, "
             f"{args.epochs} epochs (img/s of 2..{args.epochs}); resume check and paths "
             f"{small[0]} / {small[1]}, 2 epochs")

    def done(run, row):  # the report so far, after each row (a check cut short leaves its rows)
        with lock:
            rows[run.label] = row
            return report([rows[label] for label in order if label in rows], len(order), c)

    # The timed runs one by one, the machine to themselves; after 02's first, its loader alone.
    due = []
    for run in (r for r in runs if not r.path):
        if run.label in kept:  # --continue-from: measured; its resume check may be due
            if run.resume and kept[run.label]["resume"] is None:
                kept[run.label]["resume_due"] = True  # a results.json written before the key
                due.append((run, kept[run.label]))
            continue
        row, resume = check(run, c)
        if run.step == 2 and row["outcome"] == "ok" and not c.report.loader:
            try:
                c.report.loader = loader_rates([*c.flags, *run.args], c.data)
                c.report.loader_against = (run.label, row["images_per_sec"],
                                           row.get("compute_images_per_sec"))
            except Exception as error:  # the check goes on; the report says why it lacks them
                c.report.loader = {"error": f"{type(error).__name__}: {error}"}
        done(run, row)
        if resume:
            due.append((run, row))

    def finish(run, row):  # a timed run's resume check, or a path (and its own)
        if row is None:
            row = check(run, c)[0]
        else:
            row.update(resume=resume_check(run, c), resume_due=False)
        return done(run, row)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: finish(*job), [*due, *(
            (r, None) for r in runs
            if r.path and not (r.label in kept and (kept[r.label]["resume"] or not r.resume)))]))
    results = report([rows[label] for label in order if label in rows], len(order), c)
    say("\n".join([*table(results["runs"]), *loader_table(c.report)])
        + f"\nwrote {work / 'results.json'} and {c.report.doc}\ngpu_check: {results['summary']}")
    failed = results["failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
