"""Steps 01-04 run the way the README tells a reader to run them, and deliver what they promise.

One uninterrupted run per step serves several checks (run01, run04 and the learning-curve runs of 02
and 03 are session fixtures in conftest.py, started by the README's commands and shared with other
test files), so the suite stays fast on two cores. Bit-for-bit comparisons work because every run
uses one thread per process and the data order and augmentation depend only on (seed, epoch, sample
index).
"""
import subprocess

from common.checkpoint import weights_digest
from helpers import (BIN, DDP_ARGS, EPOCHS, PYTHON, SMOKE, as_after_epoch, assert_alike,
                     assert_one_line_error, assert_trained, checkpoint_epoch, digests, env,
                     free_port, load_checkpoint, metrics, run, script, torchrun)

def test_01_trains_above_chance(run01):
    assert_trained(run01, epochs=2)


def test_01_resume_matches_uninterrupted_run(tmp_path, data, run01):
    """run01 as --stop-after 1 leaves it (that a stopped launch repeats its epochs bit for bit: 02
    with ResNet-18 in tests/test_default_model.py), resumed in a launch that names only where and
    how."""
    # as a kill between the checkpoint's rename and its row leaves it
    as_after_epoch(run01, tmp_path, 1, rows=False)
    # Only where and how: data, model, epochs, batch, precision and seed come from the checkpoint's
    # run.
    second = run([PYTHON, script(1), "--out-dir", tmp_path, "--resume", "auto",
                  "--workers", "2"])  # another worker count: the batches must not change
    assert "resumed from epoch 1" in second.output
    assert_trained(tmp_path, epochs=2)
    assert digests(tmp_path) == digests(run01), (
        "resumed run must end bit-identical to the uninterrupted one")
    assert metrics(tmp_path)[0] == metrics(run01)[0], "epoch 1's row comes back from its checkpoint"
    other = run([PYTHON, script(1), "--out-dir", tmp_path, "--resume", "auto",
                 "--arch", "resnet18"], check=False)
    assert_one_line_error(other, "--arch resnet18 contradicts", "which holds a cnn model")


# This CPU as one without AVX512-BF16 or AMX (most laptops): torch's kernels and oneDNN's limited to
# AVX2.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_02_auto_is_fp32_on_a_cpu_without_native_bf16_and_bf16_says_it_is_emulated(
        tmp_path, small_data, tiny_data):
    """--amp auto on such a CPU trains in fp32 and says why in its start line; --amp bf16 still runs
    and says once that it is emulated. (Where the CPU computes bf16 natively, auto is bf16: the
    README's main job, tests/test_readme.py.)"""
    auto = run([PYTHON, script(2), *small_data, "--epochs", "1", "--batch-size", "8",
                "--out-dir", tmp_path / "auto"], **AVX2)
    assert "no GPU found" in auto.output and (
        "amp off (auto: fp32, as this CPU (AVX2) has no native bf16 (emulated, it "
        "would be several times slower))") in auto.output, auto.output
    (row,) = metrics(tmp_path / "auto")
    # below chance's ln(10) = 2.30 after one warm-up epoch: it learns
    assert row["train_loss"] < 2.2, row
    asked = run([PYTHON, script(2), *tiny_data, *SMOKE, "--epochs", "1", "--batch-size", "4",
                 "--amp", "bf16", "--out-dir", tmp_path / "bf16"], **AVX2)
    assert (asked.output.count("amp bf16 (as asked; this CPU (AVX2) has no native bf16: "
                               "emulated, several times slower than fp32)") == 1
            and asked.output.count("emulated") == 1), asked.output


def test_02_and_03_run_on_cpu_and_agree(curves):
    """Their learning-curve runs (conftest.py: the README command, 2 epochs of the textures data,
    batch 64, fp32)."""
    (out2, _, output2), (out3, _, output3) = curves(2), curves(3)
    assert "no GPU found" in output2 and "amp off" in output2
    assert "passthrough" in output3
    assert_trained(out2, epochs=2)
    assert_trained(out3, epochs=2)
    # Without GPUs DataParallel only calls the model: the weights must be exactly step 02's.
    assert digests(out3) == digests(out2)
    assert "scaler" in load_checkpoint(checkpoint_epoch(out2, 2))


def test_03_stopped_then_02_resumed_ends_exactly_there(tmp_path, tiny_data, capsys):
    """Stopped after epoch 1 by 03, resumed by 02: the same bits as an uninterrupted 02 run. Each
    step's main() in this process (the code its command line reaches), on 8 images: no launch of its
    own. The other way round (02 stopped, 03 resumed), with ResNet-18 and launched, ending at 01's
    bits: tests/test_default_model.py."""
    import runpy

    def main(number, out, *extra):
        step = runpy.run_path(script(number), run_name=f"step{number:02d}")
        step["main"]([str(a) for a in [*tiny_data, *SMOKE, "--epochs", "2", "--batch-size", "4",
                                       "--amp", "off", "--out-dir", out, *extra]])
        return "".join(capsys.readouterr())

    main(2, tmp_path / "whole")
    stopped = main(3, tmp_path / "resumed", "--stop-after", "1")
    assert ("stopping after 1 epoch" in stopped
            and [r["epoch"] for r in metrics(tmp_path / "resumed")] == [1]), stopped
    resumed = main(2, tmp_path / "resumed", "--resume", "auto")
    assert "resumed from epoch 1 (written by 03_cifar10_dataparallel)" in resumed, resumed
    assert [r["epoch"] for r in metrics(tmp_path / "resumed")] == [1, 2]
    assert (digests(tmp_path / "resumed") == digests(tmp_path / "whole")
            and len(digests(tmp_path / "whole")) == 1)


def test_04_torchrun_trains_identical_replicas(run04):
    out, output = run04
    assert_trained(out, epochs=2, ranks=2)
    assert "2 processes" in output and output.count("epoch   2/2") == 1, "only rank 0 logs"


def test_04_two_processes_follow_one_process_with_twice_the_batch(run01, run04):
    """DDP averages gradients: 2 x 32 takes the same steps as 1 x 64, up to rounding (another sum:
    helpers.ALIKE says how far it has been measured to move them, and how far a broken 04 is)."""
    assert_alike(metrics(run04[0]), metrics(run01))


def epoch1_digest(out_dir):
    return weights_digest(load_checkpoint(checkpoint_epoch(out_dir, 1))["model"])


def ddp_args(data, out):
    return [*data, *EPOCHS, *DDP_ARGS, "--out-dir", out, "--stop-after", "1"]


def test_04_legacy_launcher_passes_local_rank(tmp_path, data, run04):
    """python -m torch.distributed.launch passes --local-rank=N; the run equals the torchrun one."""
    run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node=2",
         f"--master_port={free_port()}", script(4), *ddp_args(data, tmp_path)])
    assert epoch1_digest(tmp_path) == epoch1_digest(run04[0])


def test_04_spawn_equals_torchrun(tmp_path, data, run04):
    run([PYTHON, script(4), "--spawn", "2", *ddp_args(data, tmp_path)])
    assert epoch1_digest(tmp_path) == epoch1_digest(run04[0])


def test_04_two_nodes_on_one_machine(tmp_path, data, run04):
    """Two torchrun commands, one per 'node' (--nnodes=2 --node_rank=0/1), meeting at
    master_addr:port."""
    port = free_port()
    nodes = [subprocess.Popen([BIN / "torchrun", "--nnodes=2", f"--node_rank={rank}",
                               "--nproc_per_node=1", "--master_addr=127.0.0.1",
                               f"--master_port={port}", script(4),
                               *map(str, ddp_args(data, tmp_path))],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert epoch1_digest(tmp_path) == epoch1_digest(run04[0])
    assert sorted(digests(tmp_path)) == [0, 1] and len(set(digests(tmp_path).values())) == 1


def test_checkpoints_move_between_01_and_04(tmp_path, data, run01, run04):
    """A checkpoint written by 04 resumes in 01, and one written by 01 resumes in 04 (2
    processes)."""
    in01, in04 = tmp_path / "in01", tmp_path / "in04"
    resumed = run([PYTHON, script(1), *data, *EPOCHS, "--batch-size", "64", "--amp", "off",
                   "--out-dir", in01, "--resume", checkpoint_epoch(run04[0], 1)])
    assert "resumed from epoch 1 (written by 04_cifar10_ddp)" in resumed.output
    torchrun(2, 4, *data, *EPOCHS, *DDP_ARGS, "--out-dir", in04,
             "--resume", checkpoint_epoch(run01, 1))
    for out in (in01, in04):
        assert_alike(metrics(out), metrics(run01)[1:])
