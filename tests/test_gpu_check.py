"""scripts/gpu_check.sh and scripts/gpu_bundle.sh without a GPU: what can be checked of them on the CPU.

* without a GPU the check says so in one line and exits 2; with a GPU but no CUDA torch, the same;
* both scripts parse (bash -n), their --help and --dry-run need neither a GPU nor the network;
* the plan holds every run the issue asks for, launched as the README launches each step;
* the bundle's list is requirements.txt without torch, and it downloads DeepSpeed and Horovod as sources;
* docs/benchmark-gpu.md says how to produce it, as the check itself writes it;
* --rehearse-on-cpu runs the whole check (environment, runs, resume check, measurements, report) on the
  CPU with step 02 and the small model: the machinery a GPU run relies on, in seconds.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers import PYTHON, REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

CHECK, BUNDLE = REPO / "scripts" / "gpu_check.sh", REPO / "scripts" / "gpu_bundle.sh"
HAS_GPU = shutil.which("nvidia-smi") is not None or bool(list(Path("/dev").glob("nvidia[0-9]*")))


def bash(script, *args, timeout=120, **env):
    proc = subprocess.run(["bash", str(script), *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": PYTHON, **env})
    return proc.returncode, proc.stdout


def assert_one_line(output, *needles):
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in output, output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_non_zero():
    status, output = bash(CHECK)
    assert status == 2
    assert_one_line(output, "gpu_check: no NVIDIA GPU", "nothing was run")


def test_a_gpu_without_a_cuda_torch_is_one_line_too(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA and a GPU")
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "GPU 0: NVIDIA Fake (UUID: GPU-0)"\n')
    fake.chmod(0o755)
    status, output = bash(CHECK, PATH=f"{tmp_path}:{os.environ['PATH']}")
    assert status == 2
    assert_one_line(output, "nvidia-smi lists 1 GPU(s)", f"{PYTHON}: torch", "CPU build", "PYTHON=/path/to/python")


@pytest.mark.parametrize("script", [CHECK, BUNDLE], ids=["gpu_check.sh", "gpu_bundle.sh"])
def test_scripts_parse_and_have_help(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    status, output = bash(script, "--help")
    assert status == 0 and "--dry-run" in output and "Traceback" not in output, output


def test_the_plan_has_every_run_of_the_issue_through_its_launcher():
    status, output = bash(CHECK, "--dry-run", "--gpus", "2")
    assert status == 0, output
    runs, label = {}, None
    for line in output.splitlines()[1:]:
        if line.startswith("  "):
            runs[label].append(line.strip())
        elif line.endswith(":"):
            label = line[:-1]
            runs[label] = []
    for amp in ("fp16", "bf16", "off"):
        assert f"02 --amp {amp}" in runs
    assert "03 DataParallel --amp fp16" in runs and "04 DDP nccl --amp fp16" in runs
    for zero in (2, 3):
        for amp in ("bf16", "fp16"):
            (timed, *_) = runs[f"05 ZeRO-{zero} --amp {amp}"]
            assert timed.startswith("deepspeed --num_gpus 2 --master_port=") and \
                "05_cifar10_deepspeed.py" in timed and "--deepspeed_config ds_config.json" in timed and \
                f"--zero-stage {zero}" in timed
    assert runs["04 DDP nccl --amp fp16"][0].startswith("torchrun --nproc_per_node=2 --master_port=")
    assert runs["06 Horovod --amp fp16"][0].startswith("horovodrun --gloo -np 2 -H localhost:2 python 06_")
    assert "--amp-backend auto" in runs["07 Apex/auto --amp fp16"][0]
    assert any(label.startswith("08 ") for label in runs) == bool(list(REPO.glob("08_cifar10_*.py")))
    for label, commands in runs.items():  # timed run, then uninterrupted / --stop-after 1 / --resume auto
        assert len(commands) == 4, (label, commands)
        assert commands[2].endswith(" --stop-after 1") and commands[3].endswith(" --resume auto")
        same = [re.sub(r"--master_port=\d+ ", "", c) for c in
                (commands[1], commands[2][:-len(" --stop-after 1")], commands[3][:-len(" --resume auto")])]
        assert same[0].replace("/reference", "/resumed") == same[1] == same[2], "the same run, stopped and resumed"


def test_08_runs_under_the_launcher_its_docstring_names(tmp_path):
    script = tmp_path / "08_cifar10_x.py"
    for usage, launcher in [("torchrun --nproc_per_node=4 08_cifar10_x.py", "torchrun"),
                            ("deepspeed --num_gpus 4 08_cifar10_x.py", "deepspeed"),
                            ("horovodrun -np 4 python 08_cifar10_x.py", "horovodrun"),
                            ("python -m torch.distributed.launch --nproc_per_node=4 08_cifar10_x.py", "legacy"),
                            ("python 08_cifar10_x.py --arch cnn", "python")]:
        script.write_text(f'"""Step 08.\n\n    {usage}\n"""\n')
        assert gpu_check.docstring_launcher(script) == launcher


def test_the_bundle_is_requirements_without_torch_with_deepspeed_and_horovod_sources(tmp_path):
    items = gpu_check.bundle_list()
    specs = {name.lower(): (kind, version) for kind, name, version in items}
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    assert "torch" not in specs and "pytest" not in specs
    assert specs["deepspeed"] == ("sdist", pins["deepspeed"]) and specs["horovod"] == ("sdist", "0.28.1")
    assert specs["torchvision"] == ("wheel", pins["torchvision"]) and specs["matplotlib"][0] == "wheel"
    out = tmp_path / "bundle"
    status, output = bash(BUNDLE, "--dry-run", "--python", "3.11,3.12", "--out", out)
    assert status == 0 and not out.exists(), output
    downloads = [line for line in output.splitlines() if " -m pip download " in line]
    assert all("--no-deps" in line and f"--dest {out}" in line for line in downloads)
    assert not [line for line in downloads if re.search(r" torch==", line)]
    assert f"--no-binary=:all: deepspeed=={pins['deepspeed']}" in output
    assert "--no-binary=:all: horovod==0.28.1" in output
    for version in ("3.11", "3.12"):
        assert f"--python-version {version} --implementation cp numpy=={pins['numpy']}" in output
    assert "cmake" not in output and "cmake==" in bash(BUNDLE, "--dry-run", "--with-cmake")[1]
    status, output = bash(BUNDLE, "--dry-run", "--skip", "numpy,Pillow")
    assert f"left out numpy=={pins['numpy']} (--skip)" in output and "left out pillow==" in output.lower()
    assert " numpy==" not in output.replace("left out numpy==", "") and "pillow==" not in output.replace(
        "left out pillow==", "")


def test_a_bad_bundle_option_is_one_line():
    status, output = bash(BUNDLE, "--bogus")
    assert status == 2
    assert_one_line(output, "unknown option --bogus")


def test_the_page_says_how_to_produce_it_as_the_check_writes_it():
    page = (REPO / "docs" / "benchmark-gpu.md").read_text()
    how_to = gpu_check.render(None).split("## How to produce it")[1]
    assert page.split("## How to produce it")[1] == how_to
    assert "bash scripts/gpu_check.sh" in how_to and "bash scripts/gpu_bundle.sh" in how_to
    assert "pending: no GPU run yet" in page or "Result:" in page


def test_a_rehearsal_on_the_cpu_runs_the_whole_check(tmp_path):
    """Environment, a skipped run (fp16 needs a GPU), a timed run, the bit-exact resume check, the in-process
    measurements and the report, with step 02 on the CPU."""
    doc = tmp_path / "report.md"
    status, output = bash(CHECK, "--rehearse-on-cpu", "--steps", "02", "--amp", "fp16,off", "--arch", "cnn", "--easy",
                          "--work-dir", tmp_path / "work", "--doc", doc, "--epochs", "2", "--batch-size", "32",
                          "--workers", "0", "--train-size", "256", "--test-size", "64", "--small-train-size", "128",
                          "--small-test-size", "32", "--compute-steps", "4", "--min-acc", "0.15", timeout=600)
    assert "Traceback" not in output, output
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    fp16, off = results["runs"]
    assert fp16["status"] == "skipped" and "needs a CUDA GPU" in fp16["reason"]
    assert off["status"] == "ran" and off["learned"] and off["resume"] == "yes", off
    assert off["images_per_sec"] > 0 and off["compute_images_per_sec"] > 0 and off["peak_memory_mb"] > 0
    assert results["loader_images_per_sec"] > 0 and len(results["targets"]) == 2
    report = doc.read_text()
    row = r"^\| 02 \| python \| 1 \| off \| yes \(0\.\d+\) \| yes \| [\d,]+ \| \d+% \| [\d,]+ \|"
    assert re.search(row, report, re.M), report
    assert "CPU REHEARSAL" in report and "02 --amp fp16: --amp fp16 needs a CUDA GPU" in report
    assert status == (1 if results["failed"] else 0), output
    # The environment sees the outer packages through a .pth file of its own, and nothing else was touched.
    assert (tmp_path / "work" / "env" / "gpu-check-outer-python").read_text() == str(Path(PYTHON))
    for prefix in {sys.prefix, sys.base_prefix}:
        purelib = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})["purelib"]
        assert not list(Path(purelib).glob("gpu_check_*.pth")), purelib
