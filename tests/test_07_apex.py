"""Step 07 (Apex): the native successors for real on CPU, and Apex's absence said in one line.

The native path (torch.autocast + GradScaler, torch DDP) runs under the legacy launcher old Apex
tutorials use (`python -m torch.distributed.launch`, which passes --local-rank=N) and, resumed, under
torchrun, ending with step 04's bits. The legacy apex.amp/apex.parallel path and FusedSGD need a CUDA GPU
and a built Apex: neither exists here, so they are untested; these tests check what a reader without
them sees (`--amp-backend apex` without Apex: tests/test_bad_input.py, with the other bad input). Only the legacy
path's own lines run here, on 2 CPU ranks with a stand-in of Apex's interface (APEX_STAND_IN).
"""
import os

import pytest

from helpers import (BIN, DDP_ARGS, EPOCHS, PYTHON, REPO, SMOKE, as_after_epoch, assert_one_line_error, assert_trained,
                     checkpoint_epoch, digests, free_port, load_checkpoint, legacy_launch, metrics, once, run, script,
                     torchrun)

# 2 processes x 32 in fp32, as run04 (conftest.py): the native path is 04's code, so 07 must end with 04's bits. fp32
# because the CPU emulates bf16, which test_bf16_autocast_resumes_bit_for_bit runs on 8 images.
TRAIN = [*EPOCHS, *DDP_ARGS]
ONE = [*EPOCHS, "--batch-size", "64", "--amp", "off"]  # 1 x 64: the same global batch in one process


@pytest.fixture(scope="module")
def resumed(data, tmp_path_factory):
    """Epoch 1 under the legacy launcher, then --resume auto under torchrun: both launchers, one run."""
    def make(out):
        common = [*data, *TRAIN, "--out-dir", out]
        first = legacy_launch(2, 7, *common, "--stop-after", "1")
        then = torchrun(2, 7, *common, "--resume", "auto")
        return out, first.output, then.output
    return once(tmp_path_factory, "apex-resumed", make)


def test_native_path_trains_under_the_legacy_launcher(resumed):
    out, output, _ = resumed
    assert "epoch   1/2" in output and "stopping after 1 epoch" in output, output
    assert_trained(out, epochs=2, ranks=2)
    chosen = [line for line in output.splitlines() if line.startswith("amp backend:")]
    assert chosen == ["amp backend: torch (auto: NVIDIA Apex is not installed; using its native successors "
                      "torch.autocast + GradScaler + torch DDP)"], output
    assert "optimizer: torch.optim.SGD" in output
    state = load_checkpoint(checkpoint_epoch(out, 2))
    assert state["step"] == "07_cifar10_apex" and state["scaler"] == {}  # fp32: the scaler is disabled


def test_resumed_under_torchrun_it_ends_where_04_does_bit_for_bit(resumed, run04):
    out, _, output = resumed
    assert "resumed from epoch 1 (written by 07_cifar10_apex)" in output
    assert [row["epoch"] for row in metrics(out)] == [1, 2]
    assert sorted(digests(out)) == [0, 1] and digests(out) == digests(run04[0]), "stopped, resumed, and 04's bits"


def test_bf16_autocast_resumes_bit_for_bit(tiny_data, tmp_path):
    """bf16 autocast (--amp auto's choice where the CPU computes it natively; the scaler disabled) on 8 images, 2
    optimizer steps per epoch (a CPU without native bf16 emulates it): the legacy launcher's run as it was after
    epoch 1 (what a stopped launch leaves: the `resumed` fixture), resumed under torchrun, ends where the
    uninterrupted one does."""
    tiny = [*tiny_data, *SMOKE, "--epochs", "2", "--batch-size", "2", "--amp", "bf16"]
    whole = legacy_launch(2, 7, *tiny, "--out-dir", tmp_path / "whole")
    assert "amp bf16" in whole.output, whole.output
    assert load_checkpoint(checkpoint_epoch(tmp_path / "whole", 2))["scaler"] == {}  # bf16: the scaler is disabled
    as_after_epoch(tmp_path / "whole", tmp_path / "resumed", 1)  # a stopped legacy launch: the `resumed` fixture
    torchrun(2, 7, *tiny, "--out-dir", tmp_path / "resumed", "--resume", "auto")
    found = digests(tmp_path / "resumed")
    assert sorted(found) == [0, 1] and found == digests(tmp_path / "whole"), (found, digests(tmp_path / "whole"))


def test_checkpoints_interchange_with_step_01(resumed, data, tmp_path):
    """01 continues from 07's epoch-1 checkpoint; 07 then loads 01's result to the last bit."""
    run([PYTHON, script(1), *data, *ONE, "--out-dir", tmp_path / "01", "--resume", checkpoint_epoch(resumed[0], 1)])
    proc = run([PYTHON, script(7), *data, *ONE, "--out-dir", tmp_path / "07",
                "--resume", checkpoint_epoch(tmp_path / "01", 2), "--amp-backend", "torch"])
    assert "resumed from epoch 2 (written by 01_cifar10_cpu)" in proc.output
    assert digests(tmp_path / "07") == digests(tmp_path / "01")


@pytest.fixture
def registry_apex(tmp_path):
    """What `pip install apex` gives: a top-level package named apex, without amp/ or optimizers/."""
    (tmp_path / "site" / "apex").mkdir(parents=True)
    (tmp_path / "site" / "apex" / "__init__.py").write_text("")
    return {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}


def test_registry_apex_is_named_as_the_unrelated_package(registry_apex, data, tmp_path):
    proc = run([PYTHON, script(7), *data, "--out-dir", tmp_path / "run", "--amp-backend", "apex"], check=False,
               **registry_apex)
    assert_one_line_error(proc, "the apex in ", "is the unrelated registry package of that name, not NVIDIA Apex",
                          "pip uninstall apex")


APEX_STAND_IN = """
import contextlib, runpy, sys, types, torch, torch.distributed as dist
from common import data, metrics

class LegacyDDP(torch.nn.Module):
    # apex.parallel.DistributedDataParallel (tag 25.05) as the step meets it: rank 0's parameters at construction,
    # gradients averaged in backward, and the buffers never
    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, 0)
            p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad.div_(dist.get_world_size())))

    def forward(self, *inputs):
        return self.module(*inputs)

apex = types.SimpleNamespace(
    amp=types.SimpleNamespace(initialize=lambda model, optimizer, opt_level: (model, optimizer),
                              scale_loss=lambda loss, optimizer: contextlib.nullcontext(loss)),
    parallel=types.SimpleNamespace(DistributedDataParallel=LegacyDDP))
step = runpy.run_path(sys.argv[1], run_name="step07")
dist.init_process_group("gloo")
rank, cpu = dist.get_rank(), torch.device("cpu")
args = step["parse_args"](["--data-dir", "unused", "--batch-size", "8", "--workers", "0", "--amp-backend", "apex"])
torch.manual_seed(rank)  # each rank its own start (the wrapper makes rank 0's the start of all) and its own images
model = step["prepare_model"](args, step["build_model"](args, data.Info(10, data.MEAN, data.STD)), cpu, apex)
model, optimizer, scheduler, scaler = step["build_optimizer"](args, model, 3, cpu, None, apex)
batches = [(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (8,))) for _ in range(3)]
meter = metrics.Meter(args, 3)
meter.start(None, 0)
step["train_one_epoch"](args, model, batches, optimizer, scheduler, scaler, cpu, None,
                        types.SimpleNamespace(requested=lambda steps: False), meter, apex)
state = model.module.state_dict()
names = [name for name, _ in model.module.named_buffers() if name in state]  # batch-norm statistics
everyone = [None, None]
dist.all_gather_object(everyone, {name: state[name] for name in state})
if rank == 0:
    (mine, other) = everyone
    print("buffers", len(names), "equal" if all(torch.equal(mine[n], other[n]) for n in names) else "DIFFER")
    print("parameters", "equal" if all(torch.equal(mine[n], other[n]) for n in mine if n not in names) else "DIFFER")
dist.destroy_process_group()
"""


def test_the_legacy_path_ends_with_rank_0_s_batch_norm_statistics_on_every_rank(tmp_path):
    """apex.parallel.DistributedDataParallel broadcasts parameters only: with its interface's stand-in and the default
    model (batch norm), 07's legacy lines must leave every rank with rank 0's buffers, as 04's DDP does."""
    stand_in = tmp_path / "apex_stand_in.py"
    stand_in.write_text(APEX_STAND_IN)
    proc = run([BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", stand_in, script(7)])
    assert "buffers 60 equal" in proc.output and "parameters equal" in proc.output, proc.output[-3000:]
