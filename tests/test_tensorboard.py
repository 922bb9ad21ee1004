"""Every run in TensorBoard: rank 0 writes the rows of metrics.jsonl as event files into --out-dir,
read back here by TensorBoard's own reader (tests/test_preemption.py holds a stopped and resumed
run's to its uninterrupted one's)."""
import argparse
import os
import shutil

import pytest

from common import data
from common.metrics import Log
from common.schedule import warmup_cosine
from helpers import PYTHON, assert_board_matches_metrics, board, metrics, run, script


@pytest.mark.parametrize("fixture", ["run01", "run04"])
def test_a_run_shows_in_tensorboard_as_in_metrics_jsonl(fixture, request):
    """01 alone and 04 on 2 processes: every epoch's scalars and kept losses, from one writer (rank
    1 writes none), and 04's slowest rank's seconds each epoch."""
    out = request.getfixturevalue(fixture)
    out = out[0] if isinstance(out, tuple) else out
    scalars = assert_board_matches_metrics(out)
    (events,) = out.glob("events.out.tfevents.*")
    # Under 100 bytes an event (docs/results.md): a 30-epoch run keeps its file small.
    assert events.stat().st_size < 100 * (sum(map(len, scalars.values())) + 10)
    rows = metrics(out)
    assert ("epoch/slowest_rank_seconds" in scalars) == (fixture == "run04")
    if fixture == "run04":
        assert [value for _, value in scalars["epoch/slowest_rank_seconds"]] == pytest.approx(
            [max(row["ranks"]["train_s"]) for row in rows], rel=1e-6)


def test_a_resumed_run_hides_what_it_replaces_and_keeps_every_steps_loss(run01, tmp_path):
    """run01 whose newest checkpoint is damaged: --resume auto goes back to epoch 1 and trains epoch
    2 again, keeping every step's loss (--loss-every 1). TensorBoard shows each epoch once (the
    first attempt's epoch 2 hidden), the steps' losses average to the epoch's loss (equal batches),
    and the learning rate is the schedule's at the epoch's last step."""
    out = tmp_path / "run01"
    shutil.copytree(run01, out)
    with open(out / "checkpoint-epoch0002.pt", "r+b") as f:
        f.truncate(100)
    run([PYTHON, script(1), "--resume", "auto", "--out-dir", out, "--loss-every", "1"])
    scalars = assert_board_matches_metrics(out)
    first, again = metrics(run01)[1], metrics(out)[1]
    assert len(scalars["epoch/test_loss"]) == 2 and again["epoch"] == 2
    steps = [loss for _, loss in again["loss_steps"]]
    assert len(steps) == again["steps"] == first["steps"] == 20
    assert sum(steps) / len(steps) == pytest.approx(again["train_loss"], rel=1e-6)
    schedule = warmup_cosine(2, again["steps"], 1)
    assert again["lr"] == pytest.approx(0.1 * schedule(2 * again["steps"] - 1), rel=1e-12)
    assert [row["lr"] for row in metrics(out)] == [row["lr"] for row in metrics(run01)]


def test_without_tensorboard_a_run_says_so_once_and_trains(tmp_path, tiny_data):
    """With the package missing (hidden here by one that fails to import), the run finishes with one
    line that says so; with --no-tensorboard, no events file is written and nothing is said."""
    hidden = tmp_path / "hidden" / "tensorboard"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    proc = run([PYTHON, script(1), *tiny_data, "--epochs", "2", "--batch-size", "4", "--arch",
                "cnn", "--out-dir", tmp_path / "out"],
               PYTHONPATH=os.pathsep.join([str(tmp_path / "hidden"), os.environ["PYTHONPATH"]]))
    notes = [line for line in proc.output.splitlines() if "no TensorBoard files" in line]
    assert len(notes) == 1 and "hidden by the test" in notes[0], proc.output
    assert len(metrics(tmp_path / "out")) == 2
    assert not list((tmp_path / "out").glob("events.out.tfevents.*"))
    args = argparse.Namespace(out_dir=str(tmp_path / "off"), tensorboard=False, epochs=1)
    log = Log("test", args, 0, data.Info(10, data.MEAN, data.STD, synthetic=True))
    assert log.board is None and not list((tmp_path / "off").glob("events.out.tfevents.*"))
    assert board(tmp_path / "off") == {}
