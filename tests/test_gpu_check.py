"""The GPU check (scripts/gpu_check.sh, .py) and its bundle (gpu_bundle.sh), proven without a GPU.

* without a GPU (or with a CPU torch) it says so in one line and exits 2;
* --dry-run plans every step (02-08) through the README's launcher, on its default path, 02 also
  with --amp fp16 and bf16, and after each default run and 02's fp16 run the resume triple; then
  every path only a GPU runs (PATHS), those that need more GPUs than there are marked, those whose
  checkpoints hold a loss scale or O2's masters with their resume triple; docs/benchmark-gpu.md
  lists the same commands;
* a Python without what every step imports (torchvision, matplotlib, tqdm) is one line naming them,
  exit 2, before anything imports them;
* bf16 is skipped where the GPU would only emulate it; a missing library is a skip, a failing run a
  failure;
* --rehearse-on-cpu runs the whole machinery with step 02 on the CPU: the run learns, resumes bit
  for bit, is measured (and its DataLoader alone), and the report is written (in its work dir,
  never docs/), and continued from its results.json it runs only the rows that were not ok (and
  a resume check it had not finished, from the start; until then it says "so far"); a
  run that ends with `error:` fails it;
* gpu_bundle.sh downloads requirements.txt's pins without torch, DeepSpeed and Horovod as sources.
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import types
from importlib import util

import pytest
import torch

from helpers import PYTHON, REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

CHECK, BUNDLE = REPO / "scripts" / "gpu_check.sh", REPO / "scripts" / "gpu_bundle.sh"
STEPS = ["02", "02 --amp fp16", "02 --amp bf16", "03", "04", "05", "06", "07", "08"]
# The rehearsal: tiny data, the small model, fp32, no loader workers, 2 epochs.
REHEARSAL = ["--rehearse-on-cpu", "--train-size", "256", "--test-size", "64", "--epochs", "2"]
SMALL = ["--", "--arch", "cnn", "--amp", "off", "--workers", "0", "--batch-size", "32"]


def bash(script, *args, **env):
    proc = subprocess.run(["bash", str(script), *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120,
                          env={**os.environ, "PYTHON": PYTHON, **env})
    return proc.returncode, proc.stdout


def dry_run(*args):
    """{label: [commands]} of `gpu_check.sh --dry-run`: its gpu_check.py main() (which the shell
    script only execs) in this process, printing the plan (the shell script itself runs in the tests
    above and below)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = gpu_check.main(["--dry-run", *map(str, args)])
    output = printed.getvalue()
    assert status == 0, output
    runs = {}
    for line in output.splitlines()[1:]:
        if line.startswith("  "):
            runs[label].append(line.strip())  # noqa: F821  (bound by the run's line above it)
        else:
            label = line.rstrip(":")
            runs[label] = []
    return runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    for env, needles in [({}, ["gpu_check: no CUDA GPU: torch", "is a CPU build", "nothing was run",
                               "PYTHON="]),
                         ({"PYTHON": "/no/such/python"},
                          ["gpu_check: no /no/such/python here; nothing was run"])]:
        status, output = bash(CHECK, **env)
        lines = output.strip().splitlines()
        assert (status == 2 and len(lines) == 1
                and all(needle in lines[0] for needle in needles)), output


def test_the_dry_run_plans_every_step_on_its_default_path_through_its_launcher():
    runs = dry_run("--gpus", "2")
    paths = {label: runs.pop(label) for label in list(runs)[len(STEPS):]}
    assert list(runs) == STEPS and list(paths) == [label for label, *_ in gpu_check.PATHS]
    launchers = {"02": "python 02_cifar10_gpu.py", "03": "python 03_cifar10_dataparallel.py",
                 "04": "torchrun --nproc_per_node=2 --master_port=P 04_cifar10_ddp.py",
                 "05": "deepspeed --num_gpus 2 --master_port=P 05_cifar10_deepspeed.py",
                 "06": "horovodrun --gloo -np 2 -H localhost:2 python 06_cifar10_horovod.py",
                 "07": "torchrun --nproc_per_node=2 --master_port=P 07_cifar10_apex.py",
                 "08": "torchrun --nproc_per_node=2 --master_port=P 08_cifar10_fsdp.py"}
    for label, commands in runs.items():
        timed, launcher = (re.sub(r"--master_port=\d+", "--master_port=P", commands[0]),
                           launchers[label[:2]])
        assert timed.startswith(launcher + " "), timed
        flags = timed[len(launcher):].split()
        pairs = dict(zip(flags[::2], flags[1::2]))
        expected = {"--deepspeed_config": "ds_config.json"} if label == "05" else {}
        expected.update({"--amp": label.split()[-1]} if "--amp" in label else {})
        assert (set(pairs) == {"--data-dir", "--out-dir", "--epochs", *expected}
                and pairs["--epochs"] == "3")
        # the default path, or only --amp changed
        assert {k: pairs[k] for k in expected} == expected, commands[0]
        if label == "02 --amp bf16":  # no loss scale to resume (fp16's GradScaler state is checked)
            assert len(commands) == 1, commands
            continue
        assert_resume_triple(commands[1:])
    # flags after -- go to every run
    for label, commands in dry_run("--steps", "04", "--", "--arch", "cnn").items():
        assert len(commands) == (4 if label in ("04", *gpu_check.RESUMED_PATHS) else 1)
        assert all(" --arch cnn" in command for command in commands)


def test_a_resume_that_is_not_exact_fails_its_row():
    rows = [{"run": "04", "outcome": "ok", "why": None, "resume": "differs: other weights"},
            {"run": "05", "outcome": "failed", "why": "did not learn",
             "resume": "differs: the ranks"},
            {"run": "06", "outcome": "ok", "why": None, "resume": "equal"},
            {"run": "07", "outcome": "skipped", "why": "needs NVIDIA Apex", "resume": None}]
    assert gpu_check.failures(rows) == ["04: resume: differs: other weights",
                                        "05: did not learn; resume: differs: the ranks"]
    assert [r["outcome"] for r in rows] == ["failed", "failed", "ok", "skipped"]


def test_a_check_cut_short_says_so_until_every_resume_check_has_run(tmp_path):
    c = types.SimpleNamespace(work=tmp_path, name="a GPU", report=types.SimpleNamespace(
        command="bash scripts/gpu_check.sh", doc=tmp_path / "page.md", data="", loader={},
        loader_against=None, planned=["02", "03"]))
    row = {"run": "02", "outcome": "ok", "why": None, "resume": None, "resume_due": True}
    assert gpu_check.report([row], 2, c)["verdict"] == (
        "passed so far, 1 of 2 runs done, 1 resume check still due")
    row.update(resume="equal", resume_due=False)
    assert gpu_check.report([row], 1, c)["verdict"] == "passed"
    assert "**passed** (1 ok, 0 failed, 0 skipped" in (tmp_path / "page.md").read_text()


def assert_resume_triple(commands):
    """2 epochs into reference/; 1 into resumed/ and stop; continue it with --resume auto: the same
    command else."""
    reference, stopped, resumed = (re.sub(r"--master_port=\d+ ", "", c) for c in commands)
    assert " --epochs 2" in reference and "/reference " in reference and "--data-dir" in reference
    assert stopped == reference.replace("/reference ", "/resumed ") + " --stop-after 1"
    assert resumed == reference.replace("/reference ", "/resumed ") + " --resume auto"


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_path_only_a_gpu_runs_is_planned_as_two_epochs_on_the_small_data(gpus):
    """--sync-bn, --compile, --grad-accum, --spawn, the legacy launcher, ZeRO-3, fp16 on 04-08,
    --fp16-allreduce, the Apex paths, emulated bf16: one row each; with one GPU the rows that need
    two are marked (and skipped when run). Those whose checkpoints hold more than a default run's (a
    scaler's state, O2's masters) are resume-checked too."""
    runs = dry_run("--gpus", gpus)
    # checkpoints with more than a default run's: O2's masters, a scaler's state
    assert gpu_check.RESUMED_PATHS <= set(runs) and {
        "07 --amp-backend apex --opt-level O2", "08 --amp fp16"} <= gpu_check.RESUMED_PATHS
    for label, step, launcher, flags, needs in gpu_check.PATHS:
        command, *resume = runs[label]
        if label in gpu_check.RESUMED_PATHS:
            assert_resume_triple(resume)
            assert resume[0].endswith(" ".join(flags)), resume
        else:
            assert not resume, resume
        marked = f"  (needs {needs} GPUs)" * (needs > gpus)
        assert command.endswith(" ".join(flags).replace(" N", f" {gpus}") + marked), command
        assert (f" {step:02d}_cifar10_" in command and "/data/resume " in command
                and " --epochs 2" in command)
        starts = {"python": "python ", "legacy": "python -m torch.distributed.launch ",
                  "torchrun": "torchrun --nproc", "deepspeed": "deepspeed --num_gpus ",
                  "horovodrun": "horovodrun --gloo -np "}
        assert command.startswith(starts[launcher or gpu_check.LAUNCHER[step]]), command
    assert {label for label, *_ in gpu_check.PATHS} >= {
        "04 --sync-bn", "06 --sync-bn", "07 --amp-backend apex --sync-bn", "08 --sync-bn",
        "04 --compile", "04 --grad-accum 2", "04 --spawn N", "04 legacy launcher",
        "05 --zero-stage 3", "04 --amp fp16", "05 --amp fp16", "06 --amp fp16", "07 --amp fp16",
        "08 --amp fp16", "06 --fp16-allreduce", "02 --amp bf16 where emulated"}
    run = {r.label: r for r in gpu_check.plan([2, 4], gpus)}
    gpu = torch.device("cuda", 0)
    assert (gpu_check.skip_reason(run["04 --sync-bn"], gpu, gpus) is None) == (gpus == 2)
    assert "needs 2 GPUs" in (gpu_check.skip_reason(run["04 --sync-bn"], gpu, 1) or "")
    assert "this path is for a GPU" in gpu_check.skip_reason(run["04 --compile"],
                                                              torch.device("cpu"), gpus)


def test_a_python_without_what_every_step_imports_is_one_line_and_exit_2_before_importing_it(
        monkeypatch, capsys):
    code = ("import sys; sys.path.insert(0, 'scripts'); import gpu_check; "
            "print([m for m in ('torch', 'common') if m in sys.modules])")
    proc = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr  # the checks come first
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec",
                        lambda n, *a: None if n in ("torchvision", "tqdm") else real(n, *a))
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--dry-run"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    fix = (f"(fix: {sys.executable} -m pip install torchvision=={pins['torchvision']} "
           f"tqdm=={pins['tqdm']}; without a")
    assert (stopped.value.code == 2
            and line.startswith("gpu_check: torchvision, tqdm not installed in ") and fix in line)


def test_the_page_lists_the_planned_commands_and_says_whether_a_gpu_run_was_made():
    page = (REPO / "docs" / "benchmark-gpu.md").read_text()
    for label, commands in dry_run("--gpus", "9").items():  # N in the page
        command = re.sub(r" --master_port=\d+| --gloo| --(data-dir|out-dir|epochs) \S+", "",
                         commands[0])
        assert f"| {label} | `{command.replace('9', 'N')}`" in page, (label, command)
    results = page.split("## Results")[1]
    assert ("**Pending: no GPU run yet.**" in results) != ("| run | outcome |" in results), results
    assert "bash scripts/gpu_check.sh" in page and "bash scripts/gpu_bundle.sh" in page


def test_bf16_is_skipped_where_the_gpu_would_only_emulate_it_and_a_missing_library_is_a_skip(
        monkeypatch):
    run = {r.label: r for r in gpu_check.plan([2, 5, 6], 2)}
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    assert "Tesla T4 has no native bf16" in gpu_check.skip_reason(run["02 --amp bf16"], gpu)
    assert (gpu_check.skip_reason(run["02 --amp fp16"], gpu) is None
            and gpu_check.skip_reason(run["02"], gpu) is None)
    # Ampere on
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert gpu_check.skip_reason(run["02 --amp bf16"], gpu) is None
    assert "for a GPU" in gpu_check.skip_reason(run["02 --amp fp16"], torch.device("cpu"))
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec",
                        lambda n, *a: None if n in ("deepspeed", "horovod") else real(n, *a))
    assert "DeepSpeed is not installed" in gpu_check.skip_reason(run["05"], gpu)
    assert "Horovod is not installed" in gpu_check.skip_reason(run["06"], gpu)


def test_a_run_that_fails_fails_the_check_and_only_a_missing_library_is_a_skip():
    verdict = gpu_check.verdict
    assert verdict(0, "error: printed, but it exited 0") is None
    assert verdict(2, "02_cifar10_gpu: error: 12 training images are too few for a step") == (
        "failed", "12 training images are too few for a step (exit 2)")
    assert verdict(
        1, "[rank 1] error: local rank 1 has no GPU: start <= 1 per node\n...")[0] == "failed"
    assert verdict(1, "Traceback (most recent call last):\n"
                      "RuntimeError: CUDA error: out of memory\n") == (
        "failed", "RuntimeError: CUDA error: out of memory (exit 1)")
    assert verdict(-9, "epoch 1\nerror: timed out after 60 s\n")[0] == "failed"
    for line in ["[rank 0] error: DeepSpeed is not importable by /x/python "
                 "(No module named 'deepspeed'): ...",
                 "[1]<stderr>:[rank 1] error: Horovod is not importable by /x/python (...)",
                 "07_cifar10_apex: error: --amp-backend apex needs NVIDIA Apex "
                 "with apex.amp and a CUDA GPU, but ..."]:
        assert verdict(1, f"starting\n{line}\nstopping\n")[0] == "skipped", line


def test_a_rehearsal_on_the_cpu_runs_the_whole_check(tmp_path, capsys, monkeypatch):
    """Data, the timed run of step 02, its pure compute rate, the bit-exact resume check, the
    report; cut short in its resume check and continued."""
    page = (REPO / "docs" / "benchmark-gpu.md").read_text()
    argv = [*REHEARSAL, "--steps", "02", "--min-acc", "0.15", "--jobs", "2", "--work-dir",
            str(tmp_path)]
    # Cut short as a time limit once cut it on a GPU: in the resume check, after its reference run
    # and the stopped one, each of which left a checkpoint in its folder.
    real_check, resume = gpu_check.resume_check, gpu_check.RESUME

    def cut_short(run, c):
        monkeypatch.setattr(gpu_check, "RESUME", resume[:2])
        real_check(run, c)
        raise TimeoutError("the time limit")

    monkeypatch.setattr(gpu_check, "resume_check", cut_short)
    with pytest.raises(TimeoutError):
        gpu_check.main([*argv, *SMALL])
    cut = json.loads((tmp_path / "results.json").read_text())
    assert "so far" in cut["verdict"] and "1 resume check still due" in cut["verdict"], cut
    # Continued, from a results.json without the resume_due key (as written before it existed; a
    # row left out is run too): the timed run is kept, the verdict says the resume check is due
    # until it has run, and it runs from the start (what the cut runs wrote is not in its way).
    monkeypatch.setattr(gpu_check, "resume_check", real_check)
    monkeypatch.setattr(gpu_check, "RESUME", resume)
    del cut["runs"][1:], cut["runs"][0]["resume_due"]
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    verdicts, report = [], gpu_check.report
    monkeypatch.setattr(gpu_check, "report",
                        lambda *a: verdicts.append(report(*a)["verdict"]) or report(*a))
    assert gpu_check.main([*argv, "--continue-from", str(tmp_path / "cut.json"), *SMALL]) == 0
    assert verdicts[0] == "passed so far, 2 of 4 runs done, 1 resume check still due", verdicts
    results = json.loads((tmp_path / "results.json").read_text())
    ran, fp16, bf16, emulated = results["runs"]
    assert ran == {**cut["runs"][0], "resume": "equal", "resume_due": False}, ran
    assert "`, then `bash scripts/gpu_check.sh" in results["command"]
    assert "gpu_check: passed (1 ok, 0 failed, 3 skipped" in capsys.readouterr().out
    assert ran["outcome"] == "ok" and ran["test_acc"] >= 0.15 and ran["precision"] == "off", ran
    assert (ran["images_per_sec"] > 0 and ran["compute_images_per_sec"] > 0
            and ran["peak_memory_mb"] > 0), ran
    # its DataLoader alone, with 2 workers (and more where there are the cores)
    assert results["loader"]["2"] > 0 and "| --workers | loader img/s |" in (
        tmp_path / "benchmark-gpu.md").read_text(), results["loader"]
    assert (fp16["outcome"] == bf16["outcome"] == emulated["outcome"] == "skipped"
            and "for a GPU" in fp16["why"]), (fp16, bf16)
    assert (emulated["run"] == "02 --amp bf16 where emulated"
            and "this path is for a GPU" in emulated["why"]), emulated
    # the timed run, the cut reference and stopped runs, then the whole resume check: 2 epochs ==
    # 1 epoch, stop, --resume auto, 1 epoch
    log = (tmp_path / "runs" / "02-auto" / "log.txt").read_text()
    assert log.count("$ python 02_cifar10_gpu.py") == 6 and "resumed from epoch 1" in log, log
    report = (tmp_path / "benchmark-gpu.md").read_text()
    assert (report.startswith(page.split("## Results")[0])
            and "CPU (rehearsal: not GPU figures)" in report)
    row = r"^\| 02 \| ok \| off \| 0\.\d{3} \| [\d,]+ \| [\d,]+ \| \d+% \| [\d,]+ \| equal \|$"
    assert re.search(row, report, re.M), report
    # a rehearsal never writes the docs
    assert (REPO / "docs" / "benchmark-gpu.md").read_text() == page
    # The resume runs' fixed kernels: every python on their PYTHONPATH turns them on.
    # fixed kernels, though every step asks cuDNN to time them
    code = ("import torch; torch.backends.cudnn.benchmark = True; "
            "print(torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)")
    probe = subprocess.run([PYTHON, "-c", code],
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "deterministic")},
                           stdout=subprocess.PIPE, text=True)
    assert probe.stdout.strip() == "True False", probe


def test_a_rehearsal_whose_run_fails_with_an_error_line_fails_the_check(
        tmp_path, monkeypatch, capsys):
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    # A learning rate the steps refuse with their one error line.
    argv = [*REHEARSAL, "--steps", "02,05", "--work-dir", str(tmp_path), *SMALL, "--lr", "-1"]
    assert gpu_check.main(argv) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    runs, output = {r["run"]: r for r in results["runs"]}, capsys.readouterr().out
    run02, run05 = runs["02"], runs["05"]
    assert run02["outcome"] == "failed", run02
    assert "must be a positive finite number" in run02["why"], run02
    assert run05["outcome"] == "skipped" and "DeepSpeed is not installed" in run05["why"], run05
    assert "gpu_check: FAILED: 02: " in output and "must be a positive finite number" in output


@pytest.mark.parametrize("script", [CHECK, BUNDLE], ids=["gpu_check.sh", "gpu_bundle.sh"])
def test_the_scripts_parse_and_have_help(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    status, output = bash(script, "--help")
    assert status == 0 and "--dry-run" in output and "Traceback" not in output, output


def test_the_bundle_is_the_pins_without_torch_with_deepspeed_and_horovod_as_sources(tmp_path):
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements.txt").read_text(),
                           re.M))
    out = tmp_path / "bundle"
    status, output = bash(BUNDLE, "--dry-run", "--python", "3.11", "--out", out, "cmake==3.31.10")
    assert status == 0 and not out.exists(), output
    downloads = [line for line in output.splitlines() if " -m pip download --no-deps " in line]
    for name in ("torch", "torchvision", "pytest", "sympy"):
        assert not [line for line in downloads if line.endswith(f" {name}=={pins[name]}")], name
    wheel = ("--only-binary=:all: --python-version 3.11 --implementation cp "
             "--platform manylinux_2_28_x86_64")
    assert any(line.endswith(f" numpy=={pins['numpy']}") and wheel in line for line in downloads)
    assert f"--dest {out} --no-binary=:all: deepspeed=={pins['deepspeed']}" in output
    assert (f"--dest {out}/sdist --no-binary=:all: horovod==0.28.1" in output
            and "cmake==3.31.10" in output)
    status, output = bash(BUNDLE, "--bogus")
    assert status == 2 and output.strip() == "gpu_bundle: unknown option --bogus (see --help)"


def test_horovod_is_built_with_nccl_for_a_cuda_torch(tmp_path):
    """scripts/setup.sh's Horovod build (install_horovod.sh) for the torch it finds: NCCL with a
    CUDA build (a CPU-only Horovod cannot all-reduce GPU tensors), unless HOROVOD_GPU_OPERATIONS is
    set, even empty; CPU with a CPU build."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        '__version__ = "2.13.0+cu128"\nclass version:\n    cuda = "12.8"\n')
    script = REPO / "scripts" / "install_horovod.sh"
    for env, flavour in [({"PYTHONPATH": str(tmp_path)}, "a nccl build"), ({}, "a cpu build"),
                         ({"PYTHONPATH": str(tmp_path), "HOROVOD_GPU_OPERATIONS": ""},
                          "a cpu build")]:
        status, output = bash(script, "--dry-run", **env)
        assert status == 0 and f"in {PYTHON}: {flavour} of Horovod" in output, output
