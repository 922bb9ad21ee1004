"""Step 07 (Apex): the native successors for real on CPU, and Apex's absence said in one line.

The native path (torch.autocast + GradScaler, torch DDP) runs under the legacy launcher old Apex
tutorials use (`python -m torch.distributed.launch`, which passes --local-rank=N), ending with step
04's bits (stopped by SIGTERM and resumed under torchrun: tests/test_preemption.py; fp16 with
GradScaler in process: tests/test_gpu_paths.py). The legacy apex.amp/apex.parallel path and FusedSGD
need a CUDA GPU and a built Apex: neither exists here, so they are untested; these tests check what
a reader without them sees (`--amp-backend apex` without Apex: tests/test_bad_input.py, with the
other bad input). Only the legacy path's own lines run here, on 2 CPU ranks with a stand-in of
Apex's interface at O2 (APEX_STAND_IN, imported by the step as Apex itself): buffers synced, and a
resume bit for bit through the fp32 master weights.
"""
import os

import pytest

from helpers import (BIN, DDP_ARGS, EPOCHS, PYTHON, REPO, SMOKE, as_after_epoch,
                     assert_one_line_error, assert_trained, checkpoint_epoch, digests, free_port,
                     load_checkpoint, legacy_launch, metrics, once, run, script, torchrun)

# 2 processes x 32 in fp32, as run04 (conftest.py): the native path is 04's code, so 07 must end
# with 04's bits. fp32 because the CPU emulates bf16, which test_bf16_autocast_resumes_bit_for_bit
# runs on 8 images.
TRAIN = [*EPOCHS, *DDP_ARGS]
# 1 x 64: the same global batch in one process
ONE = [*EPOCHS, "--batch-size", "64", "--amp", "off"]


@pytest.fixture(scope="module")
def legacy(data, tmp_path_factory):
    """2 epochs under the legacy launcher (its stop by SIGTERM and resume under torchrun:
    tests/test_preemption.py)."""
    def make(out):
        return out, legacy_launch(2, 7, *data, *TRAIN, "--out-dir", out).output
    return once(tmp_path_factory, "apex-legacy", make)


def test_native_path_trains_under_the_legacy_launcher(legacy):
    out, output = legacy
    assert "epoch   2/2" in output, output
    assert_trained(out, epochs=2, ranks=2)
    chosen = [line for line in output.splitlines() if line.startswith("amp backend:")]
    assert chosen == ["amp backend: torch (auto: NVIDIA Apex is not installed)"], output
    assert "optimizer: torch.optim.SGD" in output
    state = load_checkpoint(checkpoint_epoch(out, 2))
    # fp32: the scaler is disabled
    assert state["step"] == "07_cifar10_apex" and state["scaler"] == {}


def test_under_the_legacy_launcher_it_ends_where_04_does_bit_for_bit(legacy, run04):
    out, _ = legacy
    assert [row["epoch"] for row in metrics(out)] == [1, 2]
    assert (sorted(digests(out)) == [0, 1]
            and digests(out) == digests(run04[0])), "04's code, 04's bits"


def test_bf16_autocast_resumes_bit_for_bit(tiny_data, tmp_path):
    """bf16 autocast (--amp auto's choice where the CPU computes it natively; the scaler disabled)
    on 8 images, 2 optimizer steps per epoch (a CPU without native bf16 emulates it): the legacy
    launcher's run as it was after epoch 1 (what a stopped launch leaves), resumed under torchrun,
    ends where the uninterrupted one does."""
    tiny = [*tiny_data, *SMOKE, "--epochs", "2", "--batch-size", "2", "--amp", "bf16"]
    whole = legacy_launch(2, 7, *tiny, "--out-dir", tmp_path / "whole")
    assert "amp bf16" in whole.output, whole.output
    # bf16: the scaler is disabled
    assert load_checkpoint(checkpoint_epoch(tmp_path / "whole", 2))["scaler"] == {}
    # what a legacy launch stopped after epoch 1 leaves
    as_after_epoch(tmp_path / "whole", tmp_path / "resumed", 1)
    torchrun(2, 7, *tiny, "--out-dir", tmp_path / "resumed", "--resume", "auto")
    found = digests(tmp_path / "resumed")
    assert sorted(found) == [0, 1] and found == digests(tmp_path / "whole"), (
        found, digests(tmp_path / "whole"))


def test_checkpoints_interchange_with_step_01(legacy, data, tmp_path):
    """01 continues from 07's epoch-1 checkpoint; 07 then loads 01's result to the last bit."""
    run([PYTHON, script(1), *data, *ONE, "--out-dir", tmp_path / "01",
         "--resume", checkpoint_epoch(legacy[0], 1)])
    proc = run([PYTHON, script(7), *data, *ONE, "--out-dir", tmp_path / "07",
                "--resume", checkpoint_epoch(tmp_path / "01", 2), "--amp-backend", "torch"])
    assert "resumed from epoch 2 (written by 01_cifar10_cpu)" in proc.output
    assert digests(tmp_path / "07") == digests(tmp_path / "01")


@pytest.fixture
def registry_apex(tmp_path):
    """What `pip install apex` gives: a top-level package named apex, without amp/ or
    optimizers/."""
    (tmp_path / "site" / "apex").mkdir(parents=True)
    (tmp_path / "site" / "apex" / "__init__.py").write_text("")
    return {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}


def test_registry_apex_is_named_as_the_unrelated_package(registry_apex, data, tmp_path):
    proc = run([PYTHON, script(7), *data, "--out-dir", tmp_path / "run", "--amp-backend", "apex"],
               check=False, **registry_apex)
    assert_one_line_error(proc, "--amp-backend apex needs NVIDIA Apex 25.05 or older",
                          "apex.amp does not import (No module named 'apex.amp')",
                          "the unrelated registry package (pip uninstall apex)",
                          "or use --amp-backend torch")


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

def initialize(model, optimizer, opt_level):
    # apex.amp.initialize at O2 (tag 25.05: _initialize.py, _process_optimizer.py; loss scale 1): an fp16 model with
    # fp32 batch norm and fp32 outputs; the optimizer patched to train fp32 masters, made lazily (zero_grad or
    # scale_loss, whichever comes first) from the fp16 weights it holds then, and copied into the model after each step
    assert opt_level == "O2"
    for module in model.modules():
        if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                t.data = t.data.half()
    forward, step, pairs = model.forward, optimizer.step, []
    model.forward = lambda *inputs: forward(*inputs).float()

    def lazy_init():  # lazy_init_with_master_weights
        if optimizer.stash is None:
            for group in optimizer.param_groups:
                for i, p in enumerate(group["params"]):
                    if p.dtype == torch.half:
                        group["params"][i] = master = p.detach().clone().float().requires_grad_()
                        pairs.append((p, master))
                        if p in optimizer.state:
                            optimizer.state[master] = optimizer.state.pop(p)
            optimizer.stash = pairs
            optimizer.load_state_dict(optimizer.state_dict())  # its state recast to the masters' fp32

    def new_step(self):
        step()
        for p, master in pairs:
            p.data.copy_(master.data)
            master.grad = None

    def new_zero_grad(self):
        lazy_init()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.zero_()
        for p, _ in pairs:
            if p.grad is not None:
                p.grad.zero_()

    @contextlib.contextmanager
    def scale_loss(loss, optimizer):
        lazy_init()
        yield loss
        for p, master in pairs:  # post_backward_with_master_weights: the fp16 gradients, unscaled, into fp32 ones
            master.grad = p.grad.float()

    optimizer.stash = None  # methods bound to it, as Apex's (the schedule wraps step())
    optimizer.step = types.MethodType(new_step, optimizer)
    optimizer.zero_grad = types.MethodType(new_zero_grad, optimizer)
    amp.scale_loss = scale_loss
    return model, optimizer

loaded = []  # the amp states resume() loads
amp, parallel, apex = (types.ModuleType(name) for name in ("apex.amp", "apex.parallel", "apex"))
amp.initialize, amp.load_state_dict = initialize, loaded.append
amp.state_dict = lambda: {"loss_scaler0": {"loss_scale": 1.0}}
amp.master_params = lambda optimizer: (p for g in optimizer.param_groups for p in g["params"])
parallel.DistributedDataParallel = LegacyDDP
apex.amp, apex.parallel = amp, parallel
# the step imports these as it would import Apex 25.05's
sys.modules.update({"apex": apex, "apex.amp": amp, "apex.parallel": parallel})
step = runpy.run_path(sys.argv[1], run_name="step07")
print("legacy API imported:", step["LEGACY_API"])
dist.init_process_group("gloo")
rank, cpu = dist.get_rank(), torch.device("cpu")
args = step["parse_args"](["--data-dir", "unused", "--batch-size", "8", "--workers", "0", "--amp-backend", "apex",
                           "--opt-level", "O2", "--epochs", "2", "--out-dir", sys.argv[2]])
info = data.Info(10, data.MEAN, data.STD)
torch.manual_seed(rank)  # each rank its own images (4 of 4 x 4 pixels: fp16 is slow on a CPU)
batches = [(torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8), torch.randint(0, 10, (4,))) for _ in range(2)]

def build():  # each rank its own start: the wrapper must make rank 0's the start of all
    model = step["prepare_model"](args, step["build_model"](args, info), cpu, True)
    model, optimizer, scheduler, scaler = step["build_optimizer"](args, model, 2, cpu, None, True)
    return step["Training"](model, optimizer, scheduler, scaler, cpu, None, True)

def train(training):
    meter = metrics.Meter(args, 2)
    meter.start(None, 0)
    step["train_one_epoch"](args, training, batches, types.SimpleNamespace(requested=lambda steps: False), meter)

def everything(training):  # the model's fp16 weights and fp32 buffers, the masters, the momentum
    masters, optimizer = step["master_weights"](training), training.optimizer
    return {**training.model.module.state_dict(), **{"master " + n: m for n, m in masters.items()},
            **{"momentum " + n: optimizer.state[m]["momentum_buffer"] for n, m in masters.items()}}

torch.manual_seed(rank)
run = build()
train(run)
if rank == 0:
    step["save_checkpoint"](args, run, {"epoch": 1}, info)
dist.barrier()
train(run)
whole = everything(run)
torch.manual_seed(rank + 10)
again = build()
args.resume = "auto"
step["resume"](args, again)
train(again)
resumed = everything(again)
different = [n for n in whole if not torch.equal(whole[n], resumed[n])]
args.opt_level = "O3"  # a fixed loss scale: neither saved nor loaded (a saved dynamic one would stick)
step["resume"](args, again)
path = step["save_checkpoint"](args, again, {"epoch": 9}, info) if rank == 0 else None
print(f"rank {rank} amp state loaded at O2 {len(loaded[:1])}, at O3 {len(loaded[1:])}")
if rank == 0:
    print("saved at O3:", torch.load(path, weights_only=True)["scaler"])
names = [name for name, _ in run.model.module.named_buffers() if name in whole]  # batch-norm statistics
ranks = [None, None]
dist.all_gather_object(ranks, whole)
if rank == 0:
    (mine, other) = ranks
    print("buffers", len(names), "equal" if all(torch.equal(mine[n], other[n]) for n in names) else "DIFFER")
    print("parameters", "equal" if all(torch.equal(mine[n], other[n]) for n in mine if n not in names) else "DIFFER")
    print("O2 masters:", sum(t.dtype == torch.float32 and whole[n[7:]].dtype == torch.half
                             for n, t in whole.items() if n.startswith("master ")), "fp32 copies of fp16 weights")
print(f"rank {rank} resumed:", f"{len(different)} DIFFER, e.g. {different[:3]}" if different else "equal")
dist.destroy_process_group()
"""  # noqa: E501 (a script of its own: its lines as written)


def test_the_legacy_path_at_o2_syncs_buffers_and_resumes_bit_for_bit(tmp_path):
    """With stand-ins of Apex's interface at O2 and the default model (batch norm), on 2 ranks:
    apex's DDP broadcasts parameters only, so 07's legacy lines must leave every rank with rank 0's
    buffers, as 04's DDP does; and O2 trains fp32 master weights the model holds only rounded to
    fp16, so a resumed run must restore the masters and their momentum exactly (the checkpoint holds
    them) and end as the uninterrupted run does, bit for bit."""
    stand_in = tmp_path / "apex_stand_in.py"
    stand_in.write_text(APEX_STAND_IN)
    proc = run([BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", stand_in,
                script(7), tmp_path / "out"])
    for line in ("legacy API imported: True", "buffers 60 equal", "parameters equal",
                 "O2 masters: 22 fp32 copies of fp16 weights",
                 "rank 0 resumed: equal", "rank 1 resumed: equal",
                 "rank 0 amp state loaded at O2 1, at O3 0",
                 "rank 1 amp state loaded at O2 1, at O3 0", "saved at O3: None"):
        assert line in proc.output, proc.output[-3000:]
