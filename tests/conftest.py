"""Fixtures: a small synthetic CIFAR-10 in the real on-disk format (see helpers.py)."""
import importlib.util
import json
import os
import re
import signal
from pathlib import Path

import pytest

from helpers import (CURVE_RECIPE, CURVE_STEPS, DDP_ARGS, EPOCHS, EXIT_GRACE, HOROVOD_ARGS, REPO,
                     SMOKE, TEST_SIZE, TRAIN_SIZE, Output, launch_command, metrics, once,
                     readme_command, shell, start, synthetic)

# Every process a test starts takes the harness's speed-up (tests/harness/sitecustomize.py: how
# long a process takes, never what it computes).
HARNESS = str(Path(__file__).parent / "harness")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HARNESS, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory):
    """A synthetic CIFAR-10 in the real format, written by the documented command's code."""
    return once(tmp_path_factory, "synthetic",
                lambda folder: synthetic(folder, "--easy", "--train-size", TRAIN_SIZE,
                                         "--test-size", TEST_SIZE))


@pytest.fixture(scope="session")
def data(cifar_dir):
    """The arguments every test run shares: the synthetic data and the small, fast setup."""
    return ["--data-dir", cifar_dir, *SMOKE]



@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """320 training and 61 test images: a quarter of `data`, for bf16 runs that must learn a little
    (the CPU emulates bf16, about 5 times slower than fp32 here): the small cnn at batch 8 falls
    below chance's loss in one epoch."""
    def make(folder):
        return ["--data-dir",
                synthetic(folder, "--easy", "--train-size", "320", "--test-size", "61"), *SMOKE]
    return once(tmp_path_factory, "small", make)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """8 training and 8 test images, for runs that need a few optimizer steps, not learning: bf16
    ones above all, which this CPU emulates (ResNet-18: about 1 image/s)."""
    def make(folder):
        return ["--data-dir", synthetic(folder, "--easy", "--train-size", "8", "--test-size", "8")]
    return once(tmp_path_factory, "tiny", make)


# Uninterrupted runs that several test files read, each started by its step's command in the README
# (with flags appended), so that tests/test_readme.py holds the README's commands to them (02's and
# 03's: their learning-curve runs below). 04 and 08 also trace 3 optimizer steps
# (tests/test_profile.py); that the trace leaves the training alone, 04's restart test holds (its
# bits, untraced).
PROFILE = ["--profile", "3"]
@pytest.fixture(scope="session")
def run01(tmp_path_factory, data):
    """Step 01, 2 epochs, batch 64, fp32: the reference for resume and for DDP with 2 x 32."""
    def make(out):
        shell(readme_command(1), *data, *EPOCHS, "--batch-size", "64", "--amp", "off",
              "--out-dir", out)
        return out
    return once(tmp_path_factory, "run01", make)


def two_processes(tmp_path_factory, name, number, *args):
    """(out-dir, output) of step `number`'s README command with 2 processes and `args`."""
    def make(out):
        return out, shell(readme_command(number), *args, "--out-dir", out).output
    return once(tmp_path_factory, name, make)


@pytest.fixture(scope="session")
def run04(tmp_path_factory, data):
    """Step 04 under torchrun, 2 processes x 32 images, fp32 (--amp off) to compare with step 01."""
    return two_processes(tmp_path_factory, "run04", 4, *data, *EPOCHS, *DDP_ARGS, *PROFILE)


@pytest.fixture(scope="session")
def run06(tmp_path_factory, cifar_dir):
    """Step 06 under horovodrun (the classic command), 2 processes x 16 images x 2 accumulated
    passes, fp32."""
    return two_processes(tmp_path_factory, "run06", 6, "--data-dir", cifar_dir, *SMOKE,
                         *HOROVOD_ARGS)


@pytest.fixture(scope="session")
def run08(tmp_path_factory, data):
    """Step 08 under torchrun, 2 processes x 32 images, fp32."""
    return two_processes(tmp_path_factory, "run08", 8, *data, *EPOCHS, *DDP_ARGS, *PROFILE)


@pytest.fixture(scope="session")
def zero3(data, tmp_path_factory):
    """ZeRO-3 in fp32, 2 processes x 8 images (80 steps per epoch), 2 epochs, stopped part-way
    through epoch 2 by a SIGTERM to the deepspeed launcher: the engine folders of epoch 1 and of the
    part-way epoch 2 (ds_checkpoints/epoch0001-stepNNNNNN). DeepSpeed keeps weights under 1e5
    elements whole on every rank (stage3_param_persistence_threshold), which is all of the small
    model's: the config sets 0. Also tests/test_no_shared_disk.py's engine checkpoint."""
    def make(out):
        config = json.loads((REPO / "ds_config.json").read_text())
        config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
        (out / "zero3.json").write_text(json.dumps(config))
        launcher, *rest = launch_command("deepspeed", 2, 5)
        job = start([launcher, "-q", *rest, *data, "--epochs", "2", "--batch-size", "8", "--amp",
                     "off", "--deepspeed_config", out / "zero3.json", "--out-dir", out],
                    DS_ACCELERATOR="cpu")
        output = Output(job)
        output.until(r"^epoch +1/2  train_loss", timeout=300)
        job.send_signal(signal.SIGTERM)
        output.ends_within("stopped after step", EXIT_GRACE, timeout=300)
        output.thread.join(10)
        return out, output.text
    return once(tmp_path_factory, "zero3", make)


# The learning-curve runs (tests/test_learning_curves.py): every step's README command with one
# recipe, on data that needs learning. They are also what tests/test_steps_01_04.py reads of 02 and
# 03, and the README runs of 02, 03, 07 (and of 05 where the learning-curve test of 05 runs too:
# tests/test_readme.py).
@pytest.fixture(scope="session")
def textures(tmp_path_factory):
    return once(tmp_path_factory, "textures",
                lambda folder: synthetic(folder, "--train-size", "3000", "--test-size", "500"))


@pytest.fixture(scope="session")
def curves(textures, tmp_path_factory):
    """curves(step) -> (its out-dir, its test accuracy (%) per epoch, its output): the step's README
    command with the recipe, made when a test first asks for it."""
    def make(step, out):
        proc = shell(readme_command(step), "--data-dir", textures, *CURVE_RECIPE,
                     *CURVE_STEPS[step], "--out-dir", out, DS_ACCELERATOR="cpu")
        accuracy = [round(100 * row["test_acc"], 1) for row in metrics(out)]
        # the docs' table: pytest -s -n 0 tests/test_learning_curves.py
        print(f"step {step:02d}: test accuracy per epoch {accuracy}")
        return out, accuracy, proc.output
    return lambda step: once(tmp_path_factory, f"curve{step:02d}", lambda out: make(step, out))


@pytest.fixture(autouse=True)
def default_stop_signals():
    """A test that runs a step's main() in this process leaves SIGTERM/SIGUSR1 caught and blocked
    (common/preempt.py), which every process started later would inherit: undo it after each
    test."""
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGUSR1))
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)



# The quick tier, for the edit-test loop (`pytest -m "not slow"`, README): the tests that run in
# this process or start a short process, and one launch of every step through its README command
# (tests/test_readme.py). Every other test that trains through a launcher, or waits on one, is
# marked slow here: whole files, then single tests.
SLOW_FILES = {"test_05_deepspeed", "test_06_horovod", "test_07_apex", "test_08_fsdp",
              "test_debugging", "test_default_model", "test_fault_tolerance",
              "test_learning_curves", "test_no_shared_disk", "test_profile", "test_slurm",
              "test_steps_01_04"}
SLOW_TESTS = {
    "test_a_stop_signal_saves_where_it_stopped_and_resumes_exactly",
    "test_a_04_checkpoint_of_other_batch_arithmetic_continues_in_01_by_progress",
    "test_sigkill_during_saves_never_leaves_a_broken_checkpoint",
    "test_two_machines_downloading_into_one_shared_folder_both_succeed",
    "test_the_quick_start_main_job_runs_as_written",
    "test_a_failure_is_one_line_at_the_end_under_every_launcher",
    "test_runtime_errors_distributed_steps",
    "test_a_fresh_run_into_another_runs_folder_is_refused_and_loses_nothing",
    "test_a_bad_argument_under_a_launcher_is_said_once",
    "test_a_rehearsal_on_the_cpu_runs_the_whole_check",
    "test_a_rehearsal_whose_run_fails_with_an_error_line_fails_the_check",
    "test_a_copy_of_04_learns_the_users_data_from_every_image",
    "test_a_copy_stopped_and_resumed_ends_where_an_uninterrupted_run_does",
    "test_a_copy_of_05_trains_float_images_quietly_in_the_engines_precision",
    "test_a_copy_of_05s_engine_checkpoint_of_2_processes_is_refused_by_1_with_the_way_that_works",
    "test_a_copy_of_every_other_step_learns_and_ends_where_its_neighbour_does",
    "test_every_requested_run_ran_through_its_launcher_with_its_model",
    "test_json_has_every_figure_or_null",
    "test_markdown_table_has_one_row_per_run_naming_its_model",
    "test_peak_memory_is_the_process_own_not_its_parents",  # a child of a 1.5 GB process: seconds
}


# The files, heaviest first: seconds of a run in 2 pytest-xdist workers on the 2-core machine
# (pytest --durations=0, summed per file, tests/test_*.py; 2026-11-26, native bf16, less the
# launches taken out since). pytest.ini's `--dist loadfile` gives each worker whole files, the next
# one in this order as soon as it is near the end of its queue: heaviest first, so that the run does
# not end with one worker running a slow file alone while the other idles. A file missing here would
# come last.
WEIGHT = {"test_preemption": 142, "test_learning_curves": 120, "test_debugging": 98,
          "test_05_deepspeed": 70, "test_08_fsdp": 85, "test_bad_input": 85,
          "test_default_model": 81, "test_slurm": 75, "test_template": 200, "test_steps_01_04": 57,
          "test_fault_tolerance": 47, "test_07_apex": 47, "test_benchmark": 46, "test_exit": 41,
          "test_gpu_check": 31, "test_06_horovod": 29, "test_checkpoint": 10, "test_data": 8,
          "test_readme": 8, "test_gpu_paths": 3, "test_style": 1, "test_steps_in_line": 1,
          "test_profile": 1, "test_distributed_sampler": 1, "test_no_shared_disk": 55}


def pytest_collection_modifyitems(items):
    # stable: each file's own order stays
    items.sort(key=lambda item: -WEIGHT.get(item.path.stem, 0))
    for item in items:
        if item.path.stem in SLOW_FILES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    skip_horovod_tests_without_horovod(items)


def skip_horovod_tests_without_horovod(items):
    """Without Horovod (scripts/setup.sh finishes without it where it cannot be built) the tests of
    step 06 skip, with the way to build it; CI builds it (REQUIRE_HOROVOD=1), so there they run."""
    if importlib.util.find_spec("horovod") is not None:
        return
    skip = pytest.mark.skip(reason="Horovod is not built: "
                                   "PYTHON=.venv/bin/python bash scripts/install_horovod.sh")
    for item in items:
        if re.search(r"horovod|\b06\b|\[6\]|06_|run06", item.nodeid):
            item.add_marker(skip)
