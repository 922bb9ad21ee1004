"""What step 06 needs around Horovod that is not the lesson: the import, thread count, build check, SyncBatchNorm,
and sharing rank 0's run settings, position in the run and stop flag."""
import functools
import os
import sys

import torch
import torch.nn as nn

from . import cli


def load():
    """horovod.torch, or one line saying how to build it (or that it cannot use the GPU). A rank that stops because
    another rank failed (HorovodInternalError in a collective) then says so in one line instead of a traceback.
    DataLoader workers start from a forkserver: forked from this process they would inherit Horovod's threads (and,
    with MPI over InfiniBand, memory registrations), which are not fork-safe; Horovod's examples do the same."""
    try:
        import horovod.torch as hvd
    except ImportError as error:
        reason = cli.brief(str(error).strip().splitlines()[0], 120)
        raise cli.UserError(f"Horovod is not importable by {sys.executable} ({reason}): build it for this torch with "
                            f"`PYTHON={sys.executable} bash scripts/install_horovod.sh`, then run with that python") \
            from None
    if torch.cuda.is_available():
        check_gpu_build(hvd)
    cli.PEER_FAILURES.append(hvd.HorovodInternalError)
    torch.multiprocessing.set_start_method("forkserver", force=True)
    torch.multiprocessing.set_forkserver_preload(["common", "horovod.torch"])
    return hvd


def share_cores(hvd):
    """horovodrun does not set OMP_NUM_THREADS (torchrun does): the processes of one machine share its cores."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))


def share(hvd):
    """checkpoint.continue_run's share(): rank 0's value on every rank, by Horovod's broadcast."""
    return lambda value: hvd.broadcast_object(value, root_rank=0, name="run")


def broadcast_run(hvd, epoch, global_step, part_done, scheduler, scaler):
    """What Horovod's broadcasts of weights and optimizer state do not carry, from rank 0 (which alone read the
    checkpoint): the position in the run, the schedule's state and the loss scale. Returns the position."""
    epoch, global_step, part_done, schedule, scale = hvd.broadcast_object(
        (epoch, global_step, part_done, scheduler.state_dict(), scaler.state_dict()), root_rank=0, name="resume")
    scheduler.load_state_dict(schedule)
    if scale:  # {}: a disabled (bf16/fp32) scaler
        scaler.load_state_dict(scale)
    return epoch, global_step, part_done


def agree(hvd):
    """preempt.Stop's agree(): a max over ranks by Horovod's allreduce, started without waiting."""
    return lambda flag, name="stop": functools.partial(hvd.synchronize, hvd.allreduce_async(flag, op=hvd.Max, name=name))


def check_gpu_build(hvd):
    if not hvd.cuda_built():  # a CPU-only build cannot allreduce GPU tensors
        raise cli.UserError("this Horovod was built without GPU support: rebuild it with `HOROVOD_GPU_OPERATIONS=NCCL "
                            f"PYTHON={sys.executable} bash scripts/install_horovod.sh` (CUDA torch installed first)")


def sync_batchnorm(hvd, module):
    """hvd.SyncBatchNorm in place of every batch norm (Horovod has no convert_sync_batchnorm)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        sync = hvd.SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        sync.load_state_dict(module.state_dict())  # same parameter and buffer names: checkpoints do not change
        return sync.to(module.weight.device if module.affine else "cpu")
    for name, child in module.named_children():
        setattr(module, name, sync_batchnorm(hvd, child))
    return module
