"""How long step 08's checkpoint stops training: a synchronous DCP save against an asynchronous one.

    python scripts/save_stall.py [--processes 2] [--arch resnet18] [--repeats 3]

Starts --processes CPU processes (gloo), builds step 08's model, optimizer and process groups with
08's own functions and its default flags (ResNet-18, --amp auto), takes one optimizer step (so the
momentum exists), then times, on rank 0, what each way of saving keeps the loop waiting for:
`dcp.save` (every shard written before it returns), `dcp.async_save` (returns once the state is
staged in memory; the writing goes on in the background: its total is shown beside it), and the
whole state gathered for a checkpoint-epochNNNN.pt, which 08 no longer writes (get_model_state_dict
and get_optimizer_state_dict with full_state_dict, and rank 0's torch.save). The median of
--repeats.
Its output is the table in docs/08-fsdp.md (tests/docs_outputs.py runs it again).
"""
import argparse
import os
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `common` and `launchers`
sys.path.insert(0, str(REPO / "scripts"))
import launchers  # noqa: E402
from common import data  # noqa: E402

# What build_model needs to know of the data (none is read).
INFO = data.Info(num_classes=10, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args(argv)


def timed(fn):
    """(seconds, result) of fn(), every rank having started together."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def rank(index, args, port, folder, results):
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(args.processes),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    step = runpy.run_path(str(REPO / "08_cifar10_fsdp.py"), run_name="save_stall")
    flags = step["parse_args"](["--arch", args.arch, "--data-dir", folder])
    device, amp_dtype, _, _ = step["setup"](flags)
    saving = dist.new_group(backend="gloo")  # as 08: async_save's own gloo group
    info = INFO
    model = step["prepare_model"](flags, step["build_model"](flags, info), device, amp_dtype)
    optimizer, scheduler, scaler = step["build_optimizer"](flags, model, 10, device, amp_dtype)
    model(torch.randint(0, 255, (8, 3, 32, 32), dtype=torch.uint8)).float().sum().backward()
    optimizer.step()
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rows = {"dcp.save": [], "dcp.async_save": [], "background writing": [],
            "gathered .pt (scripts/dcp_to_pt.py's, not 08's)": []}
    for repeat in range(args.repeats):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        seconds, _ = timed(lambda: dcp.save(state, checkpoint_id=f"{folder}/sync{repeat}"))
        rows["dcp.save"].append(seconds)
        seconds, writing = timed(lambda: dcp.async_save(
            state, checkpoint_id=f"{folder}/async{repeat}", process_group=saving))
        start = time.perf_counter()
        writing.result()
        rows["dcp.async_save"].append(seconds)
        rows["background writing"].append(seconds + time.perf_counter() - start)

        def gathered():
            model_whole = get_model_state_dict(model, options=whole)
            optim_whole = get_optimizer_state_dict(model, optimizer, options=whole)
            if dist.get_rank() == 0:
                torch.save({"model": model_whole, "optimizer": optim_whole},
                           f"{folder}/whole{repeat}.pt")
        rows["gathered .pt (scripts/dcp_to_pt.py's, not 08's)"].append(timed(gathered)[0])
    if index == 0:
        results.update({k: statistics.median(v) for k, v in rows.items()})
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank, (args, launchers.free_port(), folder, results), nprocs=args.processes)
        parameters = sum(p.numel() for p in
                         runpy.run_path(str(REPO / "08_cifar10_fsdp.py"), run_name="x")
                         ["ARCHS"][args.arch](num_classes=INFO.num_classes, mean=INFO.mean,
                                                  std=INFO.std).parameters())
        print(f"step 08, {args.arch} ({parameters / 1e6:.1f} M parameters, fp32 weights and "
              f"momentum), {args.processes} CPU processes (gloo), median of {args.repeats}:")
        print("| save | seconds the training loop waits (rank 0) |\n|---|---|")
        for what, seconds in results.items():
            note = " (not a wait: the writing after async_save returned)" if (
                what == "background writing") else ""
            print(f"| {what} | {seconds:.2f}{note} |")


if __name__ == "__main__":
    main()
