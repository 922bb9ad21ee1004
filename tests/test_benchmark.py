"""scripts/benchmark.py in its tiny configuration (--quick) produces a well-formed table, JSON and chart.

Timing figures are never asserted (two shared cores make them noise); the structure is, and so is
that every step the benchmark reports as run really ran through its launcher to the end. The steps:
01, 02 and 04 always, plus every later step whose script is in the checkout and whose library is
installed. Loader workers are 0: starting worker processes costs seconds on two cores.
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


STEPS = ["01", "02", "04"] + [label for label in LIBRARIES if present(label)]


def load_benchmark_module():
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run([PYTHON, "scripts/benchmark.py", "--quick", "--workers", "0", "--steps", ",".join(STEPS),
                "--out-dir", out], timeout=900)
    results = json.loads((out / "results.json").read_text())
    return out, results, (out / "results.md").read_text(), proc.output


def step_rows(results):
    return [r for r in results["runs"] if not r["name"].startswith("02-knob")]


def markdown_table(text, heading):
    """The rows (lists of cells) of the first table after `heading`, header row first."""
    lines = text.split(heading, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[first:])
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table
            if not re.fullmatch(r"\|(---\|)+", line)]


def test_every_requested_step_ran_through_its_launcher(bench):
    out, results, _, _ = bench
    rows = step_rows(results)
    assert [r["step"] for r in rows] == STEPS
    for row in rows:
        assert row["status"] == "ran", row
        assert [r["epoch"] for r in metrics(row["out_dir"])] == [1]
        assert all(r["synthetic"] for r in metrics(row["out_dir"]))
        assert sorted(digests(row["out_dir"])) == list(range(row["processes"])), "every rank finished"
    launchers = {r["step"]: (r["launcher"], r["processes"]) for r in rows}
    assert launchers["01"] == ("python", 1) and launchers["04"] == ("torchrun", 2)


def test_json_has_every_figure_or_null(bench):
    _, results, _, _ = bench
    assert results["synthetic"] is True and "not CIFAR-10" in results["note"]
    assert results["hardware"]["cores"] >= 1 and results["versions"]["torch"]
    assert "scripts/benchmark.py --quick" in results["command"]
    for row in step_rows(results):
        for key in ("images_per_sec", "epoch_seconds", "compute_images_per_sec", "loop_vs_compute",
                    "peak_memory_mb", "wall_seconds"):
            assert row[key] > 0, (row["name"], key)
        assert 0 <= row["test_acc"] <= 1 and row["test_loss"] > 0
    assert results["pipeline"]["compute_images_per_sec"] > 0 and results["pipeline"]["loader_images_per_sec"] > 0
    knobs = {k["knob"] for k in results["knobs"]}
    assert {"channels_last", "autocast", "no .item() per step", "loader workers", "persistent workers",
            "pinned memory + non_blocking", "torch.compile"} <= knobs
    for knob in results["knobs"]:  # a knob that was not measured says why and has no value, never a 0
        assert (knob["ratio"] is None) == (knob["on_value"] is None or knob["off_value"] is None)
        assert knob["ratio"] is not None or knob["note"], knob


def test_markdown_table_has_one_row_per_step(bench):
    _, results, text, _ = bench
    assert "SYNTHETIC DATA" in text and "Command: `python scripts/benchmark.py --quick" in text
    assert "Hardware:" in text and f"torch {results['versions']['torch']}" in text
    header, *rows = markdown_table(text, "## Steps")
    assert header[:4] == ["step", "launcher", "processes x threads", "status"] and "img/s" in header
    assert [row[0] for row in rows] == STEPS
    for row, run_row in zip(rows, step_rows(results)):
        assert len(row) == len(header) and row[3].startswith("ran")
        assert float(row[header.index("img/s")].replace(",", "")) == pytest.approx(run_row["images_per_sec"], abs=1)
    header, *knob_rows = markdown_table(text, "## Speed knobs")
    assert header[0] == "knob" and len(knob_rows) == len(results["knobs"])


def test_chart_is_a_real_png(bench):
    out = bench[0]
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width >= 800 and height >= 300


def test_a_step_that_cannot_run_is_reported_as_not_run(tmp_path):
    """No script (or no library) gives a 'not run' row with a reason and no figures, not zeros."""
    benchmark = load_benchmark_module()
    missing = benchmark.Step(8, "torchrun", True, launcher_bin="torchrun")
    args = benchmark.parse_args(["--quick", "--out-dir", str(tmp_path)])
    row = benchmark.run_step(missing, 2, args, {"cores": 2, "gpus": 0})
    assert row["status"] == "not run" and "no 08_cifar10_*.py" in row["reason"]
    (line,) = [line for line in benchmark.step_table([row]) if line.startswith("| 08")]
    assert "not run: no 08_cifar10_" in line and "| 0 |" not in line and line.count("—") == 10
    no_library = benchmark.Step(4, "torchrun", True, library="surely_not_installed_library")
    assert "surely_not_installed_library is not installed" in benchmark.why_not_runnable(no_library)


def test_gpu_flag_without_a_gpu_is_one_clear_line(capsys):
    benchmark = load_benchmark_module()
    if benchmark.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--gpu", "--quick"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err and "Traceback" not in err
