"""The code that a GPU runs, run on the CPU wherever the library allows it, so that CI proves it.

* --amp auto: bf16 where it is native (CPUs with AVX512-BF16 or AMX, ARM CPUs with BF16, GPUs from
  Ampere on), fp32 on other CPUs (bf16 emulated), fp16 with loss scaling on older GPUs; --amp bf16
  says when it is emulated.
* Step 03: DataParallel runs each replica in a thread of its own, which parallel_apply puts under
  autocast with `enabled` alone; a new thread's autocast dtype is the default one. The CPU shows the
  same thread state (its default is bf16), so fp16 here plays the part bf16 plays on a GPU (whose
  default is fp16).
* GradScaler in fp16 (what --amp auto gives on older GPUs): a step whose gradients overflow is
  skipped, the scale halves, and the scale travels in the checkpoint. fp16 autocast exists on this
  CPU (slowly): a few small steps.
* Step 08: its MixedPrecisionPolicy in bf16 and fp16 (ShardedGradScaler) on the CPU, as on a GPU.
"""
import re
import runpy
import threading

import pytest
import torch

from common import data
from common.cli import UserError
from helpers import SMOKE, script

# what build_data tells build_model of CIFAR-10
INFO = data.Info(num_classes=10, mean=data.MEAN, std=data.STD)


# what torch.cpu.get_capabilities() and torch.backends.cpu.get_cpu_capability() say on some CPUs
CPUS = {
    "AVX512-BF16": ({"avx2": True, "avx512_bf16": True}, "AVX512"),
    "Sapphire Rapids": ({"avx2": True, "avx512_bf16": True, "amx_bf16": True}, "AVX512"),
    "AVX2": ({"avx2": True}, "AVX2"),
    "AVX512-BF16 under ATEN_CPU_CAPABILITY=avx2": ({"avx2": True, "avx512_bf16": True}, "AVX2"),
    "AVX512 without BF16": ({"avx2": True, "avx512_f": True}, "AVX512"),
    "Graviton 3": ({"neon": True, "bf16": True}, "SVE256"),
}


@pytest.mark.parametrize("cpu,dtype,why", [
    ("AVX512-BF16", torch.bfloat16, "auto: this CPU (AVX512-BF16) computes bf16 natively"),
    ("Sapphire Rapids", torch.bfloat16,
     "auto: this CPU (AVX512-BF16 and AMX) computes bf16 natively"),
    ("AVX2", None, "auto: fp32, as this CPU (AVX2) has no native bf16 "
                   "(emulated, it would be several times slower)"),
    ("AVX512-BF16 under ATEN_CPU_CAPABILITY=avx2", None,
     "auto: fp32, as this CPU (AVX2) has no native bf16 "
     "(emulated, it would be several times slower)"),
    ("AVX512 without BF16", None, "auto: fp32, as this CPU (AVX512) has no native bf16 "
                                  "(emulated, it would be several times slower)"),
    ("Graviton 3", torch.bfloat16, "auto: this CPU (ARM BF16) computes bf16 natively"),
])
def test_auto_precision_on_a_cpu_is_what_it_computes_natively(cpu, dtype, why, monkeypatch):
    from common.cli import amp_choice

    found, isa = CPUS[cpu]
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: found)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    assert amp_choice("auto", torch.device("cpu")) == (dtype, why)
    assert amp_choice("off", torch.device("cpu")) == (None, "as asked")
    assert amp_choice("bf16", torch.device("cpu")) == (
        torch.bfloat16,
        "as asked" if dtype else f"as asked; {why.split(', as ')[1].split(' has')[0]} has no "
                                 "native bf16: emulated, several times slower than fp32")


def test_auto_precision_is_bf16_where_native_and_fp16_on_older_gpus(monkeypatch):
    from common.cli import amp_choice

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    assert amp_choice("auto", gpu) == (
        torch.float16, "auto: Tesla T4 has no native bf16, so fp16 with loss scaling")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert amp_choice("auto", gpu) == (torch.bfloat16, "auto: NVIDIA H100 computes bf16 natively")
    assert amp_choice("fp16", gpu)[0] == torch.float16 and amp_choice("off", gpu)[0] is None
    with pytest.raises(UserError, match="--amp fp16 needs a GPU"):
        amp_choice("fp16", torch.device("cpu"))


def in_a_replica_thread(module, images):
    """What DataParallel's parallel_apply does for each replica (torch 2.13,
    nn/parallel/parallel_apply.py): a new thread that enters
    `torch.amp.autocast(device_type, enabled=<the caller's>)` (no dtype) and calls the replica."""
    enabled, out = torch.is_autocast_enabled("cpu"), {}

    def worker():
        with torch.amp.autocast("cpu", enabled=enabled):
            out["logits"] = module(images)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return out["logits"]


HOOK = re.compile(r"model\.module\.register_forward_pre_hook\(\s*lambda module, inputs: "
                  r"torch\.set_autocast_dtype\(device\.type, amp_dtype\)\)")


def test_03_replicas_compute_in_the_runs_dtype_in_their_threads(tmp_path):
    step = runpy.run_path(script(3), run_name="step03")
    hook = HOOK.search(open(script(3)).read())
    assert hook, "step 03's main() sets the run's dtype in every replica"
    args = step["parse_args"](["--data-dir", str(tmp_path), *SMOKE])
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.float16):
        # The cause: a replica thread started under autocast computes in the thread's default
        # dtype (the CPU's bf16).
        assert in_a_replica_thread(step["build_model"](args, INFO), images).dtype == torch.bfloat16
        model = step["prepare_model"](args, step["build_model"](args, INFO), torch.device("cpu"))
        exec(hook.group(0), {"torch": torch, "model": model, "device": torch.device("cpu"),
                    "amp_dtype": torch.float16})
        # The fix: the replica (a copy of model.module, with its hooks) sets the run's dtype
        # before its forward.
        assert in_a_replica_thread(model.module, images).dtype == torch.float16
        # and the passthrough in this thread is unchanged
        assert model(images).dtype == torch.float16


class NoStop:
    """In place of preempt.Stop: no signal is ever asked about."""

    def requested(self, steps):
        return False


def one_epoch(step, args, training, epoch, count=4):
    """Step `step`'s train_one_epoch of `training` (its Training) over one epoch of one optimizer
    step (4 images)."""
    from common import metrics
    from synthetic import make_images

    images, labels = make_images(count, seed=0, kind="easy")
    dataset = data.CIFAR10Tensors(images, labels, train=True)
    distributed = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0)
    sampler = data.EpochSampler(distributed, args.batch_size)
    loader = torch.utils.data.DataLoader(sampler.sampler.dataset, batch_size=args.batch_size,
                                         sampler=sampler)
    meter = metrics.Meter(args, 1)
    meter.start(None, sampler.set_epoch(epoch))
    return step["train_one_epoch"](args, training, loader, NoStop(), meter)


def overflowing(scaler, scale=2.0 ** 40):
    """The scaler with a scale so large that fp16 gradients overflow:
    the first step must be skipped."""
    scaler.load_state_dict({**scaler.state_dict(), "scale": scale})
    return scaler


def weights(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_scaler_skips_an_overflow_then_steps(train, scaler, full_weights):
    """train(epoch): one optimizer step of fp16 autocast through a step's train_one_epoch. With a
    scale so large that the gradients overflow, the step is skipped and the scale halves (update(),
    which also fails if step() went around the scaler); with one that fits, the step is taken and
    the weights move, finitely."""
    before = full_weights()
    overflowing(scaler)
    train(1)  # one step of 4 images, with gradients scaled by 2**40: inf in fp16
    assert scaler.get_scale() == 2.0 ** 39, "an overflow halves the scale"
    assert all(torch.equal(before[name], tensor) for name, tensor in full_weights().items()), (
        "and skips the step")
    overflowing(scaler, 2.0 ** 8)
    train(2)  # a scale that fits: the step is taken
    moved = (full_weights()["classifier.weight"] - before["classifier.weight"]).abs().max().item()
    assert scaler.get_scale() == 2.0 ** 8 and 0 < moved < 1, f"the classifier moved by {moved}"


def test_grad_scaler_skips_an_overflowing_fp16_step_and_its_scale_travels_in_the_checkpoint(
        tmp_path):
    step = runpy.run_path(script(1), run_name="step01")
    args = step["parse_args"](["--data-dir", str(tmp_path), *SMOKE, "--batch-size", "4",
                               "--out-dir", str(tmp_path)])
    cpu, fp16 = torch.device("cpu"), torch.float16
    model = step["prepare_model"](args, step["build_model"](args, INFO), cpu)
    optimizer, scheduler, scaler = step["build_optimizer"](args, model, 1, cpu, fp16)
    assert scaler.is_enabled(), "fp16 turns on step 01's GradScaler"
    training = step["Training"](model, optimizer, scheduler, scaler, cpu, fp16)
    train = lambda epoch: one_epoch(step, args, training, epoch)  # noqa: E731
    assert_scaler_skips_an_overflow_then_steps(train, scaler, lambda: weights(model))
    path = step["save_checkpoint"](args, training, {"epoch": 2}, INFO)
    model2 = step["prepare_model"](args, step["build_model"](args, INFO), cpu)
    optimizer2, scheduler2, scaler2 = step["build_optimizer"](args, model2, 1, cpu, fp16)
    args.resume = path
    training2 = step["Training"](model2, optimizer2, scheduler2, scaler2, cpu, fp16)
    assert step["resume"](args, training2)[0] == 2
    assert scaler2.state_dict() == scaler.state_dict() and scaler2.get_scale() == 2.0 ** 8


@pytest.fixture
def group_of_one(monkeypatch):
    """A gloo process group of one process in this one, as a launcher would set it up."""
    import torch.distributed as dist

    from launchers import free_port

    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_08_policy_computes_in_bf16_with_batch_norm_in_fp32_on_the_cpu(group_of_one, tmp_path):
    """The bf16 MixedPrecisionPolicy with the default model: uint8 images in, bf16 convolutions,
    fp32 batch norm (weights beside its fp32 statistics), fp32 logits, and a backward that goes
    through."""
    step = runpy.run_path(script(8), run_name="step08")
    args = step["parse_args"](["--data-dir", str(tmp_path), "--arch", "resnet18"])
    model = step["prepare_model"](args, step["build_model"](args, INFO), torch.device("cpu"),
                                  torch.bfloat16)
    seen = {}
    for name in ("conv1", "bn1", "linear", "layers.0.conv1", "layers.0.bn1"):
        module = model.get_submodule(name)
        module.register_forward_pre_hook(lambda m, inputs, name=name: seen.update(
            {name: (inputs[0].dtype, m.weight.dtype)}))
    logits = model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8))
    bf16, fp32 = torch.bfloat16, torch.float32
    assert seen == {"conv1": (bf16, bf16), "bn1": (bf16, fp32), "linear": (bf16, bf16),
                    "layers.0.conv1": (bf16, bf16), "layers.0.bn1": (bf16, fp32)}, seen
    assert logits.dtype == fp32
    logits.sum().backward()
    assert all(p.grad is not None and p.dtype == fp32 for p in model.parameters()), (
        "fp32 shards for the optimizer")
    # one row (--replicate 1) is plain FSDP: a 2-D mesh would all-reduce each unit over one rank
    assert {p.device_mesh.ndim for p in model.parameters()} == {1}


# scripts/fsdp_units.py's choices, measured on docs/08-fsdp.md: units (with the root) of ResNet-18.
OTHER_UNITS = {"blocks": 31, "stages": 6, "whole": 3}


@pytest.mark.parametrize("choice", OTHER_UNITS)
def test_08_with_the_other_units_it_was_measured_against_trains_in_bf16(group_of_one, tmp_path,
                                                                         choice):
    """The choices docs/08-fsdp.md measures 08's against, as scripts/fsdp_units.py makes them:
    blocks (08 until 2026-11-29: the stem, each residual block, the head and each batch norm a
    unit), stages (the four residual stages, the batch norms one unit) and whole (one unit of all
    the layers), each with the root; each computes in bf16, batch norm in fp32, and trains."""
    import importlib.util

    from helpers import REPO

    loaded = []
    for name, path in [("units", REPO / "scripts" / "fsdp_units.py"), ("step08", script(8))]:
        spec = importlib.util.spec_from_file_location(name, path)
        loaded.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(loaded[-1])
    wrapper, step = loaded
    wrapper.CHOICES[choice](step)
    args = step.parse_args(["--data-dir", str(tmp_path), "--arch", "resnet18"])
    model = step.prepare_model(args, step.build_model(args, INFO), torch.device("cpu"),
                               torch.bfloat16)
    states = {id(m._get_fsdp_state()) for m in model.modules() if hasattr(m, "_get_fsdp_state")}
    assert len(states) == OTHER_UNITS[choice], (choice, len(states))
    assert model.get_submodule("bn1").weight.dtype == torch.float32
    model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_08_fp16_policy_with_sharded_grad_scaler_skips_an_overflowing_step(group_of_one, tmp_path):
    """As 07's below, with FSDP's ShardedGradScaler; its scale travels in the DCP checkpoint, which
    is the newest complete one as soon as its background write ends."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    step = runpy.run_path(script(8), run_name="step08")
    args = step["parse_args"](["--data-dir", str(tmp_path), *SMOKE, "--batch-size", "4",
                               "--out-dir", str(tmp_path)])
    cpu, fp16 = torch.device("cpu"), torch.float16

    def build():
        model = step["prepare_model"](args, step["build_model"](args, INFO), cpu, fp16)
        optimizer, scheduler, scaler = step["build_optimizer"](args, model, 1, cpu, fp16)
        return step["Training"](model, optimizer, scheduler, scaler, cpu, fp16)

    training = build()
    scaler = training.scaler
    assert isinstance(scaler, ShardedGradScaler) and scaler.is_enabled()
    train = lambda epoch: one_epoch(step, args, training, epoch)  # noqa: E731
    # with one rank the whole state dict holds the live tensors: clone them
    whole = lambda: {k: v.clone() for k, v in step["get_model_state_dict"](  # noqa: E731
        training.model, options=step["WHOLE"]).items()}
    assert_scaler_skips_an_overflow_then_steps(train, scaler, whole)
    saving = torch.distributed.new_group(backend="gloo")
    step["save_checkpoint"](args, training, {"epoch": 2}, INFO, saving).result()
    # written in the background, it is the newest complete checkpoint once its write ends
    assert (tmp_path / "dcp" / "epoch0002" / ".metadata").is_file()
    assert not list(tmp_path.glob("*.pt")), "08 writes DCP folders only"
    training2 = build()
    args.resume = "auto"  # the DCP folder it just wrote
    assert step["resume"](args, training2)[0] == 2
    assert training2.scaler.state_dict() == scaler.state_dict()
    assert training2.scaler.get_scale() == 2.0 ** 8


def test_07_torch_path_with_fp16_skips_an_overflowing_step_and_its_scale_travels_in_the_checkpoint(
        group_of_one, tmp_path):
    """Step 07's own successors of apex.amp (autocast + GradScaler around torch DDP), in fp16 as on
    a GPU without native bf16: the scaler skips, halves, steps unscaled, and its scale is saved and
    resumed."""
    step = runpy.run_path(script(7), run_name="step07")
    args = step["parse_args"](["--data-dir", str(tmp_path), *SMOKE, "--batch-size", "4",
                               "--amp-backend", "torch", "--out-dir", str(tmp_path)])
    cpu, fp16 = torch.device("cpu"), torch.float16

    def build():
        model = step["prepare_model"](args, step["build_model"](args, INFO), cpu, False)
        model, optimizer, scheduler, scaler = step["build_optimizer"](args, model, 1, cpu, fp16,
                                                                      False)
        return step["Training"](model, optimizer, scheduler, scaler, cpu, fp16, False)

    training = build()
    scaler = training.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled(), (
        "fp16 turns on 07's GradScaler")
    train = lambda epoch: one_epoch(step, args, training, epoch)  # noqa: E731
    assert_scaler_skips_an_overflow_then_steps(train, scaler,
                                               lambda: weights(training.model.module))
    path = step["save_checkpoint"](args, training, {"epoch": 2}, INFO)
    training2 = build()
    args.resume = path
    assert step["resume"](args, training2)[0] == 2
    assert training2.scaler.state_dict() == scaler.state_dict()
    assert training2.scaler.get_scale() == 2.0 ** 8


def test_08_units_are_runs_of_layers_computing_in_bf16_reducing_in_fp32_resharded_after_forward(
        group_of_one, tmp_path):
    """08's policy, read off the model it builds (ResNet-18 in bf16, as a GPU runs it): the units
    are runs of consecutive layers of at least a quarter of the weights (the stem to layers.6.conv1
    hold 35%, the rest 65%; a last run under a quarter would join the one before), the 20 batch
    norms one fp32 unit, and the root; every unit of weights computes in bf16 and reduces its
    gradients in fp32; after its forward each unit holds only its shards again
    (reshard_after_forward), so a GPU holds one unit's whole weights at a time."""
    from torch.distributed.tensor import DTensor

    step = runpy.run_path(script(8), run_name="step08")
    args = step["parse_args"](["--data-dir", str(tmp_path), "--arch", "resnet18"])
    model = step["prepare_model"](args, step["build_model"](args, INFO), torch.device("cpu"),
                                  torch.bfloat16)
    groups = {}  # modules that share an FSDP state are one unit (torch 2.13's FSDP2, private)
    for name, module in model.named_modules():
        if hasattr(module, "_get_fsdp_state"):
            groups.setdefault(id(module._get_fsdp_state()), set()).add(name)
    norms = {name for name, module in model.named_modules()
             if isinstance(module, torch.nn.BatchNorm2d)}
    last = {"layers.6.conv2", "layers.6.shortcut.0", "layers.7.conv1", "layers.7.conv2", "linear"}
    first = {name for name, module in model.named_modules()
             if isinstance(module, torch.nn.Conv2d)} - last
    assert "layers.6.conv1" in first and len(first) == 16
    assert sorted(groups.values(), key=sorted) == sorted([{""}, first, last, norms], key=sorted), (
        groups)
    for name in ["conv1", "linear", "layers.7.conv2"]:
        policy = model.get_submodule(name)._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), (
            name, policy)
    model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8))
    whole = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not whole, f"still whole after the forward: {whole}"
