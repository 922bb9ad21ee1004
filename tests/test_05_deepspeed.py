"""Step 05 (DeepSpeed) under the real deepspeed launcher: ZeRO stages 0 and 3 train and keep the
replicas identical, 05 writes its engine's checkpoint only (position.json completes each folder),
scripts/ds_to_pt.py makes the checkpoint-epochNNNN.pt of one (the weights 05 ended with, at ZeRO 3
and 0), which loads in step 01 and evaluates to the accuracy 05 logged, a part-way one continues by
progress, skipped steps still count, and a missing DeepSpeed is one line (fp16 on the CPU:
tests/test_bad_input.py, with the other bad input).
The README's own command (ZeRO 2 in --amp auto, quiet), its exact resume and an engine checkpoint
refused by another number of processes: tests/test_template.py, on a user's copy of 05.

Every launch costs seconds on two cores (the launcher's two processes and every rank import
DeepSpeed), so there are three, each serving several checks:
* zero3: ZeRO-3 in fp32 (--amp off, so that step 01's fp32 evaluation can be held to the logged
  numbers), with a config that partitions even the small model's weights; 2 processes x 8 images,
  so that step 01 continuing its converted epoch 1 at batch 64 meets another batch arithmetic;
  stopped part-way through epoch 2 by a SIGTERM to the deepspeed launcher;
* ZeRO-0 in fp32 continues zero3's part-way folder, converted (weights only), to the end of epoch
  2, launched as on a plain CPU machine (no -q, no DS_ACCELERATOR), to show that the ranks add no
  DeepSpeed noise, and must end where 04 continuing the same file does;
* the overflow check, on 8 images (bf16 is emulated on this CPU).
One more process, without a launcher, exports the weights at every ZeRO stage in bf16 and fp32.
In fp32 05 ends bit for bit where 04 does: ZeRO 0 with --grad-accum here, ZeRO 1 with it in
tests/test_preemption.py and without it in tests/test_default_model.py, ZeRO 2 without it in
tests/test_learning_curves.py. (ZeRO 2 with --grad-accum reduces every pass's gradients as they
come: other bits, the same curve; tests/test_template.py.)
"""
import json
import shutil

import pytest

from common import checkpoint
from helpers import (PYTHON, REPO, SMOKE, assert_01_continues_by_progress,
                     assert_one_line_error, assert_step01_evaluates_as_logged, assert_trained,
                     converted, digests, launch_command, load_checkpoint, metrics, run, script)

def deepspeed(nproc, *args, quiet=True, **kw):
    """`deepspeed [-q] --num_gpus N 05_cifar10_deepspeed.py --deepspeed_config ds_config.json ARGS`
    from the repository root (a later --deepspeed_config in ARGS wins).
    quiet: the README's CPU command, with -q and DS_ACCELERATOR=cpu; otherwise as typed on a CPU
    machine that has neither."""
    launcher, *rest = launch_command("deepspeed", nproc, 5)
    command = [launcher, *(["-q"] if quiet else []), *rest, "--deepspeed_config", "ds_config.json",
               *args]
    if quiet:
        return run(command, DS_ACCELERATOR="cpu", **kw)
    return run(["env", "-u", "DS_ACCELERATOR", *command], **kw)


def part_way(out):
    """The engine folder of a run stopped part-way through its epoch 2."""
    found = sorted((out / "ds_checkpoints").glob("epoch0001-step*"))
    assert len(found) == 1, sorted(path.name for path in (out / "ds_checkpoints").iterdir())
    return found[0]


def test_zero3_partitions_and_trains(zero3, tmp_path):
    """Every rank saves its own shard and rank 0 position.json, no .pt; scripts/ds_to_pt.py gathers
    epoch 1 into the checkpoint format, and the part-way folder into the very weights 05 ended
    with (its final digest, taken right after that save)."""
    out, output = zero3
    assert "ZeRO stage 3, amp off" in output and "stopped after step" in output
    shards = sorted(path.name for path in (out / "ds_checkpoints" / "epoch0001").iterdir())
    expected = [f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
                for rank in (0, 1) for kind in ("model", "optim")]
    assert shards == ["position.json", *expected], "every rank saves its own shard"
    assert not list(out.glob("*.pt")), "05 writes no .pt (scripts/ds_to_pt.py makes one)"
    for path in [out / "metrics.jsonl", out / "training_curves.png", *out.glob("weights-rank*")]:
        shutil.copy(path, tmp_path)
    converted(out / "ds_checkpoints" / "epoch0001", tmp_path)
    # one warm-up epoch: well above chance already
    assert_trained(tmp_path, epochs=1, min_acc=0.4, ranks=2)
    stopped = load_checkpoint(converted(part_way(out), tmp_path / "part"))
    assert stopped["optimizer"] is None and stopped["step"] == "05_cifar10_deepspeed"
    assert {checkpoint.weights_digest(stopped["model"])} == set(digests(out).values())


def test_01_evaluates_the_converted_checkpoint_to_the_logged_accuracy(zero3, data, tmp_path):
    """The weights gathered from ZeRO-3's shards by scripts/ds_to_pt.py;
    05 evaluated through the engine on two test shards."""
    assert_step01_evaluates_as_logged(converted(zero3[0] / "ds_checkpoints" / "epoch0001",
                                                tmp_path / "pt"),
                                      metrics(zero3[0])[0], data, tmp_path)


def test_zero0_continues_a_converted_folder_as_04_does_and_ranks_add_no_noise(zero3, data,
                                                                              tmp_path):
    """ZeRO 0 in fp32 continues zero3's part-way folder of epoch 2, made a .pt by
    scripts/ds_to_pt.py (weights only, 80 steps per epoch then, 20 now of 2 accumulated passes), to
    the bits that 04 reaches from the same file: the rest of the epoch, the schedule placed by
    progress (epoch 1 and the part of epoch 2 done), the same step, the same accumulation. (Placed
    at the raw step count it would train at learning rate 0; placed at epoch 1's end, at other
    rates: both still pass an accuracy floor.) ZeRO 0's own folder converts to the weights it ended
    with."""
    pt = converted(part_way(zero3[0]), tmp_path / "pt")
    resumed = [*data, "--epochs", "2", "--batch-size", "16", "--grad-accum", "2", "--amp", "off",
               "--no-channels-last", "--resume", pt]
    proc = deepspeed(2, *resumed, "--zero-stage", "0", "--out-dir", tmp_path / "05", quiet=False)
    run([*launch_command("torchrun", 2, 4), *resumed, "--out-dir", tmp_path / "04"])
    row = load_checkpoint(pt)["metrics"]
    assert (f"resumed from step {row['steps']} of 80 in epoch 2 (written by 05_cifar10_deepspeed): "
            "weights only") in proc.output, proc.output
    assert "ZeRO stage 0, amp off" in proc.output
    rows = metrics(tmp_path / "05")
    assert [row["epoch"] for row in rows] == [2] and rows[0]["test_acc"] >= 0.5, rows
    found = digests(tmp_path / "05")
    assert sorted(found) == [0, 1] and found == digests(tmp_path / "04"), (
        found, digests(tmp_path / "04"))
    ended = load_checkpoint(converted(tmp_path / "05" / "ds_checkpoints" / "epoch0002",
                                      tmp_path / "zero0"))
    assert {checkpoint.weights_digest(ended["model"])} == set(found.values())
    # The launcher's two processes (runner, launch.py) each warn that no GPU was found; the ranks
    # do not (the script names the CPU), nor print the shm op build, the scheduler warning or
    # torch's FutureWarnings.
    assert proc.output.count("Setting accelerator to CPU") == 2, proc.output
    for noise in ("built successfully", "Attempting to get learning rate", "untested optimizer",
                  "FutureWarning"):
        assert noise not in proc.output, proc.output


def test_missing_deepspeed_is_one_line_with_the_fix(data, tmp_path):
    hide_deepspeed = ("import runpy, sys; sys.modules['deepspeed'] = None; "
                      "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = run([PYTHON, "-c", hide_deepspeed, script(5), *data, "--out-dir", tmp_path / "o"],
               check=False)
    assert_one_line_error(proc, "DeepSpeed is not importable",
                          f"`{PYTHON} -m pip install deepspeed==0.19.8`")
    assert not (tmp_path / "o").exists(), "nothing is written before the check"


def test_a_converted_folder_of_other_batch_arithmetic_continues_in_01_by_progress(zero3, data,
                                                                                   tmp_path):
    """zero3's 2 processes x 8 images (80 steps per epoch), converted by scripts/ds_to_pt.py,
    continued by 01 at batch 64 (20 steps per epoch)."""
    pt = converted(zero3[0] / "ds_checkpoints" / "epoch0001", tmp_path / "pt")
    assert_01_continues_by_progress(pt, data, tmp_path / "01")


def test_ds_to_pt_refuses_what_is_not_a_05_folder_in_one_line(tmp_path):
    proc = run([PYTHON, "scripts/ds_to_pt.py", tmp_path], check=False)
    assert_one_line_error(proc, "is not a DeepSpeed checkpoint folder of step 05")


def test_steps_the_engine_skips_on_overflow_still_count(tiny_data, tmp_path):
    """fp16 (--amp auto on GPUs without native bf16): DeepSpeed skips a step whose gradients
    overflowed, and does not step the schedule then. The checkpoint's global_step must still count
    it: it places the schedule when another step continues the checkpoint. On the CPU DeepSpeed
    checks bf16 gradients too when the config asks, and a huge learning rate makes every gradient
    after the first step non-finite."""
    config = json.loads((REPO / "ds_config.json").read_text())
    config["bf16"]["check_grad_overflow"] = True
    (tmp_path / "overflow.json").write_text(json.dumps(config))
    proc = deepspeed(2, *tiny_data, *SMOKE, "--epochs", "2", "--batch-size", "2", "--amp", "bf16",
                     "--lr", "1e30", "--stop-after", "1",
                     "--deepspeed_config", tmp_path / "overflow.json", "--out-dir", tmp_path / "o")
    assert "OVERFLOW! Skipping step" in proc.output
    state = checkpoint.own_header(str(tmp_path / "o" / "ds_checkpoints" / "epoch0001"))
    assert state["global_step"] == state["metrics"]["steps"] == 8 // 4, state["metrics"]


# One process (a group of one) loads step 05 and, for every ZeRO stage in bf16 and in fp32, builds
# its engine from ds_config.json as 05 does, takes one optimizer step on the cnn with batch norm and
# prints what full_weights exports: each tensor's dtype, and whether every weight is a bf16 number.
EXPORT = """
import argparse, datetime, importlib.util, json, sys
import torch
spec = importlib.util.spec_from_file_location("step", sys.argv[1])
step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step)
step.be_a_group_of_one()
step.skip_shm_op_build()
step.deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=60))
found = {}
for stage in range(4):
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", None)):
        torch.manual_seed(0)
        model = step.models.cnn_bn(num_classes=10, mean=(120.0,) * 3, std=(60.0,) * 3)
        args = argparse.Namespace(deepspeed_config=sys.argv[2], batch_size=4, grad_accum=1,
                                  lr=0.1, zero_stage=stage)
        engine = step.build_optimizer(model, step.build_config(args, dtype), None)
        images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
        loss = torch.nn.functional.cross_entropy(engine(images).float(), torch.arange(4))
        engine.backward(loss)
        engine.step()
        weights = {key: value for key, value in step.full_weights(engine).items()
                   if key.endswith("weight")}
        found[f"{stage} {name}"] = {
            "dtypes": sorted({str(t.dtype) for t in step.full_weights(engine).values()}),
            "bf16 numbers": all(torch.equal(t, t.bfloat16().float()) for t in weights.values()),
            "sum": sum(t.double().sum().item() for t in weights.values())}
print(json.dumps(found))
"""


def test_the_export_is_fp32_masters_at_every_stage_and_precision():
    """full_weights gives every tensor in fp32 and, in bf16, the optimizer's fp32 master weights
    (numbers that bf16 cannot hold after a step), not the bf16 weights the model ran with: ZeRO 1-3
    through deepspeed.utils.safe_get_full_fp32_param, ZeRO 0 through its optimizer wrapper's groups.
    In one precision the four stages export the same weights (their sums): to 6 digits in fp32, to
    bf16's 3 in bf16, where ZeRO 0 lands a little apart from ZeRO 1-3 (seen: 1.4e-4 relative)."""
    proc = run([PYTHON, "-c", EXPORT, script(5), REPO / "ds_config.json"], DS_ACCELERATOR="cpu")
    found = json.loads(proc.output.strip().splitlines()[-1])
    assert sorted(found) == sorted(f"{stage} {name}" for stage in range(4)
                                   for name in ("bf16", "fp32")), found
    for key, export in found.items():
        # int64: batch norm's num_batches_tracked
        assert export["dtypes"] == ["torch.float32", "torch.int64"], (key, export)
        assert not export["bf16 numbers"], (key, "the bf16 weights, not the fp32 masters")
    for name, digits in (("bf16", 2 ** -8), ("fp32", 1e-6)):
        sums = [found[f"{stage} {name}"]["sum"] for stage in range(4)]
        assert sums == pytest.approx([sums[0]] * 4, rel=digits), (name, sums)
