"""scripts/benchmark.py in its tiny configuration (--quick) produces a well-formed table and JSON.

Timing figures are never asserted (two shared cores make them noise); the structure is, and so is
that every run the benchmark reports as run really ran through its launcher to the end, with the
model and batch it says. The runs: the cnn under every launcher (01 python, 04 torchrun, and 05
deepspeed, 06 horovodrun, 07 torch.distributed.launch where the script and library are here), and
resnet18 under step 01. Loader workers are 0: starting worker processes costs seconds on two cores.
"""
import importlib.util
import itertools
import json
import re

import pytest

from helpers import PYTHON, REPO, digests, metrics, run

LIBRARIES = {"05": "deepspeed", "06": "horovod", "07": None}  # 07 runs its torch path without NVIDIA Apex


def present(label):
    library = LIBRARIES.get(label)
    return any(REPO.glob(f"{label}_cifar10_*.py")) and (library is None or importlib.util.find_spec(library))


CNN_STEPS = ["01", "04"] + [label for label in LIBRARIES if present(label)]
RUNS = [("cnn", step) for step in CNN_STEPS] + [("resnet18", "01")]


def load_benchmark_module():
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run([PYTHON, "scripts/benchmark.py", "--quick", "--workers", "0", "--arch", "cnn:" + ",".join(CNN_STEPS),
                "--arch", "resnet18:01", "--out-dir", out], timeout=600)
    results = json.loads((out / "results.json").read_text())
    return out, results, (out / "results.md").read_text(), proc.output


def markdown_table(text, heading):
    """The rows (lists of cells) of the first table after `heading`, header row first."""
    lines = text.split(heading, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[first:])
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table
            if not re.fullmatch(r"\|(---\|)+", line)]


def test_every_requested_run_ran_through_its_launcher_with_its_model(bench):
    _, results, _, _ = bench
    rows = results["runs"]
    assert [(r["model"], r["step"]) for r in rows] == RUNS
    for row in rows:
        assert row["status"] == "ran", row
        logged = metrics(row["out_dir"])
        assert [r["epoch"] for r in logged] == [1] and all(r["synthetic"] for r in logged)
        assert sorted(digests(row["out_dir"])) == list(range(row["processes"])), "every rank finished"
        # What the script itself says it ran: the model, fp32, the global batch of 32 split over the processes.
        assert row["start_line"].startswith(f"{row['step']}_cifar10_") and f": {row['model']} on " in row["start_line"]
        assert "amp off" in row["start_line"], row["start_line"]
        assert (f"batch {32 // row['processes']} per process x {row['processes']} processes" if row["processes"] > 1
                else "batch 32 x") in row["start_line"], row["start_line"]
    launchers = {r["step"]: (r["launcher"], r["processes"]) for r in rows}
    assert launchers["01"] == ("python", 1) and launchers["04"] == ("torchrun", 2)
    assert {"05": "deepspeed", "06": "horovodrun", "07": "legacy"}.items() >= {
        step: launcher for step, (launcher, _) in launchers.items() if step in LIBRARIES}.items()


def test_json_has_every_figure_or_null(bench):
    _, results, _, _ = bench
    assert results["synthetic"] is True and "not CIFAR-10" in results["note"]
    assert results["hardware"]["cores"] >= 1 and results["versions"]["torch"]
    assert "scripts/benchmark.py --quick" in results["command"]
    assert results["settings"]["images"] == {"cnn": [128, 32], "resnet18": [128, 32]}
    for row in results["runs"]:
        for key in ("images_per_sec", "epoch_seconds", "peak_memory_mb", "wall_seconds", "train_share_of_wall"):
            assert row[key] > 0, (row["step"], key)
        assert row["other_work_cores"] >= 0 and 0 <= row["test_acc"] <= 1 and row["test_loss"] > 0
        assert row["speed_vs_01"] > 0 and (row["step"] != "01" or row["speed_vs_01"] == 1)


def test_markdown_table_has_one_row_per_run_naming_its_model(bench):
    _, results, text, _ = bench
    assert "SYNTHETIC DATA" in text and "Command: `python scripts/benchmark.py --quick" in text
    assert "Hardware:" in text and f"torch {results['versions']['torch']}" in text and "Load average" in text
    header, *rows = markdown_table(text, "## Steps")
    assert header[:5] == ["model", "step", "launcher", "processes x threads", "status"] and "img/s" in header
    assert [(row[0], row[1]) for row in rows] == RUNS
    for row, run_row in zip(rows, results["runs"]):
        assert len(row) == len(header) and row[4].startswith("ran")
        assert float(row[header.index("img/s")].replace(",", "")) == pytest.approx(run_row["images_per_sec"], abs=0.1)


def test_a_step_that_cannot_run_is_reported_as_not_run(tmp_path):
    """No script (or no library) gives a 'not run' row with a reason and no figures, not zeros."""
    benchmark = load_benchmark_module()
    missing = benchmark.Step(99, "torchrun", True, None)
    args = benchmark.parse_args(["--quick", "--out-dir", str(tmp_path)])
    row = benchmark.run_step(missing, "cnn", 2, args, {"cores": 2, "gpus": 0})
    assert row["status"] == "not run" and "no 99_cifar10_*.py" in row["reason"]
    (line,) = benchmark.step_table([row])[2:]
    assert line.startswith("| cnn | 99 | torchrun | 2 x 1 | not run: no 99_cifar10_") and line.count("—") == 7
    no_library = benchmark.Step(4, "torchrun", True, "surely_not_installed_library")
    assert "surely_not_installed_library is not installed" in benchmark.why_not_runnable(no_library)


def test_arch_names_a_model_and_its_steps(tmp_path):
    benchmark = load_benchmark_module()
    parse = benchmark.parse_args
    assert parse([]).arch == [("cnn", sorted(benchmark.STEPS)), ("resnet18", [1, 4, 5])]
    assert parse(["--arch", "resnet18", "--steps", "01,02"]).arch == [("resnet18", [1, 2])]
    assert parse(["--arch", "cnn:04", "--arch", "resnet18:1,5"]).arch == [("cnn", [4]), ("resnet18", [1, 5])]
    for wrong in (["--arch", "vgg"], ["--arch", "cnn:99"], ["--steps", "1,x"]):
        with pytest.raises(SystemExit):
            parse(wrong)


def test_gpu_flag_without_a_gpu_is_one_clear_line(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark_module().main(["--gpu", "--quick", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err and "Traceback" not in err
