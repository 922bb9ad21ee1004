"""Bad input gets one clear line and a non-zero exit, never a traceback, and loses nothing.

Argument errors are checked in-process for every script (argparse runs before anything else).
Runtime errors run the scripts for real: steps 01-03 in-process through main() (the same code a
command line reaches), the distributed steps' main() in one process per step (world size 1), and a
failure under every launcher through the launcher.
"""
import contextlib
import importlib.util
import json
import re
import shutil
import socket

import pytest
import torch

from helpers import (OUR_FRAMES, PYTHON, REPO, SMOKE, launch_command, run, torchrun,
                     write_checkpoint)

SCRIPTS = sorted(p.name for p in REPO.glob("0[1-8]_cifar10_*.py"))


def load_script(name):
    spec = importlib.util.spec_from_file_location(name[:-3].replace("0", "s", 1), REPO / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("argv,complaint", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--epochs", "0"], "--epochs: must be positive"),
    (["--batch-size", "many"], "--batch-size: expected a whole number"),
    (["--lr", "-0.1"], "--lr: must be a positive finite number"),
    (["--lr", "nan"], "--lr: must be a positive finite number"),
], ids=["unknown-flag", "zero-epochs", "text-batch", "negative-lr", "nan-lr"])
def test_argument_errors(name, argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script(name).parse_args(argv)
    assert exit_.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize("argv,world,complaint", [
    (["--replicate", "0"], "4", "--replicate 0 does not divide the number of processes"),
    (["--replicate", "3"], "4", "--replicate 3 does not divide the number of processes"),
    (["--replicate", "2"], None, "--replicate 2 does not divide the number of processes"),
], ids=["zero", "3-of-4", "2-of-1"])
def test_replicas_must_divide_the_processes(argv, world, complaint, capsys, monkeypatch):
    """08's --replicate, against the launcher's WORLD_SIZE (none: 1 process)."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    test_argument_errors("08_cifar10_fsdp.py", argv, complaint, capsys)


def bad_cases(tmp_path, cifar_dir):
    damaged = tmp_path / "damaged"
    shutil.copytree(cifar_dir, damaged)
    batch = damaged / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:1000])
    meta = tmp_path / "damaged-meta"
    shutil.copytree(cifar_dir, meta)
    (meta / "cifar-10-batches-py" / "batches.meta").write_bytes(b"not a pickle")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "corrupt.pt").write_bytes(b"PK\x03\x04 truncated")
    torch.save({"state_dict": {}}, tmp_path / "foreign.pt")
    return {
        "data-dir-is-a-file": (["--data-dir", tmp_path / "a-file"], "is a file"),
        "truncated-batch": (["--data-dir", damaged], "data_batch_2 ("),  # names the damaged file
        "damaged-meta": (["--data-dir", meta], "batches.meta ("),
        "resume-empty": (["--resume", ""], "no such file"),  # --resume "$CKPT" with CKPT unset
        "out-dir-unwritable": (["--out-dir", tmp_path / "a-file" / "out"], "--out-dir"),
        "resume-missing": (["--resume", tmp_path / "nope.pt"], "no such file"),
        "resume-corrupt": (["--resume", tmp_path / "corrupt.pt"], "not a readable checkpoint"),
        "resume-foreign": (["--resume", tmp_path / "foreign.pt"],
                           "not a checkpoint of this collection"),
        # a folder that holds no checkpoint (08 looks in it for DCP's .metadata first)
        "resume-a-folder": (["--resume", damaged], "is a folder, not a checkpoint file"),
    }


@pytest.fixture
def default_port_taken():
    """Another job on this machine holds torch's default port, 29500 (or something already does): a
    step started without a launcher (a group of one, or --spawn) must not need it."""
    with socket.socket() as held:
        # an old connection's TIME_WAIT does not stop it
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # taken already: as good
            held.bind(("127.0.0.1", 29500))
            held.listen()
        yield


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n[:2] in ("01", "02", "03")])
def test_runtime_errors_single_process(name, tmp_path, cifar_dir, capsys):
    module = load_script(name)
    for case, (extra, complaint) in bad_cases(tmp_path, cifar_dir).items():
        argv = ["--data-dir", cifar_dir, *SMOKE, "--epochs", "1", "--out-dir", tmp_path / "out",
                *extra]
        with pytest.raises(SystemExit) as exit_:
            module.main([str(a) for a in argv])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2, case
        assert (err.startswith("error:") and complaint in err
                and len(err.splitlines()) == 1), (case, err)


# One interpreter calls a distributed script's main() once per bad input (as a single process,
# world size 1), leaving its process group between cases: one torch import per script, not per case.
DRIVER = """
import contextlib, importlib.util, io, json, os, sys
import torch.distributed as dist
spec = importlib.util.spec_from_file_location("step", sys.argv[1])
step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step)
results, environ = {}, dict(os.environ)
for case, argv in json.loads(sys.argv[2]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            step.main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    if dist.is_initialized():
        dist.destroy_process_group()
    if "horovod.torch" in sys.modules:
        sys.modules["horovod.torch"].shutdown()
    os.environ.clear()
    os.environ.update(environ)
    results[case] = [code, err.getvalue()]
print(json.dumps(results))
"""


# What only one step refuses on a CPU, before it writes anything: the same one line, and no
# --out-dir made.
REFUSED_ON_CPU = {
    "04": {"sync-bn-on-the-cpu": (["--sync-bn"], ["--sync-bn needs CUDA or XPU GPUs"])},
    "05": {"fp16-on-the-cpu": (["--amp", "fp16"],
                               ["--amp fp16 needs a GPU; on the CPU use --amp bf16 or --amp off"])},
    "07": {"apex-not-installed": (["--amp-backend", "apex"],
                                  ["NVIDIA Apex is not installed", "25.05",
                                   "from source on a CUDA machine", "NGC PyTorch container",
                                   "--amp-backend torch"])},
}


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n[:2] in ("04", "05", "06", "07", "08")])
def test_runtime_errors_distributed_steps(name, tmp_path, cifar_dir, default_port_taken):
    refused = REFUSED_ON_CPU.get(name[:2], {})
    bad = {case: (extra, [complaint])
           for case, (extra, complaint) in bad_cases(tmp_path, cifar_dir).items()}
    cases = {case: [str(a) for a in ["--data-dir", cifar_dir, *SMOKE, "--epochs", "1",
                                     "--out-dir", tmp_path / case, *extra]]
             for case, (extra, _) in {**bad, **refused}.items()}
    proc = run([PYTHON, "-c", DRIVER, REPO / name, json.dumps(cases)], timeout=300)
    results = json.loads(proc.output.strip().splitlines()[-1])
    for case, (_, complaints) in {**bad, **refused}.items():
        code, err = results[case]
        lines = [line for line in err.strip().splitlines()
                 if "Warning" not in line and line.strip()]
        assert code == 2 and "Traceback" not in err, (case, err)
        assert (len(lines) == 1 and "error:" in lines[0]
                and all(c in lines[0] for c in complaints)), (case, err)
    for case in refused:
        assert results[case][1].strip().startswith("error:"), results[case]
        assert not (tmp_path / case).exists(), f"{case}: nothing is written before the check"


# Every launcher the README documents, with a step it starts: launcher, processes, step, the step's
# own flags.
LAUNCHED = {"python": ("python", 1, 1, []), "spawn": ("python", 1, 4, ["--spawn", "2"]),
            "torchrun": ("torchrun", 2, 4, []), "legacy": ("legacy", 2, 4, []),
            "deepspeed": ("deepspeed", 2, 5, []), "horovodrun": ("horovodrun", 2, 6, [])}
# One failure per launcher, each kind under a torchrun (with its Root Cause report) and two others.
FAILURES = {"python": "offline-no-data", "spawn": "bad-checkpoint", "torchrun": "offline-no-data",
            "legacy": "bad-checkpoint", "deepspeed": "bad-checkpoint",
            "horovodrun": "offline-no-data"}


@pytest.mark.parametrize("launcher,failure", FAILURES.items(), ids=FAILURES)
def test_a_failure_is_one_line_at_the_end_under_every_launcher(launcher, failure, tmp_path,
                                                              cifar_dir, default_port_taken):
    """The README's first command on a machine without internet (no data, no download), or a bad
    --resume: the cause in one line among the last 10 the user sees, no traceback of our code, the
    other rank silent or one "stopping:" line. torchrun (and the legacy launcher, which is torchrun)
    closes with its own report, which names our line (from the error file it gives each process);
    horovodrun closes with a traceback of its own code (~20 lines) after which nothing of ours can
    come: there our line is among the last of our processes'."""
    name, nproc, number, flags = LAUNCHED[launcher]  # 2 ranks but under plain python
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    args, cause = {"offline-no-data": (["--data-dir", tmp_path / "empty"], "CIFAR-10 is not in"),
                   "bad-checkpoint": (["--data-dir", cifar_dir, "--resume", tmp_path / "bad.pt"],
                                      "bad.pt is not a checkpoint")}[failure]
    proc = run([*launch_command(name, nproc, number), *flags, *args, *SMOKE,
                "--out-dir", tmp_path / "out"],
               check=False, timeout=120, DS_ACCELERATOR="cpu")
    lines = proc.output.strip().splitlines()
    assert proc.returncode != 0 and not OUR_FRAMES.search(proc.output), proc.output
    if launcher == "horovodrun":
        # what our processes printed
        lines = [line for line in lines if line.startswith(("[0]<", "[1]<"))]
    assert any(cause in line for line in lines[-10:]), proc.output
    others = [line for line in proc.output.splitlines() if "error:" in line and cause not in line]
    stopping = [line for line in proc.output.splitlines()
                if re.match(r"(\[\d\]<std\w+>:)?stopping:", line)]
    # spawn: "rank 0 exited"
    assert len(others) <= 1 and len(stopping) <= (launcher != "python"), proc.output
    # both ranks ran: the other one says why it stops
    if failure == "offline-no-data" and launcher != "python":
        assert stopping or "[rank 1] error:" in proc.output, proc.output
    if launcher in ("torchrun", "legacy"):
        # a rank torchrun stopped is listed above it, <N/A>
        root_cause = proc.output.partition("Root Cause")[2]
        assert cause in root_cause and "<N/A>" not in root_cause, proc.output
    if failure == "offline-no-data":
        assert ("python scripts/synthetic.py" in proc.output
                and "cifar-10-python.tar.gz" in proc.output)


def test_a_fresh_run_into_another_runs_folder_is_refused_and_loses_nothing(tmp_path, data, run01):
    """The folder of a finished run (run01: epochs 1-2) and a fresh run of another step pointed at
    it: one line that names the three ways on, exit 2, and the earlier run's files as they were."""
    shutil.copytree(run01, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    proc = torchrun(2, 4, *data, "--epochs", "1", "--out-dir", tmp_path / "run", check=False,
                    timeout=120)
    # no traceback of ours
    assert proc.returncode != 0 and 'cifar10_ddp.py", line' not in proc.output, proc.output
    assert (f"error: --out-dir {tmp_path / 'run'} already holds a run (checkpoint-epoch0002.pt): "
            "continue it with --resume auto, write to another --out-dir, "
            "or replace it with --overwrite" in proc.output), proc.output
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before


def test_a_bad_argument_under_a_launcher_is_said_once(tmp_path, cifar_dir):
    proc = torchrun(2, 4, "--data-dir", cifar_dir, "--epochs", "0", "--out-dir", tmp_path,
                    check=False, timeout=120)
    assert proc.returncode != 0 and proc.output.count(
        "error: argument --epochs: must be positive, got 0") == 1, proc.output
    assert (proc.output.count("usage: 04_cifar10_ddp.py") == 1
            and 'cifar10_ddp.py", line' not in proc.output)


def exit_of(error):
    """Raise `error` in a main() wrapped by common.cli.exits_cleanly, as every script's main is; its
    exit status."""
    from common.cli import exits_cleanly

    @exits_cleanly
    def main():
        raise error

    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code


def test_a_group_that_cannot_connect_is_one_line(capsys):
    """What gloo raises in init_process_group when a peer is gone while the group forms (seen in a
    torchrun restart here): one line, exit 2, not the traceback of our setup()."""
    status = exit_of(RuntimeError("Gloo connectFullMesh failed with "
                                  "[../gloo/transport/tcp/pair.cc:152] timed out connecting: "
                                  "SO_ERROR: Connection refused, remote=[127.0.0.1]:31155"))
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert (err.startswith("error: cannot connect to the other processes "
                           "(Gloo connectFullMesh failed")
            and "Connection refused" in err), err


def test_torchrun_names_our_line_as_root_cause(tmp_path, monkeypatch):
    """torchrun's report (torch's own ChildFailedError) when the failures fall into one second: it
    lists the ranks that exited by themselves first, in rank order, then those it stopped, and a tie
    goes to the first listed. The Root Cause must still be our line: over a lower rank that says it
    stops because another failed, and over a rank torchrun stopped before it wrote anything; and a
    cause rank killed without a word (SIGKILL, no error file) must not lose to a lower rank's
    stopping line."""
    import signal
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from common.cli import PEER_LOST, UserError

    monkeypatch.setattr(time, "time", lambda: 1_000_000.5)  # every failure in the same second

    def failure(local_rank, error=None, exitcode=2):
        """What torchrun records for a rank: exit status and the error file our exits_cleanly wrote
        (or none)."""
        error_file = tmp_path / f"{local_rank}.json"
        if error is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            assert exit_of(error) == exitcode
        return ProcessFailure(local_rank, pid=100 + local_rank, exitcode=exitcode,
                              error_file=str(error_file))

    def root_cause(*failures):
        return ChildFailedError("04_cifar10_ddp.py",
                                {f.local_rank: f for f in failures}).get_first_failure()[0]

    caused = failure(1, UserError("bad.pt is not a checkpoint"))
    assert root_cause(failure(0, RuntimeError(PEER_LOST[0])), caused) == 1
    assert root_cause(caused, failure(0, exitcode=-signal.SIGTERM)) == 1
    killed = failure(2, exitcode=-signal.SIGKILL)
    assert root_cause(failure(0, RuntimeError(PEER_LOST[0])), killed) == 2


# A folder of a library's own checkpoints given to a step that cannot read it: what is in it, which
# step resumes it ("name"), and the file any step resumes instead ("beside", when it is there).
LIBRARY_FOLDERS = {
    # One epoch's DCP folder (08's dcp/epochNNNN), with the .pt scripts/dcp_to_pt.py made beside it.
    "dcp-epoch": ("dcp/epoch0003", ["DCP checkpoint folder", "08_cifar10_fsdp.py", "resume it"],
                  True),
    # dcp/ itself, alone (08 writes no .pt): its newest epoch is the one to resume, and the
    # converter makes of it the file any step resumes.
    "dcp-parent": ("dcp", ["DCP checkpoint folder", "08_cifar10_fsdp.py", "dcp/epoch0003 with",
                           "python scripts/dcp_to_pt.py ", "dcp` makes of it"], False),
    # 05's ds_checkpoints/, with the .pt scripts/ds_to_pt.py made beside its newest epoch.
    "deepspeed": ("ds_checkpoints", ["DeepSpeed checkpoint folder", "05_cifar10_deepspeed.py",
                                     "momentum starts from zero"], True),
    # ds_checkpoints/ alone (05 writes no .pt): the converter makes the file any step resumes.
    "deepspeed-parent": ("ds_checkpoints", ["DeepSpeed checkpoint folder",
                                            "05_cifar10_deepspeed.py", "epoch0003 with",
                                            "python scripts/ds_to_pt.py ",
                                            "ds_checkpoints` makes of it",
                                            "momentum starts from zero"], False),
    "plain-folder": ("elsewhere", ["is a folder, not a checkpoint file"], False),
}


@pytest.mark.parametrize("case", LIBRARY_FOLDERS)
def test_a_folder_of_another_steps_checkpoints_says_what_it_is_and_which_step_resumes_it(
        case, tmp_path, capsys):
    """--resume of 08's DCP folder, 05's ds_checkpoints/ or another folder in 01-07 (settings(),
    then resume(), as they call them): one line and exit status 2 that say what the folder is and
    which step resumes it, naming the checkpoint-epochNNNN.pt beside it that this step resumes;
    never "no such file" for a folder that is there."""
    from argparse import Namespace

    from common import checkpoint
    from common.cli import exits_cleanly, shared_parser

    run_dir = tmp_path / "run08"
    for epoch in ("epoch0002", "epoch0003"):
        (run_dir / "dcp" / epoch).mkdir(parents=True)
        (run_dir / "dcp" / epoch / ".metadata").write_bytes(b"\x80 DCP's pickled metadata")
        (run_dir / "ds_checkpoints" / epoch).mkdir(parents=True)
        (run_dir / "ds_checkpoints" / epoch / "mp_rank_00_model_states.pt").write_bytes(b"")
    (run_dir / "ds_checkpoints" / "latest").write_text("epoch0003")
    (run_dir / "elsewhere").mkdir()
    folder, says, beside = LIBRARY_FOLDERS[case]
    if beside:
        write_checkpoint(run_dir, step="08_cifar10_fsdp", arch="cnn_bn", epoch=3,
                        global_step=30, model_state={"w": torch.zeros(1)},
                        args=Namespace(epochs=7, arch="cnn_bn"))
    args = shared_parser("test", "test", {"cnn": None, "cnn_bn": None}).parse_args(
        ["--out-dir", str(tmp_path / "out01"), "--resume", str(run_dir / folder)])

    @exits_cleanly
    def step():
        checkpoint.settings(args).apply(args)
        checkpoint.resume(checkpoint.find(args))

    with pytest.raises(SystemExit) as exit_:
        step()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert all(part in err for part in says) and "no such file" not in err, err
    if beside:
        # The settings still come from the file beside it (what --resume of that file continues).
        assert str(run_dir / "checkpoint-epoch0003.pt") in err, err
        assert (args.arch, args.epochs) == ("cnn_bn", 7)
