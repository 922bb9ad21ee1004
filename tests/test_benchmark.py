"""scripts/benchmark.py in its tiny configuration (--quick) produces a well-formed table and JSON.

Timing figures are never asserted (two shared cores make them noise); the structure is, and so is
that every run the benchmark reports as run really ran through its launcher to the end, with the
model and batch it says. The runs: the cnn under 01 (python) and 04 (torchrun), and resnet18 under
step 01; the commands of 05 (deepspeed), 06 (horovodrun) and 07 (torch.distributed.launch) are
checked as planned, as they come from the same scripts/launchers.py that the suite's own runs of 05,
06 and 07 use.
Loader workers are 0: starting worker processes costs seconds on two cores.
"""
import importlib.util
import itertools
import json
import re

import pytest

from helpers import PYTHON, REPO, digests, metrics, once, run

CNN_STEPS = ["01", "04"]
RUNS = [("cnn", step) for step in CNN_STEPS] + [("resnet18", "01")]


def load_benchmark_module():
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    def make(out):
        proc = run([PYTHON, "scripts/benchmark.py", "--quick", "--workers", "0", "--arch",
                    "cnn:" + ",".join(CNN_STEPS), "--arch", "resnet18:01", "--out-dir", out],
                   timeout=600)
        results = json.loads((out / "results.json").read_text())
        return out, results, (out / "results.md").read_text(), proc.output
    return once(tmp_path_factory, "bench", make)


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
        assert sorted(digests(row["out_dir"])) == list(range(row["processes"])), (
            "every rank finished")
        # What the script itself says it ran: the model, fp32, the global batch of 32 split over the
        # processes.
        assert (row["start_line"].startswith(f"{row['step']}_cifar10_")
                and f": {row['model']} on " in row["start_line"])
        assert "amp off" in row["start_line"], row["start_line"]
        assert (f"batch {32 // row['processes']} per process x {row['processes']} processes"
                if row["processes"] > 1 else "batch 32 x") in row["start_line"], row["start_line"]
    launchers = {r["step"]: (r["launcher"], r["processes"]) for r in rows}
    assert launchers["01"] == ("python", 1) and launchers["04"] == ("torchrun", 2)


def test_json_has_every_figure_or_null(bench):
    _, results, _, _ = bench
    assert results["synthetic"] is True and "not CIFAR-10" in results["note"]
    assert results["hardware"]["cores"] >= 1 and results["versions"]["torch"]
    assert "scripts/benchmark.py --quick" in results["command"]
    assert results["settings"]["images"] == {"cnn": [64, 32], "resnet18": [64, 32]}
    assert results["settings"]["repeats"] == 1
    for row in results["runs"]:
        for key in ("images_per_sec", "epoch_seconds", "peak_memory_mb", "wall_seconds",
                    "train_share_of_wall"):
            assert row[key] > 0, (row["step"], key)
        assert row["other_work_cores"] >= 0
        # the figures are the run's own last epoch, as it logged them
        logged = metrics(row["out_dir"])[-1]
        assert (row["test_acc"], row["test_loss"]) == (logged["test_acc"], logged["test_loss"]), (
            row, logged)
    # One process (1 x all cores) and two (2 x half) of each model: the pure compute rate was
    # measured for both.
    measured = {(c["model"], c["processes"]) for c in results["compute_images_per_sec"]}
    assert {(r["model"], r["processes"]) for r in results["runs"]} == measured
    for row, run_row in zip(results["summary"], results["runs"]):
        assert row["runs"] == 1 and row["images_per_sec"] == run_row["images_per_sec"]
        assert row["images_per_sec_range"] == [run_row["images_per_sec"]] * 2
        assert row["compute_images_per_sec"] > 0 and row["loop_vs_compute"] > 0
        assert row["speed_vs_01"] > 0 and (row["step"] != "01" or row["speed_vs_01"] == 1)
        # 1 epoch of 32 test images: 80% is reached or not, and the seconds are the epoch's when it
        # is.
        assert row["seconds_to_target"] in (None, run_row["epoch_seconds"])


def test_markdown_table_has_one_row_per_run_naming_its_model(bench):
    _, results, text, _ = bench
    assert "SYNTHETIC DATA" in text and "Command: `python scripts/benchmark.py --quick" in text
    assert ("Hardware:" in text and f"torch {results['versions']['torch']}" in text
            and "Load average" in text)
    header, *rows = markdown_table(text, "## Steps")
    assert header[:5] == ["model", "step", "launcher", "processes x threads", "status"]
    assert {"img/s (median)", "img/s (range)", "loop / compute", "s to 80%",
            "peak MB per process"} <= set(header)
    assert [(row[0], row[1]) for row in rows] == RUNS
    for row, summary in zip(rows, results["summary"]):
        cell = dict(zip(header, row))
        assert len(row) == len(header) and cell["status"].startswith("ran") and cell["runs"] == "1"
        assert float(cell["img/s (median)"].replace(",", "")) == pytest.approx(
            summary["images_per_sec"], abs=0.1)
        assert cell["loop / compute"] == f"{100 * summary['loop_vs_compute']:.0f}%"


def test_a_step_that_cannot_run_is_reported_as_not_run(tmp_path):
    """No script (or no library) gives a 'not run' row with a reason and no figures, not zeros."""
    benchmark = load_benchmark_module()
    missing = benchmark.Step(99, "torchrun", True, None)
    args = benchmark.parse_args(["--quick", "--out-dir", str(tmp_path)])
    row = benchmark.run_step(missing, benchmark.Config("cnn", 99, 2, None), args,
                             {"cores": 2, "gpus": 0})
    assert row["status"] == "not run" and "no 99_cifar10_*.py" in row["reason"]
    (line,) = benchmark.step_table(benchmark.summarize([row], {}, 2))[2:]
    assert (line.startswith("| cnn | 99 | torchrun | 2 x 1 | not run: no 99_cifar10_")
            and line.count("—") == 9)
    no_library = benchmark.Step(4, "torchrun", True, "surely_not_installed_library")
    assert "surely_not_installed_library is not installed" in benchmark.why_not_runnable(no_library)


def test_arch_names_a_model_and_its_steps(tmp_path):
    benchmark = load_benchmark_module()
    parse = benchmark.parse_args
    assert benchmark.DEFAULT_ARCH.split() == ["cnn:01,04,05,06,07,08",
                                              "resnet18:01,04,05,05z1,05z3,08,08x4"]
    assert parse([]).arch == [("cnn", [(n, None, None, None) for n in (1, 4, 5, 6, 7, 8)]),
                              ("resnet18", [(1, None, None, None), (4, None, None, None),
                                            (5, None, None, None), (5, None, 1, None),
                                            (5, None, 3, None), (8, None, None, None),
                                            (8, 4, None, None)])]
    assert parse(["--arch", "resnet18", "--steps", "01,02"]).arch == [
        ("resnet18", [(1, None, None, None), (2, None, None, None)])]
    assert parse(["--arch", "cnn:04", "--arch", "resnet18:1,5z0,08x4ublocks"]).arch == [
        ("cnn", [(4, None, None, None)]),
        ("resnet18", [(1, None, None, None), (5, None, 0, None), (8, 4, None, "blocks")])]
    for wrong in (["--arch", "vgg"], ["--arch", "cnn:99"], ["--steps", "1,x"], ["--steps", "04z1"],
                  ["--steps", "01x2"], ["--steps", "05z4"], ["--steps", "08x0"],
                  ["--steps", "04ublocks"], ["--steps", "08urows"]):
        with pytest.raises(SystemExit):
            parse(wrong)
    # Three rounds of every configuration, in the same order each round; 01 always one process.
    order = benchmark.plan(parse(["--arch", "cnn:01,04", "--arch", "resnet18:08x4", "--out-dir",
                                  str(tmp_path)]))
    config = benchmark.Config
    one_round = [config("cnn", 1, 1, None), config("cnn", 4, 2, None),
                 config("resnet18", 8, 4, None)]
    assert order == [(repeat, c) for repeat in range(3) for c in one_round]


def test_the_summary_is_the_median_and_range_of_the_runs_and_busy_runs_write_no_docs(tmp_path):
    benchmark = load_benchmark_module()

    def fake_run(step, speed, others=0.0, processes=1, status="ran", to_target=True):
        return {"model": "cnn", "step": step, "launcher": "python", "processes": processes,
                "device": "cpu", "threads_per_process": 2 // processes, "status": status,
                "reason": None if status == "ran" else "x", "notes": [], "other_work_cores": others,
                "images_per_sec": speed, "epoch_seconds": 1000 / speed,
                "train_share_of_wall": 0.5, "peak_memory_mb": 500, "test_acc": 0.9,
                "seconds_to_target": 2000 / speed if to_target else None}

    runs = [fake_run("01", 100), fake_run("04", 300, processes=2), fake_run("01", 120, others=0.3),
            fake_run("04", 330, processes=2, to_target=False), fake_run("01", 90),
            fake_run("04", 270, processes=2, to_target=False)]
    one, two = benchmark.summarize(
        runs, {("cnn", 2, 1): [110, 130, 100], ("cnn", 1, 2): [80, 60, 70]}, 2)
    assert (one["runs"], one["images_per_sec"], one["images_per_sec_range"]) == (3, 100, [90, 120])
    assert (two["images_per_sec"], two["images_per_sec_range"], two["speed_vs_01"]) == (
        300, [270, 330], 3)
    assert (one["loop_vs_compute"] == pytest.approx(100 / 110)
            and two["loop_vs_compute"] == pytest.approx(300 / 140))
    assert one["busy"] and one["other_work_cores"] == 0.3 and not two["busy"]
    # Time to 80%: the median of the runs, a run that never got there counting as endless.
    assert one["seconds_to_target"] == 20 and two["seconds_to_target"] is None
    assert benchmark.summarize(runs[1:2] + runs[3:4], {}, 2)[0]["seconds_to_target"] is None
    assert benchmark.summarize(runs[1:2] * 2 + runs[3:4], {}, 2)[0]["seconds_to_target"] == (
        pytest.approx(2000 / 300))
    assert ("0.30 BUSY" in benchmark.step_table([one])[2]
            and "| not reached |" in benchmark.step_table([two])[2])
    with pytest.raises(benchmark.UserError,
                       match="1 of 6 runs and compute measurements shared the machine"):
        benchmark.refuse_busy_runs(runs, "docs/benchmark-cpu.md")
    quiet = [r for r in runs if r["other_work_cores"] <= 0.2]
    benchmark.refuse_busy_runs(quiet, "docs/benchmark-cpu.md", 3, [0.05])
    with pytest.raises(benchmark.UserError, match="compute measurements shared"):
        benchmark.refuse_busy_runs(quiet, "docs/benchmark-cpu.md", 3, [0.05, 0.4])
    # A row with a failed run: the row says so, and the docs are not written from it.
    failed = benchmark.summarize(quiet + [fake_run("01", 1, status="failed")], {}, 2)[0]
    assert (failed["status"] == "failed" and failed["runs"] == 2
            and "img/s (median)" not in benchmark.cells(failed))
    with pytest.raises(benchmark.UserError, match="cnn 01 x1: fewer than 3 runs ran"):
        benchmark.refuse_busy_runs(quiet + [fake_run("01", 1, status="failed")],
                                   "docs/benchmark-cpu.md", 3)
    with pytest.raises(SystemExit) as exit_info:  # the docs' tables take 3 runs per row
        benchmark.main(["--quick", "--markdown", str(tmp_path / "x.md"), "--out-dir",
                        str(tmp_path)])
    assert exit_info.value.code == 2 and not (tmp_path / "x.md").exists()


def test_a_configuration_reaches_its_script_once_with_its_flags(tmp_path):
    benchmark = load_benchmark_module()
    args = benchmark.parse_args(["--arch", "resnet18:05,05z2,05z3,08,08x2,08x4,08ustages",
                                 "--out-dir", str(tmp_path)])
    configs = [config for repeat, config in benchmark.plan(args) if repeat == 0]
    assert [(c.step, c.nproc, c.zero, c.units) for c in configs] == [
        (5, 2, None, None), (5, 2, 3, None), (8, 2, None, None), (8, 4, None, None),
        (8, 2, None, "stages")]
    ctx = {"data": {"resnet18": tmp_path}, "epochs": {"resnet18": 2}}
    command, _ = benchmark.command_of(benchmark.STEPS[5], configs[1], args, ctx, tmp_path, [])
    assert (command[command.index("--zero-stage") + 1] == "3"
            and command[command.index("--batch-size") + 1] == "64")
    command, _ = benchmark.command_of(benchmark.STEPS[8], configs[3], args, ctx, tmp_path, [])
    assert "--nproc_per_node=4" in command and command[command.index("--batch-size") + 1] == "32"
    # 08 with other units: its wrapper, the choice, then 08's own arguments
    command, stem = benchmark.command_of(benchmark.STEPS[8], configs[4], args, ctx, tmp_path, [])
    wrapper = command.index(str(benchmark.REPO / "scripts" / "fsdp_units.py"))
    assert command[wrapper + 1:wrapper + 3] == ["stages", "--data-dir"] and stem.startswith("08_")
    assert benchmark.label(configs[4]) == "08 units=stages"
    assert "--zero-stage" not in benchmark.command_of(benchmark.STEPS[5], configs[0], args, ctx,
                                                      tmp_path, [])[0]
    for number, launcher in [(5, "deepspeed --num_gpus 2 "), (6, "horovodrun --gloo -np 2 "),
                             (7, " -m torch.distributed.launch ")]:  # not run here
        command = " ".join(map(str, benchmark.command_of(benchmark.STEPS[number], configs[0], args,
                                                         ctx, tmp_path, [])[0]))
        assert launcher in command and f"0{number}_cifar10_" in command, command


def test_readme_gets_the_table_between_its_marks_and_keeps_the_rest(tmp_path):
    benchmark = load_benchmark_module()
    results = json.loads((REPO / "docs" / "benchmark-cpu.json").read_text())
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nbefore\n<!-- speed-table -->\nold table\n"
                      "<!-- /speed-table -->\n\nafter\n")
    benchmark.write_readme_table(results, readme, tmp_path / "docs" / "benchmark-cpu.md")
    head, block = readme.read_text().split("<!-- speed-table -->\n")
    block, tail = block.split("<!-- /speed-table -->")
    assert head == "# Title\n\nbefore\n" and tail == "\n\nafter\n" and "old table" not in block
    assert "\n".join(benchmark.step_table(results["summary"], benchmark.README_COLUMNS)) in block
    assert block.rstrip().endswith("[benchmark-cpu.md](docs/benchmark-cpu.md).")
    readme.write_text("<!-- /speed-table -->\n<!-- speed-table -->\n")
    with pytest.raises(benchmark.UserError,
                       match="no <!-- speed-table --> ... <!-- /speed-table --> block"):
        benchmark.write_readme_table(results, readme, None)


def test_the_cpu_table_is_one_quiet_run_and_the_readme_carries_no_figures():
    """docs/benchmark-cpu.md's table is one run of 3 per row on a quiet machine, written with the
    JSON beside it; the README links to it and copies no figure (a copy goes stale)."""
    benchmark = load_benchmark_module()
    docs = (REPO / "docs" / "benchmark-cpu.md").read_text()
    command = re.search(r"Command: `([^`]+)`", docs).group(1)
    assert "--markdown docs/benchmark-cpu.md" in command and "- Settings: 3 runs per row" in docs
    docs_header, *docs_rows = markdown_table(docs, "## Steps")
    assert docs_header == benchmark.COLUMNS and len(docs_rows) >= 13
    for docs_row in docs_rows:
        docs_cells = dict(zip(docs_header, docs_row))
        assert docs_cells["runs"] == "3" and float(docs_cells["others (max)"]) <= benchmark.BUSY
    recorded = json.loads((REPO / "docs" / "benchmark-cpu.json").read_text())
    assert recorded["command"] == command and len(recorded["runs"]) == 3 * len(docs_rows)
    assert "\n".join(benchmark.step_table(recorded["summary"])) in docs
    readme = (REPO / "README.md").read_text()
    assert "docs/benchmark-cpu.md" in readme and "img/s" not in readme


def test_gpu_flag_without_a_gpu_is_one_clear_line(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark_module().main(["--gpu", "--quick", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err and "Traceback" not in err


def test_peak_memory_is_the_process_own_not_its_parents():
    """ru_maxrss survives exec: a run started from a large parent (this benchmark after measuring
    ResNet-18, a notebook) would report the parent's peak. peak_memory_mb reads the process's own
    (VmHWM)."""
    ballast = b"x" * (1500 * 2**20)  # 1.5 GB written in this process, then a small child
    child = ("import torch; from common.metrics import peak_memory_mb as p; "
             "print(p(torch.device('cpu')))")
    proc = run([PYTHON, "-c", child])
    assert len(ballast) and float(proc.output.split()[-1]) < 1000, proc.output
