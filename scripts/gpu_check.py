"""The GPU check: every step on this machine's NVIDIA GPUs, on generated data, with the PyTorch found here.

    bash scripts/gpu_check.sh [--bundle gpu-bundle] [--steps 02,04] [--arch cnn]   # what you run (it calls this)
    python scripts/gpu_check.py --dry-run --gpus 2      # the runs and commands it would start; needs no GPU
    python scripts/gpu_check.py --bundle-list           # what scripts/gpu_bundle.sh downloads
    python scripts/gpu_check.py --pending-doc           # docs/benchmark-gpu.md as it stands before a GPU run
    python scripts/gpu_check.py --rehearse-on-cpu --steps 02 --arch cnn --work-dir /tmp/r   # test the check itself

1. Environment. GPU machines come with their own CUDA PyTorch (and often no registry access), so the check
   never installs torch: it makes a virtual environment in WORK/env that sees every package of the Python that
   started it (a .pth file adds that Python's site-packages), and installs into it only what is missing: the
   pins of requirements.txt (without torch, its own dependencies and the test tools), then DeepSpeed, then
   Horovod (scripts/install_horovod.sh, NCCL build), from --bundle (written by scripts/gpu_bundle.sh; offline)
   or else from the package index. A package already there is kept at its version. What cannot be had or
   built is one line, "skipped ...: why", and the steps that need it say so instead of running.
2. Data: a CIFAR-10-layout data set written by common.synthetic (50,000 training / 10,000 test images, the
   size of CIFAR-10; textures, or --easy) for the timed runs, and a small one for the resume runs.
3. Every step on the GPUs, through the launcher its README section gives: 02 with --amp fp16, bf16 and off;
   03 (DataParallel over all GPUs); 04 (torchrun, NCCL, one process per GPU: one GPU is still a real NCCL
   group); 05 (deepspeed) with ZeRO 2 and 3 in bf16 and in fp16; 06 (horovodrun) when Horovod is there; 07
   (torchrun, --amp-backend auto); 08 when its script exists (launcher read from its docstring; bf16). Per step:
   * the timed run: --epochs E; from its metrics.jsonl: learned (last test_acc >= --min-acc, chance is 0.10),
     img/s of epochs 2..E, peak GPU memory of rank 0;
   * loop/compute: that rate over processes x the model's pure compute rate, measured here with step 02's
     own train_one_epoch on batches already on the GPU (same model, batch per process and precision);
   * resume: on the small data, a run of 2 epochs, and the same stopped by --stop-after 1 and continued with
     --resume auto; the weights-rank*.sha256 files must be equal (the CPU tests demand that of every step).
     These three runs use deterministic cuDNN kernels (a .pth in WORK/env sets torch.backends.cudnn.
     deterministic when GPU_CHECK_DETERMINISTIC=1), since cuDNN's fastest kernels may add in another order on
     every run. If they still differ, a second uninterrupted run tells "resume broken" (it agrees with the
     first) from "this GPU's kernels are not deterministic" (it does not: reported n/a).
4. Step 02's targets: its full training loop >= 90% of the pure compute rate; its DataLoader alone (the one
   02 builds, each batch copied to the GPU) >= 5x the training rate (the faster of compute and the loops).
5. The results: a table on the console, WORK/results.json, and docs/benchmark-gpu.md (overwritten).
Exit status: 0 when every check that ran passed (skips are listed, not failures), 1 when one failed, 2 when the
check could not start (no GPU, no CUDA PyTorch: one line).
"""
import argparse
import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `common` lives at the repository root

MIN_TORCH = (2, 4)  # torch.library.register_fake (common/_torchvision.py), torch.amp.GradScaler("cuda")
DOC = REPO / "docs" / "benchmark-gpu.md"
ALL_STEPS = [2, 3, 4, 5, 6, 7, 8]
AMPS = ["fp16", "bf16", "off"]
# What the bundle leaves out of requirements.txt, and why.
NOT_BUNDLED = {"torch": "the GPU machine's own CUDA build is used",
               **dict.fromkeys(["filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx", "sympy"],
                               "a dependency of torch: it comes with the GPU machine's torch"),
               **dict.fromkeys(["pytest", "iniconfig", "pluggy", "pygments"],
                               "test tools: the check does not run them")}
SDIST_ONLY = {"deepspeed"}  # published as source only; installed with --no-build-isolation (its setup.py imports torch)
# To build DeepSpeed and Horovod from source without the index; cmake (last 3.x: Horovod's third-party CMake
# files predate CMake 4) only with gpu_bundle.sh --with-cmake, for machines without one.
BUILD_TOOLS = [("tool", "setuptools", "84.2.1"), ("tool", "wheel", "0.48.0"), ("optional", "cmake", "3.31.10")]
MODULES = {5: "deepspeed", 6: "horovod.torch"}  # what a step imports besides the common ones
COMMON_MODULES = ["common.data", "tqdm", "matplotlib"]  # common.data: torchvision, through our import work-around


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def horovod_version():
    match = re.search(r"^HVD_VERSION=(\S+)", (REPO / "scripts" / "install_horovod.sh").read_text(), re.M)
    return match.group(1)


def bundle_list():
    """[(kind, name, version)]: kind wheel (binary for the GPU machine's Python), sdist, tool or optional."""
    items = []
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==(\S+)", line.strip())
        if match and canonical(match.group(1)) not in NOT_BUNDLED:
            items.append(("sdist" if canonical(match.group(1)) in SDIST_ONLY else "wheel", *match.groups()))
    return items + [("sdist", "horovod", horovod_version())] + BUILD_TOOLS


def pinned_torch():
    match = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M)
    return match.group(1) if match else "?"


def version_tuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:2])


# ----------------------------------------------------------------------------- the runs
class Run:
    """One step configuration: how it is started and what it is told."""

    def __init__(self, step, launcher, nproc, amp, extra=(), label=None):
        self.step, self.launcher, self.nproc, self.amp, self.extra = step, launcher, nproc, amp, list(extra)
        self.label = label or f"{step:02d}"
        self.slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{self.label} {amp}").strip("-").lower()

    def script(self):
        found = sorted(REPO.glob(f"{self.step:02d}_cifar10_*.py"))
        return found[0] if found else None


def docstring_launcher(path):
    """The launcher the script's docstring starts it with (torchrun, deepspeed, ...); python if it names none."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    for line in doc.splitlines():
        before = line.split(path.name)[0] if path.name in line else None
        if before is None:
            continue
        for word, launcher in [("torch.distributed.launch", "legacy"), ("torchrun", "torchrun"),
                               ("deepspeed", "deepspeed"), ("horovodrun", "horovodrun")]:
            if word in before:
                return launcher
        return "python"
    return "python"


def plan(gpus, steps, amps=AMPS):
    """The runs of the check on a machine with `gpus` GPUs, for the step numbers in `steps` and precisions in `amps`."""
    runs = []
    if 2 in steps:
        runs += [Run(2, "python", 1, amp) for amp in ("fp16", "bf16", "off")]
    if 3 in steps:
        runs.append(Run(3, "python", 1, "fp16", label="03 DataParallel"))
    if 4 in steps:
        runs.append(Run(4, "torchrun", gpus, "fp16", label="04 DDP nccl"))
    if 5 in steps:
        runs += [Run(5, "deepspeed", gpus, amp, ["--deepspeed_config", "ds_config.json", "--zero-stage", str(zero)],
                     label=f"05 ZeRO-{zero}") for zero in (2, 3) for amp in ("bf16", "fp16")]
    if 6 in steps:
        runs.append(Run(6, "horovodrun", gpus, "fp16", label="06 Horovod"))
    if 7 in steps:
        runs.append(Run(7, "torchrun", gpus, "fp16", ["--amp-backend", "auto"], label="07 Apex/auto"))
    script8 = Run(8, "python", 1, "fp16").script()
    if 8 in steps and script8 is not None:
        launcher = docstring_launcher(script8)
        runs.append(Run(8, launcher, 1 if launcher == "python" else gpus, "bf16",  # FSDP2's MixedPrecisionPolicy
                        label=f"08 {script8.stem.split('_')[-1].upper()}"))
    return [run for run in runs if run.amp in amps]


def script_args(run, data_dir, out_dir, epochs, args):
    return ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--epochs", str(epochs),
            "--batch-size", str(args.batch_size), "--arch", args.arch, "--workers", str(args.workers),
            "--seed", "0", "--amp", run.amp, *run.extra]


def command(run, data_dir, out_dir, epochs, args, *more):
    from common import launchers

    return [*launchers.launch_command(run.launcher, run.nproc, run.script()),
            *script_args(run, data_dir, out_dir, epochs, args), *more]


def shown(cmd):
    """A command as a reader would type it: python, launchers by name, paths relative to the repository."""
    bin_dir = str(Path(sys.executable).parent) + os.sep
    words = []
    for word in map(str, cmd):
        if word == sys.executable:
            word = "python"
        elif word.startswith(bin_dir):
            word = word[len(bin_dir):]
        elif word.startswith(str(REPO) + os.sep):
            word = os.path.relpath(word, REPO)
        words.append(word)
    return shlex.join(words)


# ----------------------------------------------------------------------------- the environment (outside it)
def say(text):
    print(text, flush=True)


def stop(message):
    """The check cannot start here: one line, exit status 2."""
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def quiet(cmd, timeout=1800, **env):
    """(exit status, stdout+stderr) of a command; status None when it timed out."""
    try:
        proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env={**os.environ, **env}, cwd=REPO)
        return proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as error:
        return None, str(error.stdout or "")


def why(output):
    """The line of a tool's output that says what went wrong: pip's or a script's first error, else the last
    line naming an error (a traceback's), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    found = [line for line in lines if re.match(r"^(ERROR|error): ", line) and "subprocess-exited" not in line]
    found = found[:1] or [line for line in lines if "Error" in line][-1:] or lines[-1:] or ["no output"]
    return re.sub(r"^(ERROR|error): ", "", found[0])[:240]


def make_env(work):
    """WORK/env: a virtual environment that sees this Python's packages (and so its torch). Returns its python."""
    env_dir = work / "env"
    py = env_dir / "bin" / "python"
    stamp = env_dir / "gpu-check-outer-python"
    if not (py.exists() and stamp.is_file() and stamp.read_text() == sys.executable):
        shutil.rmtree(env_dir, ignore_errors=True)
        status, output = quiet([sys.executable, "-m", "venv", "--without-pip", env_dir], timeout=300)
        if status != 0:
            stop(f"cannot make a virtual environment in {env_dir}: {why(output)}")
        stamp.write_text(sys.executable)
    import site

    outer = [p for p in site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
             + os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isdir(p) and Path(p) != REPO]
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip()
    site_dir = Path(purelib)
    if env_dir.resolve() not in site_dir.resolve().parents:  # never write into another Python's site-packages
        stop(f"{py} reports site-packages {purelib!r}, outside {env_dir}; remove {env_dir}")
    # .pth files run at start-up, in name order: first add the outer packages (with their own .pth files)...
    (site_dir / "gpu_check_0_outer.pth").write_text(
        f"import site; [__import__('site').addsitedir(p) for p in {outer!r}]\n")
    # ... then, only for the resume runs, deterministic cuDNN kernels (the scripts turn on cudnn.benchmark, which
    # still picks among deterministic kernels then).
    (site_dir / "gpu_check_1_deterministic.pth").write_text(
        "import os; exec('import torch\\ntorch.backends.cudnn.deterministic = True') "
        "if os.environ.get('GPU_CHECK_DETERMINISTIC') == '1' else None\n")
    return py


def installed(py):
    """{canonical name: version} of every distribution `py` sees."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    status, output = quiet([py, "-c", code], timeout=120)
    found = json.loads(output.strip().splitlines()[-1]) if status == 0 else {}
    return {canonical(name): version for name, version in found.items()}


def pip_install(py, bundle, spec, *options):
    """Install one pinned package into the check's environment, from the bundle if there is one. (ok, why)."""
    source = ["--no-index", "--find-links", str(bundle)] if bundle else ["--retries", "1", "--timeout", "20"]
    status, output = quiet([py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-deps",
                            *source, *options, spec], DS_BUILD_OPS="0")
    if status == 0:
        return True, None
    reason = why(output)
    if bundle and ("No matching distribution" in output or "Could not find a version" in output):
        reason = (f"not in the bundle {bundle} for Python {sys.version_info[0]}.{sys.version_info[1]} on this "
                  "platform (make it with scripts/gpu_bundle.sh --python X.Y --platform ...)")
    return False, reason


def find_nvcc():
    for home in (os.environ.get("HOROVOD_CUDA_HOME"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def install_horovod(py, bundle, work, skipped):
    """Build Horovod (NCCL) with scripts/install_horovod.sh, from the bundle's source if there is one."""
    nvcc = find_nvcc()
    if nvcc is None:
        skipped.append("Horovod (step 06): no CUDA toolkit (nvcc) to build its NCCL operations with; "
                       "set HOROVOD_CUDA_HOME or install the toolkit")
        return
    cache = work / "horovod"
    env = {"PYTHON": str(py), "HOROVOD_WHEEL_CACHE": str(cache), "HOROVOD_GPU_OPERATIONS": "NCCL",
           "HOROVOD_CUDA_HOME": os.environ.get("HOROVOD_CUDA_HOME", str(Path(nvcc).resolve().parents[1]))}
    if bundle:
        sdists = sorted(Path(bundle).glob(f"horovod-{horovod_version()}.tar.gz"))
        if not sdists:
            skipped.append(f"Horovod (step 06): horovod-{horovod_version()}.tar.gz is not in the bundle {bundle}")
            return
        (cache / "sdist").mkdir(parents=True, exist_ok=True)
        shutil.copy(sdists[0], cache / "sdist")
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(bundle))
    say("== building Horovod with NCCL (scripts/install_horovod.sh; minutes)")
    status, output = quiet(["bash", REPO / "scripts" / "install_horovod.sh"], timeout=3600, **env)
    if status != 0:
        log = re.findall(r"Full log: (\S+)", output)
        skipped.append(f"Horovod (step 06): its build failed: {why(output)}" + (f" (log: {log[-1]})" if log else ""))


def write_launchers(py, steps):
    """The launchers of `steps` in WORK/env/bin, run by its python (the outer ones would run the outer python)."""
    entry = {"torchrun": ("torch.distributed.run", "main", {4, 7, 8}),
             "deepspeed": ("deepspeed.launcher.runner", "main", {5}),
             "horovodrun": ("horovod.runner.launch", "run_commandline", {6})}
    for name, (module, function, users) in entry.items():
        path = py.parent / name
        if not users & set(steps) or path.exists() or quiet([py, "-c", f"import {module}"], timeout=300)[0] != 0:
            continue
        path.write_text(f"#!{py}\n# written by scripts/gpu_check.py\nimport sys\nfrom {module} import {function}\n"
                        f"sys.exit({function}())\n")
        path.chmod(0o755)


def prepare(args):
    """Make WORK/env, install what is missing into it, and return its python and the skip lines."""
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    py = make_env(work)
    skipped = []
    have = installed(py)
    bundle = args.bundle
    say(f"== environment {work / 'env'}: the packages of {sys.executable}, plus what is missing "
        + (f"from the bundle {bundle}" if bundle else "from the package index (no --bundle)"))
    if "pip" not in have:
        skipped.append(f"installing anything: {sys.executable} has no pip")
    builds = (5 in args.steps and "deepspeed" not in have) or (6 in args.steps and "horovod" not in have)
    needed = [item for item in bundle_list() if item[0] in ("wheel", "sdist") or (builds and item[0] == "tool")]
    if 6 in args.steps and "horovod" not in have and shutil.which("cmake") is None:
        needed += [item for item in bundle_list() if item[1] == "cmake"]
    # The build tools first, the sources last (DeepSpeed's setup.py imports some of its dependencies).
    needed.sort(key=lambda item: ["tool", "optional", "wheel", "sdist"].index(item[0]))
    for kind, name, version in needed:
        here = have.get(canonical(name))
        if here is not None and here != version and kind != "tool":
            say(f"   kept {name} {here} of this machine (requirements.txt pins {version})")
        if here is not None or name == "horovod" or "pip" not in have or (name == "deepspeed" and 5 not in args.steps):
            continue  # there already; built below; nothing to install with; not needed
        options = ["--no-build-isolation"] if kind == "sdist" else []
        ok, reason = pip_install(py, bundle, f"{name}=={version}", *options)
        if not ok and kind == "optional":
            reason = f"no cmake on PATH for Horovod's build, and {reason} (gpu_bundle.sh --with-cmake adds it)"
        say(f"   installed {name}=={version}" if ok else f"   skipped {name}=={version}: {reason}")
        if not ok:
            skipped.append(f"{name}=={version}: {reason}")
    if 6 in args.steps and "pip" in have and quiet([py, "-c", "import horovod.torch"], timeout=300)[0] != 0:
        if args.no_horovod_build:
            skipped.append("Horovod (step 06): not installed, and --no-horovod-build")
        else:
            install_horovod(py, bundle, work, skipped)
    write_launchers(py, args.steps)
    return py, skipped


# ----------------------------------------------------------------------------- running the steps (inside it)
def launch(cmd, out_dir, timeout, **env_extra):
    """Run a command from the repository root in its own process group: (exit status or None, output)."""
    from common import launchers

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=launchers.env(**env_extra),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except OSError as error:  # no such launcher
        return 127, f"ERROR: cannot start {cmd[0]}: {error.strerror}"
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        output, status = proc.communicate()[0] + f"\n[gpu_check: killed after {timeout} s]", None
    with open(out_dir / "log.txt", "a") as f:
        f.write(f"$ {shown(cmd)}\n{output}\n")
    return status, output


def verdict(status, output, rows, epochs, timeout):
    """None if the run finished all epochs, else (status, reason): skipped (the script said in its one-line error
    why it cannot run here: no GPU for fp16, a library missing, ...) or failed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [m.group(1) for m in (re.match(r"^(?:\[rank \d+\] )?error: (.*)$", line) for line in lines) if m]
    if status is None:
        return "failed", f"timed out after {timeout} s"
    if status != 0 and errors:  # the scripts' one-line error (exit 2; a launcher turns a rank's 2 into 1)
        return "skipped", errors[0]
    if status != 0:
        return "failed", f"exit {status}: " + (errors[0] if errors else why(output))
    if [r["epoch"] for r in rows] != list(range(1, epochs + 1)):
        return "failed", f"exit 0 but metrics.jsonl has epochs {[r['epoch'] for r in rows]}"
    return None


def digests(out_dir):
    return {p.name: p.read_text().strip() for p in sorted(Path(out_dir).glob("weights-rank*.sha256"))}


class Check:
    """Runs the plan on this machine and collects the rows."""

    def __init__(self, args, device, gpus):
        self.args, self.device, self.gpus = args, device, gpus
        self.cores = len(os.sched_getaffinity(0))
        self.compute_cache, self.imports = {}, {}
        self.step02 = None

    def env(self, run, deterministic=False):
        threads = max(1, self.cores // run.nproc)
        extra = {"OMP_NUM_THREADS": threads, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_DEBUG": "VERSION"}
        if deterministic:
            extra["GPU_CHECK_DETERMINISTIC"] = "1"
        if self.args.rehearse_on_cpu:
            extra.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        return extra

    def missing_module(self, run):
        for module in COMMON_MODULES + ([MODULES[run.step]] if run.step in MODULES else []):
            if module not in self.imports:
                status, output = quiet([sys.executable, "-c", f"import {module}"], timeout=300)
                self.imports[module] = None if status == 0 else f"needs {module}, which does not import: {why(output)}"
            if self.imports[module]:
                return self.imports[module]
        return None

    def execute(self, run):
        args = self.args
        row = {"label": run.label, "step": f"{run.step:02d}", "launcher": run.launcher, "processes": run.nproc,
               "amp": run.amp, "status": "skipped", "reason": None, "notes": [], "resume": None, "resume_ok": None}
        if run.step == 3:
            row["notes"].append(f"DataParallel over {self.gpus} GPU(s); compute reference: one GPU")
        reason = self.missing_module(run)
        if run.amp == "bf16" and self.device.type == "cuda":
            import torch

            if not torch.cuda.is_bf16_supported():
                major, minor = torch.cuda.get_device_capability(self.device)
                reason = f"this GPU (compute capability {major}.{minor}) has no bf16; Ampere (8.0) or newer has"
        if reason:
            row["reason"] = reason
            return row
        base = args.work_dir / "runs" / run.slug
        shutil.rmtree(base, ignore_errors=True)
        out = base / "timed"
        cmd = command(run, args.data, out, args.epochs, args)
        row["command"] = shown(cmd)
        say(f"== {run.label} --amp {run.amp}: {row['command']}")
        status, output = launch(cmd, out, args.timeout, **self.env(run))
        from common import metrics

        rows = metrics.read(str(out / metrics.FILE))
        bad = verdict(status, output, rows, args.epochs, args.timeout)
        if bad:
            row["status"], row["reason"] = bad
            say(f"   {row['status']}: {row['reason']}")
            return row
        row["status"] = "ran"
        timed = rows[1:] or rows  # epoch 1 pays the start: cuDNN's algorithm search, workers, allocator
        row.update(test_acc=rows[-1]["test_acc"], learned=rows[-1]["test_acc"] >= args.min_acc,
                   images_per_sec=sum(r["images_per_sec"] * r["epoch_seconds"] for r in timed)
                   / sum(r["epoch_seconds"] for r in timed),
                   peak_memory_mb=max((r.get("peak_memory_mb") or 0) for r in rows) or None)
        row["notes"] += sorted({f"NCCL {v}" for v in re.findall(r"NCCL version ([0-9][\w.+-]*)", output)})
        row["notes"] += [line.strip()[:120] for line in output.splitlines() if line.startswith("amp backend:")]
        per_process = self.compute(run.amp)
        row["compute_images_per_sec"] = per_process * run.nproc if per_process else None
        row["loop_vs_compute"] = row["images_per_sec"] / row["compute_images_per_sec"] if per_process else None
        row["resume"], row["resume_ok"] = self.resume(run, base)
        say(f"   learned: {'yes' if row['learned'] else 'NO'} (test_acc {row['test_acc']:.3f}); "
            f"{row['images_per_sec']:,.0f} img/s; loop/compute {pct(row['loop_vs_compute'])}; "
            f"peak {fmt(row['peak_memory_mb'])} MB; resume exact: {row['resume']}")
        return row

    def resume(self, run, base):
        """(text, ok): the stopped-and-resumed run against an uninterrupted one, bit for bit."""
        args, epochs = self.args, 2
        env = self.env(run, deterministic=True)

        def go(name, *more):
            out = base / name
            status, output = launch(command(run, args.small_data, out, epochs, args, *more), out, args.timeout, **env)
            return out, status, output

        reference, status, output = go("reference")
        if status != 0:
            return f"no: the uninterrupted run failed: {why(output)}", False
        resumed, status, output = go("resumed", "--stop-after", "1")
        if status != 0:
            return f"no: the run with --stop-after 1 failed: {why(output)}", False
        resumed, status, output = go("resumed", "--resume", "auto")
        if status != 0 or "resumed from epoch 1" not in output:
            return f"no: --resume auto did not resume from epoch 1: {why(output)}", False
        expected, got = digests(reference), digests(resumed)
        if not expected or sorted(expected) != sorted(got):
            return f"no: weights-rank*.sha256 files: {sorted(expected)} vs {sorted(got)}", False
        if expected == got:
            return "yes", True
        again, status, _ = go("reference-again")
        if status == 0 and digests(again) != expected:
            return "n/a: two uninterrupted runs differ too (this GPU's kernels are not deterministic)", None
        return "no: other weights than the uninterrupted run", False

    # --- in-process measurements, with step 02's own code
    def load_step02(self):
        if self.step02 is None:
            import runpy

            (path,) = REPO.glob("02_cifar10_*.py")
            self.step02 = runpy.run_path(str(path), run_name="gpu_check_step02")
        return self.step02

    def step02_args(self, amp, out_dir):
        return self.load_step02()["parse_args"](
            ["--data-dir", str(self.args.data), "--out-dir", str(out_dir), "--batch-size", str(self.args.batch_size),
             "--arch", self.args.arch, "--workers", str(self.args.workers), "--amp", amp,
             "--lr", "0.001"])  # random labels: a small step keeps fp16 finite (a skipped step would be faster)

    def compute(self, amp):
        """Images/s of one process: step 02's train_one_epoch on batches already on the device (best of 3)."""
        if amp not in self.compute_cache:
            try:
                self.compute_cache[amp] = self.measure_compute(amp)
                if self.device.type == "cuda":
                    import torch

                    torch.cuda.empty_cache()  # give the runs back what the measurement's model held
            except Exception as error:  # a reference we cannot take is a missing figure, not a failed check
                say(f"   no pure compute reference for --amp {amp}: {type(error).__name__}: {error}")
                self.compute_cache[amp] = None
        return self.compute_cache[amp]

    def measure_compute(self, amp):
        import torch

        from common.cli import amp_dtype

        s02 = self.load_step02()
        a = self.step02_args(amp, self.args.work_dir / "compute")
        dtype = amp_dtype(amp, self.device)
        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = True  # as 02 does
        model = s02["build_model"](a, self.device)
        steps = self.args.compute_steps
        optimizer, scheduler, scaler = s02["build_optimizer"](a, model, steps, self.device, dtype)
        memory_format = torch.channels_last if a.channels_last else torch.contiguous_format
        batches = [(torch.randint(0, 256, (a.batch_size, 3, 32, 32), dtype=torch.uint8).to(
            self.device, memory_format=memory_format), torch.randint(0, 10, (a.batch_size,)).to(self.device))
                   for _ in range(4)]
        loader = [batches[i % len(batches)] for i in range(steps)]
        never = types.SimpleNamespace(requested=lambda: False)  # no stop signal to wait for (common/preempt.py)
        s02["train_one_epoch"](model, loader[:max(2, steps // 4)], optimizer, scheduler, scaler, self.device, dtype,
                               memory_format, 1, 1, never, None)  # warm-up: cuDNN's algorithm search, the allocator
        rate = max(s02["train_one_epoch"](model, loader, optimizer, scheduler, scaler, self.device, dtype,
                                          memory_format, 1, 1, never, None)["images_per_sec"] for _ in range(3))
        return rate

    def loader_rate(self):
        """Images/s of step 02's own training DataLoader alone, each batch copied to the device (steady epochs)."""
        import torch

        a = self.step02_args("off", self.args.work_dir / "loader")
        train_loader, _, sampler = self.load_step02()["build_data"](a)
        memory_format = torch.channels_last if a.channels_last else torch.contiguous_format
        rates = []
        for epoch in (1, 2, 3):
            sampler.generator.manual_seed(epoch)
            train_loader.dataset.set_epoch(epoch)
            seen, start = 0, time.perf_counter()
            for images, labels in train_loader:
                images = images.to(self.device, non_blocking=True, memory_format=memory_format)
                labels = labels.to(self.device, non_blocking=True)
                seen += len(labels)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            rates.append(seen / (time.perf_counter() - start))
        return max(rates[1:])  # epoch 1 starts the workers


def targets(rows, loader_rate):
    """Step 02's targets: [(text, passed)]."""
    ran = [r for r in rows if r["step"] == "02" and r["status"] == "ran"]
    found = []
    for r in ran:
        if r.get("loop_vs_compute") is not None:
            found.append((f"02 --amp {r['amp']}: full training loop {fmt(r['images_per_sec'])} img/s = "
                          f"{pct(r['loop_vs_compute'])} of the pure compute rate ({fmt(r['compute_images_per_sec'])} "
                          f"img/s); target >= 90%", r["loop_vs_compute"] >= 0.9))
    training = max([r["images_per_sec"] for r in ran] + [r["compute_images_per_sec"] or 0 for r in ran] + [0])
    if loader_rate and training:
        found.append((f"02's data loader alone: {fmt(loader_rate)} img/s = {loader_rate / training:.1f}x the training "
                      f"rate ({fmt(training)} img/s, the fastest of 02's loops and compute rates); target >= 5x",
                      loader_rate >= 5 * training))
    return found


# ----------------------------------------------------------------------------- the report
def fmt(value, digits=0):
    return "—" if value is None else f"{value:,.{digits}f}"


def pct(value):
    return "—" if value is None else f"{100 * value:.0f}%"


COLUMNS = ["step", "launcher", "processes", "amp", "learned (test acc)", "resume exact", "img/s", "loop/compute",
           "peak MB", "notes"]


def table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if r["status"] == "ran":
            cells = [f"{'yes' if r['learned'] else 'NO'} ({r['test_acc']:.3f})", r["resume"], fmt(r["images_per_sec"]),
                     pct(r["loop_vs_compute"]), fmt(r["peak_memory_mb"]), "; ".join(r["notes"])]
        else:
            cells = ["—", "—", "—", "—", "—", f"{r['status']}: {r['reason']}"]
        cells = [r["label"], r["launcher"], str(r["processes"]), r["amp"]] + cells
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


HOW_TO = """## How to produce it

On a machine with one or more NVIDIA GPUs and a CUDA build of PyTorch (>= {min_torch}; the check uses the one it
finds, `PYTHON=/path/to/python` picks another, and does not need our pinned {pinned}):

    bash scripts/gpu_check.sh                       # every step: expect tens of minutes
    bash scripts/gpu_check.sh --steps 02,04 --arch cnn   # a subset, the small model
    bash scripts/gpu_check.sh --help                # every option

Without a GPU it says so in one line and exits 2; the CPU test suite is `.venv/bin/python -m pytest`.
It installs nothing into that Python: it makes `bench/gpu-check/env`, a virtual environment that sees the
Python's packages, and adds there only what is missing (one `skipped ...: why` line for what cannot be had).
Its work (data, every run's out-dir and log.txt, results.json) is in `bench/gpu-check/`.

GPU machines often have no registry access. Then prepare a bundle on a machine that has it, copy it over
and point the check at it (`./gpu-bundle` is used without asking). It holds wheels of our pins for the GPU
machine's Python and platform and the sources of DeepSpeed and Horovod, never torch: 55 MiB for one Python
version; `--skip numpy,pillow,torchvision` (what most CUDA torch installations already have) makes it 24 MiB.

    bash scripts/gpu_bundle.sh --python 3.12 --platform manylinux_2_28_x86_64   # the GPU machine's Python
    scp -r gpu-bundle gpu-host:cifar10-parallel/                              # next to the repository
    bash scripts/gpu_check.sh --bundle gpu-bundle                             # on the GPU machine

Step 06 needs Horovod built for the GPU machine's torch with NCCL: the check runs scripts/install_horovod.sh
from the bundle's source, which needs g++, cmake >= 3.13 (or `gpu_bundle.sh --with-cmake`) and the CUDA
toolkit (nvcc); without them 06 is skipped, in one line.

What each column means: *learned*: the last epoch's test accuracy >= --min-acc (chance: 0.10). *resume exact*:
a 2-epoch run stopped by `--stop-after 1` and continued by `--resume auto` ends with the same
weights-rank*.sha256 as an uninterrupted one (with deterministic cuDNN kernels; n/a: two uninterrupted runs
differ too). *img/s*: training loop of all processes, epochs 2..N. *loop/compute*: that over processes x the
model's pure compute rate (step 02's train_one_epoch on batches already on the GPU, same batch and precision).
*peak MB*: the CUDA allocator's peak on rank 0.
"""


def render(results=None):
    """docs/benchmark-gpu.md: the results of a run, or (None) the page before any GPU run."""
    lines = ["# GPU check: every step on NVIDIA GPUs", ""]
    if results is None:
        lines += ["**Status: pending: no GPU run yet.** No machine with an NVIDIA GPU has run the check. When one",
                  "does, `bash scripts/gpu_check.sh` overwrites this page with the device, driver, versions, command",
                  "and these rows, measured:", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for run in plan(1, ALL_STEPS):
            processes = "1" if run.launcher == "python" else "1 per GPU"
            note = {3: "all GPUs", 6: "if Horovod is there or can be built"}.get(run.step, "")
            lines.append(f"| {run.label} | {run.launcher} | {processes} | {run.amp} | {'pending | ' * 5}{note} |")
        lines += ["", "Step 02's targets, pending: full training loop >= 90% of the pure compute rate; data loader "
                  "alone >= 5x the training rate.", ""]
    else:
        v, failed = results["versions"], results["failed"]
        lines += [f"**Result: {'FAILED: ' + '; '.join(failed) if failed else 'every check that ran passed'}.** "
                  f"{results['date']}" + (" (CPU REHEARSAL: not GPU figures)" if results["rehearsal"] else ""), "",
                  f"> SYNTHETIC DATA (common.synthetic, {results['data']}): accuracies are not CIFAR-10 figures.", "",
                  f"- Device: {results['device']}; driver {results['driver']}",
                  f"- Versions: Python {v['python']}, torch {v['torch']} (CUDA {v['cuda']}, cuDNN {v['cudnn']}, "
                  f"NCCL {v['nccl']}; requirements.txt pins {pinned_torch()}), torchvision {v['torchvision']}, "
                  f"deepspeed {v['deepspeed']}, horovod {v['horovod']}, apex {v['apex']}",
                  f"- Python: {results['python']}",
                  f"- Command: `{results['command']}`",
                  f"- Settings: {results['settings']}", ""]
        if results["skipped"]:
            lines += ["Skipped:", ""] + [f"- {line}" for line in results["skipped"]] + [""]
        lines += ["## Steps", ""] + table(results["runs"]) + ["", "## Step 02's targets", ""]
        lines += [f"- {text}: {'pass' if ok else 'FAIL'}" for text, ok in results["targets"]] or ["- not measured"]
        lines += [""]
    fill = {"min_torch": ".".join(map(str, MIN_TORCH)), "pinned": pinned_torch()}
    return "\n".join(lines) + "\n" + HOW_TO.format(**fill)


def driver_version():
    status, output = quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=60) \
        if shutil.which("nvidia-smi") else (1, "")
    return output.strip().splitlines()[0] if status == 0 and output.strip() else "unknown (no nvidia-smi)"


def versions():
    import importlib.metadata

    import torch

    def of(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, nccl)) if nccl else None,
            **{name: of(name) for name in ("torchvision", "deepspeed", "horovod", "apex")}}


def run_checks(args, skipped):
    import torch

    from common.synthetic import write_synthetic_cifar10

    if args.rehearse_on_cpu:
        device, gpus, name = torch.device("cpu"), 1, "CPU (rehearsal)"
    elif not torch.cuda.is_available():
        stop(f"torch {torch.__version__} in {sys.executable} sees no CUDA GPU; nothing was run")
    else:
        gpus = torch.cuda.device_count()
        device, name = torch.device("cuda", 0), torch.cuda.get_device_name(0)
    say(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) from "
        f"{os.environ.get('GPU_CHECK_OUTER', sys.executable)} on {gpus} x {name}; requirements.txt pins torch "
        f"{pinned_torch()}, this check uses the one found here")
    kind = "easy" if args.easy else "textures"
    args.data, args.small_data = args.work_dir / "data" / "timed", args.work_dir / "data" / "resume"
    say(f"== data: {args.train_size} + {args.test_size} and {args.small_train_size} + {args.small_test_size} "
        f"generated images ({kind}) in {args.work_dir / 'data'}")
    write_synthetic_cifar10(str(args.data), args.train_size, args.test_size, kind=kind)
    write_synthetic_cifar10(str(args.small_data), args.small_train_size, args.small_test_size, kind=kind)
    check = Check(args, device, gpus)
    runs = plan(gpus, args.steps, args.amp)
    if 8 in args.steps and not any(r.step == 8 for r in plan(gpus, [8])):
        skipped.append("08: there is no 08_cifar10_*.py in this checkout")
    rows = [check.execute(run) for run in runs]
    rate = None
    if any(r["step"] == "02" and r["status"] == "ran" for r in rows):
        say("== step 02's data loader alone")
        rate = check.loader_rate()
    found = targets(rows, rate)
    failed = ([f"{r['label']} --amp {r['amp']}: {r['reason']}" for r in rows if r["status"] == "failed"]
              + [f"{r['label']} --amp {r['amp']} did not learn" for r in rows
                 if r["status"] == "ran" and not r["learned"]]
              + [f"{r['label']} --amp {r['amp']}: resume {r['resume']}" for r in rows if r["resume_ok"] is False]
              + [f"target missed: {text}" for text, ok in found if not ok])
    skipped += [f"{r['label']} --amp {r['amp']}: {r['reason']}" for r in rows if r["status"] == "skipped"]
    if not any(r["status"] == "ran" for r in rows):
        failed.append("no step could run")
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "rehearsal": args.rehearse_on_cpu,
        "device": f"{gpus} x {name}", "driver": driver_version() if device.type == "cuda" else "n/a",
        "versions": versions(), "python": f"{os.environ.get('GPU_CHECK_OUTER', sys.executable)} (its packages, plus "
        f"what the check added in {args.work_dir / 'env'})",
        "command": os.environ.get("GPU_CHECK_COMMAND") or shlex.join(["python", "scripts/gpu_check.py", *args.argv]),
        "data": f"{kind}, {args.train_size} train / {args.test_size} test images; resume runs "
                f"{args.small_train_size} / {args.small_test_size}",
        "settings": f"--arch {args.arch}, --batch-size {args.batch_size} per process, --epochs {args.epochs} "
                    f"(resume runs: 2, --stop-after 1), --workers {args.workers}, --channels-last (default), "
                    f"--min-acc {args.min_acc}, {check.cores} CPU cores",
        "skipped": skipped, "runs": rows, "loader_images_per_sec": rate, "targets": found, "failed": failed}
    (args.work_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    say("\n".join(table(rows)))
    for text, ok in found:
        say(f"{text}: {'pass' if ok else 'FAIL'}")
    for line in skipped:
        say(f"skipped {line}")
    doc = args.doc or (None if args.rehearse_on_cpu else DOC)
    if doc:
        Path(doc).write_text(render(results))
        say(f"wrote {doc}")
    say("gpu_check: " + ("FAILED: " + "; ".join(failed) if failed else "every check that ran passed"))
    return 1 if failed else 0


# ----------------------------------------------------------------------------- command line
def probe():
    """For gpu_check.sh: can this Python run the check? One line; exit 0 if yes."""
    try:
        import torch
    except Exception as error:
        print(f"no torch ({type(error).__name__})")
        return 1
    if version_tuple(torch.__version__) < MIN_TORCH:
        print(f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}")
        return 1
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} " + ("is a CPU build" if torch.version.cuda is None
                                                else f"(CUDA {torch.version.cuda}) sees no GPU"))
        return 1
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s)")
    return 0


def amp_list(text):
    amps = [part.strip() for part in text.split(",") if part.strip()]
    if not amps or set(amps) - set(AMPS):
        raise argparse.ArgumentTypeError(f"precisions are {','.join(AMPS)}, got {text!r}")
    return amps


def step_list(text):
    try:
        steps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers like 02,04, got {text!r}") from None
    if not steps or set(steps) - set(ALL_STEPS):
        raise argparse.ArgumentTypeError(f"steps are 02-08, got {text!r}")
    return steps


def parse_args(argv):
    from common.cli import non_negative_int, positive_float, positive_int

    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_check.sh",
        description="Every step on this machine's NVIDIA GPUs: learns, resumes bit for bit, img/s, loop/compute, "
                    "peak memory; results in docs/benchmark-gpu.md. Details: the docstring of scripts/gpu_check.py.")
    parser.add_argument("--bundle", type=Path, help="folder written by scripts/gpu_bundle.sh to install what is "
                        "missing from, offline (default: ./gpu-bundle if it exists, else the package index)")
    parser.add_argument("--steps", type=step_list, default=ALL_STEPS, help="e.g. 02,04 (default: 02-08)")
    parser.add_argument("--amp", type=amp_list, default=AMPS,
                        help="only the runs in these precisions, e.g. fp16,off (default: fp16,bf16,off)")
    parser.add_argument("--arch", default="resnet18", choices=["resnet18", "cnn"], help="model (default resnet18)")
    parser.add_argument("--epochs", type=positive_int, default=3, help="epochs of the timed runs (default 3)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="per process (default 128)")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--train-size", type=positive_int, default=50000, help="timed runs' images (default 50000)")
    parser.add_argument("--test-size", type=positive_int, default=10000, help="(default 10000)")
    parser.add_argument("--small-train-size", type=positive_int, default=5000, help="resume runs' (default 5000)")
    parser.add_argument("--small-test-size", type=positive_int, default=1000, help="(default 1000)")
    parser.add_argument("--easy", action="store_true", help="easily learnt data (common.synthetic --easy)")
    parser.add_argument("--min-acc", type=positive_float, default=0.3,
                        help="test accuracy that counts as learned (default 0.3; chance is 0.1)")
    parser.add_argument("--compute-steps", type=positive_int, default=200,
                        help="steps of each pure compute timing (default 200)")
    parser.add_argument("--timeout", type=positive_int, default=1800, help="seconds per run (default 1800)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "bench" / "gpu-check",
                        help="data, the environment, every run (default bench/gpu-check)")
    parser.add_argument("--doc", type=Path, help=f"the report (default {DOC.relative_to(REPO)}; none in a rehearsal)")
    parser.add_argument("--no-horovod-build", action="store_true", help="do not build Horovod when it is missing")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands; needs no GPU")
    parser.add_argument("--gpus", type=positive_int, default=1, help="with --dry-run: GPUs to plan for (default 1)")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run the whole check on the CPU, hiding any GPU (to test the check; the figures mean "
                             "nothing and fp16 runs are skipped)")
    parser.add_argument("--bundle-list", action="store_true", help="print what gpu_bundle.sh downloads, and exit")
    parser.add_argument("--pending-doc", action="store_true", help=f"write {DOC.relative_to(REPO)} as before a run")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--in-env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = [a for a in argv if a != "--in-env"]
    args.work_dir = args.work_dir.resolve()
    if args.bundle is None and (REPO / "gpu-bundle").is_dir():
        args.bundle = REPO / "gpu-bundle"
    if args.bundle is not None:
        args.bundle = args.bundle.resolve()
        if not args.bundle.is_dir():
            parser.error(f"--bundle {args.bundle}: no such folder (make it with scripts/gpu_bundle.sh)")
    return args


def dry_run(args):
    runs = plan(args.gpus, args.steps, args.amp)
    say(f"gpu_check --dry-run: {len(runs)} configurations for {args.gpus} GPU(s); each: a timed run, then a resume "
        "check (uninterrupted, --stop-after 1, --resume auto)")
    data, small, out = Path("DATA"), Path("SMALL_DATA"), Path("OUT")
    for run in runs:
        say(f"{run.label} --amp {run.amp}:")
        say(f"  {shown(command(run, data, out / run.slug / 'timed', args.epochs, args))}")
        for more in ([], ["--stop-after", "1"], ["--resume", "auto"]):
            name = "resumed" if more else "reference"
            say(f"  {shown(command(run, small, out / run.slug / name, 2, args, *more))}")
    if 8 in args.steps and not any(r.step == 8 for r in plan(args.gpus, [8])):
        say("08: no 08_cifar10_*.py in this checkout: skipped")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--probe" in argv:
        return probe()
    args = parse_args(argv)
    if args.bundle_list:
        for kind, name, version in bundle_list():
            print(kind, f"{name}=={version}")
        return 0
    if args.pending_doc:
        (args.doc or DOC).write_text(render(None))
        return 0
    if args.dry_run:
        return dry_run(args)
    if not args.in_env:
        if not args.rehearse_on_cpu:  # (gpu_check.sh has asked already; this is for a direct start)
            answer = io.StringIO()
            with contextlib.redirect_stdout(answer):
                usable = probe() == 0
            if not usable:
                stop(f"no CUDA GPU usable by {sys.executable}: {answer.getvalue().strip()}; nothing was run")
        os.environ.setdefault("GPU_CHECK_OUTER", sys.executable)
        py, skipped = prepare(args)
        os.environ["GPU_CHECK_SKIPPED"] = json.dumps(skipped)
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *argv, "--in-env"])
    return run_checks(args, json.loads(os.environ.get("GPU_CHECK_SKIPPED", "[]")))


if __name__ == "__main__":
    sys.exit(main())
