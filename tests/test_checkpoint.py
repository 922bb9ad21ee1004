"""The checkpoint format: crash-safe writes, safe loads, one clear error for anything foreign."""
import os
import signal
import subprocess
import sys
import time

from types import SimpleNamespace

import pytest
import torch

from common import checkpoint
from common.cli import UserError
from helpers import REPO, env, write_checkpoint

WRITER = """
import argparse, sys, torch
from common import checkpoint
big = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))  # 16 MB: long enough to kill a save
for epoch in range(1, 1000):
    args = argparse.Namespace(out_dir=sys.argv[1], arch="cnn")
    checkpoint.save(args, {"epoch": epoch}, {"step": "test", "global_step": epoch, "model": {"w": big + epoch}}, keep=1000)
    print(epoch, flush=True)
"""  # noqa: E501 (a script of its own: its lines as written)
# what WRITER's checkpoints hold, less epoch
BIG = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))


def test_sigkill_during_saves_never_leaves_a_broken_checkpoint(tmp_path):
    """Kill a process that is busy saving, at several moments:
    what is under a checkpoint name loads."""
    for delay in (0.0, 0.15, 0.4, 0.9):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, env=env(),
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # at least one complete checkpoint exists
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        names = checkpoint.list_checkpoints(str(tmp_path))
        assert names, "the first complete checkpoint must survive"
        for path in names:
            state = torch.load(path, weights_only=True)
            assert torch.equal(state["model"]["w"], BIG + state["epoch"]), (
                f"{path} holds other numbers")
        newest = torch.load(names[0], weights_only=True)
        assert newest["epoch"] == int(os.path.basename(names[0])[16:20])


def test_resume_auto_skips_a_damaged_newest_file(tmp_path, capsys):
    model = torch.nn.Linear(2, 2)
    for epoch in (1, 2):
        write_checkpoint(tmp_path, step="test", arch="cnn", epoch=epoch, global_step=epoch,
                        model_state=model.state_dict())
    with open(checkpoint.checkpoint_path(str(tmp_path), 2), "r+b") as f:
        f.truncate(100)  # e.g. a disk that filled up under a tool that did not write atomically
    args = SimpleNamespace(resume="auto", out_dir=str(tmp_path), arch="cnn")
    assert checkpoint.resume(checkpoint.find(args), model=model) == (1, 1, {})
    assert "skipping" in capsys.readouterr().err


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model = torch.nn.Linear(2, 2)
    for epoch in range(1, 6):
        write_checkpoint(tmp_path, step="test", arch="cnn", epoch=epoch, global_step=epoch,
                        model_state=model.state_dict(), keep=3)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "checkpoint-epoch0005.pt", "checkpoint-epoch0004.pt", "checkpoint-epoch0003.pt"]


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("content,message", [
    (b"not a checkpoint at all", r"not a checkpoint \(not a file written by torch.save\)"),
    (b"PK\x03\x04 then nothing", "not a readable checkpoint"),
    ({"model": {}}, "not a checkpoint of this collection"),
    (RunsCode(), "refusing to load"),
], ids=["garbage", "truncated-zip", "foreign", "code"])
def test_bad_checkpoints_are_refused_clearly(tmp_path, monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(UserError, match=message):
        checkpoint.load(str(path), "cnn")
    assert not (tmp_path / "pwned").exists(), "loading must never run code from the file"


def test_checkpoint_for_another_arch_names_the_fix(tmp_path):
    path = write_checkpoint(tmp_path, step="test", arch="resnet18", epoch=1, global_step=1,
                           model_state={})
    with pytest.raises(UserError, match="pass --arch resnet18"):
        checkpoint.load(path, "cnn")


def resumed(path, **objects):
    """checkpoint.resume of the file at `path`, as --resume PATH does it."""
    args = SimpleNamespace(resume=str(path), out_dir=os.path.dirname(path), arch="cnn")
    return checkpoint.resume(checkpoint.find(args), **objects)


def test_a_checkpoint_without_optimizer_state_says_momentum_starts_again(tmp_path, capsys):
    """05's engine folder converted (scripts/ds_to_pt.py) holds weights only, and 05 reads any .pt
    as weights only: a step that resumes such a file says that momentum starts from zero."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = write_checkpoint(tmp_path, step="05_cifar10_deepspeed", arch="cnn", epoch=1,
                           global_step=5, model_state=model.state_dict())
    resumed(path, model=model, optimizer=optimizer)
    assert ("written by 05_cifar10_deepspeed): weights only, momentum starts from zero"
            in capsys.readouterr().out)
    write_checkpoint(tmp_path, step="04_cifar10_ddp", arch="cnn", epoch=2, global_step=10,
                    model_state=model.state_dict(), optimizer=optimizer)
    resumed(checkpoint.checkpoint_path(str(tmp_path), 2), model=model, optimizer=optimizer)
    assert "momentum" not in capsys.readouterr().out


def test_resumed_optimizer_state_has_its_parameter_s_layout(tmp_path):
    """Checkpoints store tensors plainly; a channels_last model's momentum comes back channels_last,
    like its parameter (Apex's fused SGD combines them in memory order), and the resumed run still
    steps bit for bit alike."""
    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model, optimizer):
        images = torch.ones(2, 3, 5, 5).to(memory_format=torch.channels_last)
        model(images).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    path = write_checkpoint(tmp_path, step="04_cifar10_ddp", arch="cnn", epoch=1, global_step=1,
                           model_state=model.state_dict(), optimizer=optimizer)
    saved = torch.load(path, weights_only=True)["optimizer"]["state"][0]["momentum_buffer"]
    assert not saved.is_contiguous(memory_format=torch.channels_last), "saved plainly"
    again, its_optimizer = model_and_optimizer()
    resumed(path, model=again, optimizer=its_optimizer)
    weight = again.weight
    assert (its_optimizer.state[weight]["momentum_buffer"].stride() == weight.stride()
            != (27, 9, 3, 1))
    step(model, optimizer)
    step(again, its_optimizer)
    assert all(torch.equal(a, b)
               for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def fresh_schedule(epochs=10, steps_per_epoch=10):
    from common.schedule import warmup_cosine

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = warmup_cosine(epochs, steps_per_epoch, 1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def test_a_checkpoint_without_schedule_continues_the_schedule_at_its_step(tmp_path):
    """scripts/ds_to_pt.py's files carry no LambdaLR state: resuming one must not start the warm-up
    again."""
    model, optimizer, stepped = fresh_schedule()
    for _ in range(30):
        optimizer.step()
        stepped.step()
    path = write_checkpoint(tmp_path, step="05_cifar10_deepspeed", arch="cnn", epoch=3,
                           global_step=30, model_state=model.state_dict())
    model, optimizer, placed = fresh_schedule()
    assert resumed(path, model=model, optimizer=optimizer, scheduler=placed) == (3, 30, {})
    assert placed.get_last_lr() == pytest.approx(stepped.get_last_lr())
    optimizer.step()
    placed.step(), stepped.step()
    assert placed.get_last_lr() == pytest.approx(stepped.get_last_lr())


@pytest.mark.parametrize("saved_schedule", [True, False], ids=["with-schedule", "export"])
def test_other_batch_arithmetic_continues_the_schedule_by_progress(tmp_path, capsys,
                                                                    saved_schedule):
    """2 of 4 epochs done at 25 steps per epoch (global step 50) is half the run: in a run of 4
    epochs at 10 steps per epoch that is step 20 (not 50, which would be past its end: learning rate
    0, and the weights would never move again)."""
    model, optimizer, before = fresh_schedule(4, 25)
    for _ in range(50):
        optimizer.step()
        before.step()
    path = write_checkpoint(tmp_path, step="05_cifar10_deepspeed", arch="cnn", epoch=2,
                           global_step=50, model_state=model.state_dict(),
                           scheduler=before if saved_schedule else None,
                           metrics={"epoch": 2, "steps": 25})
    model, optimizer, placed = fresh_schedule(4, 10)
    assert resumed(path, model=model, optimizer=optimizer, scheduler=placed) == (2, 20, {})
    assert (placed.last_epoch == 20
            and placed.get_last_lr() == pytest.approx(before.get_last_lr()) != [0.0])
    assert ("ran 25 optimizer steps per epoch, this run 10: the learning-rate schedule continues "
            "by progress, at step 20 (epochs done: 2), not at the checkpoint's step 50"
            in capsys.readouterr().out)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_older_checkpoints(tmp_path,
                                                                               monkeypatch):
    model = torch.nn.Linear(2, 2)
    write_checkpoint(tmp_path, step="test", arch="cnn", epoch=1, global_step=1,
                    model_state=model.state_dict())

    def disk_full(obj, f, *args, **kwargs):  # what torch's zip writer raises when the disk fills up
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . "
                           "PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(UserError, match="cannot write checkpoint .*disk full.*"
                                        "previous checkpoints are untouched"):
        write_checkpoint(tmp_path, step="test", arch="cnn", epoch=2, global_step=2,
                        model_state=model.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-epoch0001.pt"], (
        "no partial file may be left behind")


def test_leftovers_of_a_killed_save_and_old_digests_are_removed_at_the_next_start(tmp_path):
    (tmp_path / "checkpoint-epoch0003.pt.tmp-12345").write_bytes(b"half a checkpoint")
    (tmp_path / "weights-rank3.sha256").write_text("from a run with 4 processes")
    (tmp_path / "notes.txt").write_text("not ours")
    checkpoint.make_out_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_a_plot_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    from common import data, metrics

    args = SimpleNamespace(out_dir=str(tmp_path), epochs=1, tensorboard=False)
    log = metrics.Log("test", args, 0, data.Info(num_classes=10))
    log.epoch({"epoch": 1, "train_loss": 1.0, "test_loss": 1.0, "test_acc": 0.5,
               "images_per_sec": 1, "epoch_seconds": 1})
    # savefig cannot replace a folder: an OSError, as on a full disk
    os.mkdir(tmp_path / metrics.PLOT)
    assert metrics.plot(str(tmp_path), "test") is None
    assert "warning: could not draw" in capsys.readouterr().err


def an_earlier_run(folder):
    """A folder as a finished run leaves it:
    checkpoints of epochs 4-6, step 05's engine folder, metrics."""
    folder.mkdir(exist_ok=True)
    for epoch in (4, 5, 6):
        (folder / f"checkpoint-epoch{epoch:04d}.pt").write_bytes(b"an earlier run")
    (folder / "ds_checkpoints").mkdir()
    (folder / "ds_checkpoints" / "latest").write_text("epoch0006")
    (folder / "metrics.jsonl").write_text('{"epoch": 6}\n')
    (folder / "notes.txt").write_text("not ours")
    return sorted(p.name for p in folder.iterdir())


def test_a_fresh_run_refuses_a_folder_holding_another_run(tmp_path):
    before = an_earlier_run(tmp_path / "out")
    with pytest.raises(UserError, match=r"already holds a run \(checkpoint-epoch0006.pt\): "
                                        r"continue it with --resume auto, write to another "
                                        r"--out-dir, or replace it with --overwrite"):
        checkpoint.make_out_dir(str(tmp_path / "out"))
    elsewhere = tmp_path / "checkpoint-epoch0001.pt"
    # the newest-3 rule would delete its new epochs
    with pytest.raises(UserError, match="would mix two runs"):
        checkpoint.make_out_dir(str(tmp_path / "out"), resume=str(elsewhere))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    checkpoint.make_out_dir(str(tmp_path / "out"), resume="auto")  # continuing it: its own folder
    checkpoint.make_out_dir(str(tmp_path / "out"),
                            resume=str(tmp_path / "out" / "checkpoint-epoch0006.pt"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


def test_overwrite_replaces_the_earlier_run_and_nothing_else(tmp_path, capsys):
    an_earlier_run(tmp_path)
    checkpoint.make_out_dir(str(tmp_path), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert "--overwrite: replacing the run in" in capsys.readouterr().out
    an_earlier_run(tmp_path / "again")
    with pytest.raises(UserError, match="--overwrite would delete --resume"):
        checkpoint.make_out_dir(str(tmp_path / "again"),
                                str(tmp_path / "again" / "checkpoint-epoch0005.pt"), True)


@pytest.mark.parametrize("resume", ["typo.pt", "ds_checkpoints/epoch0009", ""])
def test_a_resume_path_that_does_not_exist_stops_before_overwrite_deletes_anything(tmp_path,
                                                                                   resume):
    """--resume of a mistyped path (or an empty $VARIABLE) with --overwrite: the one line says there
    is no such file, before --overwrite has touched the run in --out-dir."""
    from common.cli import shared_parser

    before = an_earlier_run(tmp_path / "out")
    args = shared_parser("test", "test", {"cnn": None}).parse_args(
        ["--out-dir", str(tmp_path / "out"), "--resume", resume and str(tmp_path / "out" / resume),
         "--overwrite"])
    with pytest.raises(UserError, match="no such file"):
        checkpoint.settings(args).apply(args)
        checkpoint.resume(checkpoint.find(args))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


def test_resume_auto_never_starts_over_on_top_of_checkpoints_it_cannot_continue(tmp_path):
    model = torch.nn.Linear(2, 2)
    write_checkpoint(tmp_path, step="01_cifar10_cpu", arch="resnet18", epoch=1, global_step=1,
                    model_state=model.state_dict())
    with pytest.raises(UserError, match=r"no checkpoint in .* can be continued by this run "
                                        r"\(.*pass --arch resnet18"):
        args = SimpleNamespace(resume="auto", out_dir=str(tmp_path), arch="cnn")
        checkpoint.resume(checkpoint.find(args), model=model)



def test_parsing_reads_no_file_and_only_rank_0_reads_the_checkpoint(tmp_path, monkeypatch, capsys):
    """--resume: the run's settings come from its checkpoint, read by rank 0 alone once the
    processes can talk (checkpoint.settings); the others get them, or rank 0's error, by a broadcast
    that the step makes (on hosts without a shared disk they could not read the file) and apply
    them. Parsing reads nothing."""
    from common.cli import shared_parser

    parse = shared_parser("test", "test", {"resnet18": None, "cnn": None}).parse_args
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    # no error yet
    assert parse(["--resume", str(tmp_path / "garbage.pt")]).resume.endswith("garbage.pt")
    run = tmp_path / "run"
    run.mkdir()
    write_checkpoint(run, step="test", arch="cnn", epoch=1, global_step=5, model_state={},
                    args=parse(["--batch-size", "16", "--epochs", "7", "--arch", "cnn"]))
    args = parse(["--resume", "auto", "--out-dir", str(run), "--epochs", "9"])
    # the defaults, until settings are applied
    assert (args.batch_size, args.epochs, args.arch) == (128, 9, "resnet18")
    verdict = checkpoint.settings(args)  # rank 0
    verdict.apply(args)
    assert (args.batch_size, args.epochs, args.arch) == (16, 9, "cnn"), "typed settings win"
    assert ("note: --epochs 9, the checkpoint's run had 7: the learning-rate schedule is stretched "
            "to 9 epochs") in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")  # another rank, on a host where the folder does not exist
    other = parse(["--resume", "auto", "--out-dir", str(tmp_path / "not-here"), "--epochs", "9"])
    verdict.apply(other)  # what the broadcast brought it
    assert (other.batch_size, other.epochs, other.arch) == (16, 9, "cnn")
    assert not (tmp_path / "not-here").exists(), "only rank 0 prepares --out-dir"
    with pytest.raises(UserError, match="the error rank 0 met"):
        checkpoint.Settings(error="the error rank 0 met").apply(other)
    assert checkpoint.Settings().values == {}


def test_common_has_no_import_cycle():
    import ast
    import pathlib

    folder = pathlib.Path(checkpoint.__file__).parent
    imports = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module} if node.module else {alias.name for alias in node.names}
        imports[path.stem] = {name for name in names if (folder / f"{name}.py").exists()}

    def visit(module, path):
        assert module not in path, " -> ".join([*path, module])
        for name in imports[module]:
            visit(name, [*path, module])

    for module in imports:
        visit(module, [])


def test_ranks_that_resumed_another_state_or_cannot_see_the_folder_are_named_in_one_line():
    same = checkpoint.position((1, 47), {"w": torch.ones(2)})
    checkpoint.agree([same, same])
    other = checkpoint.position((0, 0), {"w": torch.zeros(2)})
    with pytest.raises(UserError, match=r"^after resume, rank\(s\) 1, 3 hold another state than "
                                        r"rank 0 \(rank 1: epoch 0, step 0; rank 0: epoch 1, "):
        checkpoint.agree([same, other, same, other])
    checkpoint.check_seen([True, True], "dcp/epoch0001", "DCP")
    with pytest.raises(UserError, match=r"^rank\(s\) 2 cannot see dcp/epoch0001, the DCP "):
        checkpoint.check_seen([True, True, False], "dcp/epoch0001", "DCP")


def test_08s_position_is_written_once_beside_its_shards_and_only_complete_folders_count(tmp_path):
    """save_position() of 08's state (rank 0's part of 08's save): dcp/epochNNNN made afresh with
    position.json, the random state back as tensors; a folder counts once DCP's .metadata is in it;
    the newest 3 complete ones stay, unfinished ones go, and a part-way one goes with the next
    save. 01-07 given such an --out-dir name the converter."""
    from common.cli import shared_parser

    parse = shared_parser("test", "test", {"cnn": None}).parse_args
    args = parse(["--out-dir", str(tmp_path), "--arch", "cnn", "--epochs", "7"])
    for epoch in range(1, 6):
        state = {"step": "08_cifar10_fsdp", "global_step": 3 * epoch}
        checkpoint.save_position(args, {"epoch": epoch}, state)
        if epoch != 3:  # 3: killed before its .metadata
            (tmp_path / "dcp" / f"epoch{epoch:04d}" / ".metadata").write_bytes(b"")
        assert (tmp_path / "dcp" / "epoch0003").is_dir() == (epoch == 3), "unfinished: removed"
    assert [os.path.basename(p) for p in checkpoint.own_folders(str(tmp_path / "dcp"))] == [
        "epoch0005", "epoch0004", "epoch0002"]
    position = checkpoint.own_header(str(tmp_path / "dcp" / "epoch0005"))
    assert (position["epoch"], position["global_step"], position["args"]["epochs"]) == (5, 15, 7)
    assert torch.equal(position["rng"]["torch"], checkpoint.rng_states()["torch"])
    for own, says in ((None, "python scripts/dcp_to_pt.py " + str(tmp_path / "dcp")),
                      (checkpoint.ENGINE_DIR, "python scripts/dcp_to_pt.py "),
                      (checkpoint.DCP_DIR, "")):
        again = parse(["--out-dir", str(tmp_path), "--resume", "auto"])
        verdict = checkpoint.settings(again, own=own)
        assert says in (verdict.error or "") and (verdict.error is None) == (own == "dcp"), verdict
    assert verdict.values["epochs"] == 7
    found = checkpoint.find(again, own=checkpoint.DCP_DIR)
    assert found["folder"] == str(tmp_path / "dcp" / "epoch0005") and found["epoch"] == 5
    # A part-way save goes with the next save, as a part-way .pt does.
    partial = checkpoint.save_position(args, {"epoch": 6, "partial": True, "steps": 2}, state)
    with open(os.path.join(partial, ".metadata"), "wb"):
        pass
    assert os.path.basename(partial) == "epoch0005-step000002"
    checkpoint.save_position(args, {"epoch": 6}, state)
    assert not os.path.isdir(partial) and os.path.isdir(tmp_path / "dcp" / "epoch0005")


def test_05s_position_completes_its_engine_folder_and_only_complete_folders_count(tmp_path):
    """save_position() of 05's state (rank 0's part of 05's save, after the engine's): the engine's
    files stay, position.json completes the folder; the newest 3 complete ones stay, unfinished ones
    go, a part-way one goes with the next save. 01-04 and 06-08 given such an --out-dir name
    scripts/ds_to_pt.py; 05 continues it from position.json alone."""
    from common.cli import shared_parser

    parse = shared_parser("test", "test", {"cnn": None}).parse_args
    args = parse(["--out-dir", str(tmp_path), "--arch", "cnn", "--epochs", "7"])
    engine = tmp_path / "ds_checkpoints"

    def save(row):
        folder = checkpoint.own_path(str(tmp_path), row, checkpoint.ENGINE_DIR)
        os.makedirs(folder)
        with open(os.path.join(folder, "mp_rank_00_model_states.pt"), "wb"):
            pass
        state = {"step": "05_cifar10_deepspeed", "global_step": 3 * row["epoch"]}
        if row["epoch"] != 3:  # 3: killed before rank 0 wrote position.json
            assert checkpoint.save_position(args, row, state, checkpoint.ENGINE_DIR) == folder
        return folder

    for epoch in range(1, 6):
        save({"epoch": epoch})
        assert (engine / "epoch0003").is_dir() == (epoch == 3), "unfinished: removed"
        assert (engine / f"epoch{epoch:04d}" / "mp_rank_00_model_states.pt").is_file()
    assert [os.path.basename(p) for p in checkpoint.own_folders(str(engine))] == [
        "epoch0005", "epoch0004", "epoch0002"]
    assert checkpoint.library_folder(str(engine)) == (checkpoint.ENGINE_DIR,
                                                      str(engine / "epoch0005"))
    for own, says in ((None, "python scripts/ds_to_pt.py " + str(engine)),
                      (checkpoint.DCP_DIR, "python scripts/ds_to_pt.py "),
                      (checkpoint.ENGINE_DIR, "")):
        again = parse(["--out-dir", str(tmp_path), "--resume", "auto"])
        verdict = checkpoint.settings(again, own=own)
        assert says in (verdict.error or "") and (verdict.error is None) == (
            own == checkpoint.ENGINE_DIR), verdict
    assert verdict.values["epochs"] == 7
    found = checkpoint.find(again, own=checkpoint.ENGINE_DIR)
    assert found["folder"] == str(engine / "epoch0005") and found["global_step"] == 15
    with pytest.raises(UserError, match=r"DeepSpeed checkpoint folder .* `python "
                                        r"scripts/ds_to_pt.py .*` makes of it \(its weights"):
        checkpoint.load(str(engine))
    partial = save({"epoch": 6, "partial": True, "steps": 2})
    assert os.path.basename(partial) == "epoch0005-step000002"
    save({"epoch": 6})
    assert not os.path.isdir(partial) and os.path.isdir(engine / "epoch0005")
