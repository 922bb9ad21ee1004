"""What step 08 needs around FSDP2 that is not the lesson: the common checkpoint format in and out of the shards,
and sharded Distributed Checkpoints (DCP) written atomically.

* full_state(): the whole model and optimizer state on rank 0, as 01-07 store it (the optimizer's state keyed by
  parameter index, like torch.optim's own state_dict); load_full() puts such a checkpoint into the shards.
* save_sharded() / load_sharded(): every rank writes and reads only its shards (dcp.save / dcp.load). A save goes
  to epochNNNN.tmp and is renamed when every rank has finished, so a killed save never becomes the newest one.
  On load DCP reshards: a checkpoint written by N processes loads on M.
"""
import os
import pickle
import shutil

import torch.distributed as dist
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)

from .checkpoint import DCP_DIR, superseded

def units(model):
    """The modules that become FSDP units of their own, in forward order: the model's children that hold weights, with
    nn.Sequential and nn.ModuleList opened up (ResNet-18: the stem convolution, each residual block, the classifier;
    the cnn: each layer), batch norms left out (batch_norms()). Each unit's input is cast to the policy's dtype."""
    found = []
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            found += units(child)
        elif not isinstance(child, nn.modules.batchnorm._BatchNorm) and any(True for _ in child.parameters()):
            found.append(child)
    return found


def batch_norms(model):
    """Every batch norm (SyncBatchNorm too): FSDP units of their own, with fp32 weights."""
    return [module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]


GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU
SCATTER = StateDictOptions(full_state_dict=True)  # whole tensors in, this rank's shards kept


def _names(model):
    return [name for name, _ in model.named_parameters()]


def full_state(model, optimizer):
    """(model state, optimizer state) gathered on rank 0 (empty elsewhere). Collective: every rank calls it."""
    model_state = get_model_state_dict(model, options=GATHER)
    optim = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if not optim:
        return model_state, None
    index = {name: i for i, name in enumerate(_names(model))}
    return model_state, {"state": {index[name]: value for name, value in optim["state"].items()},
                         "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                          for group in optim["param_groups"]]}


def load_full(model, optimizer, state):
    """A checkpoint of the common format (read by every rank) into this rank's shards."""
    set_model_state_dict(model, state["model"], options=SCATTER)
    if optimizer is not None and state.get("optimizer"):
        names, optim = _names(model), state["optimizer"]
        set_optimizer_state_dict(model, optimizer, {
            "state": {names[i]: value for i, value in optim["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in optim["param_groups"]],
        }, options=SCATTER)


def full_model(model):
    """The whole model on every rank (for the weights' digest). Collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def eval_batch_size(test_images, world_size, most=512):
    """A test batch size that gives every rank's shard (sizes differ by at most one) the same number of batches:
    FSDP's forward is a collective, so a rank with one batch more would wait for the others forever."""
    shard = -(-test_images // world_size)
    batches = -(-shard // most)
    return -(-shard // batches)


def save_sharded(out_dir, tag, model, optimizer, extra, keep=3):
    """dcp.save of this rank's shards of model and optimizer, plus `extra` (any picklable dict), atomically, into
    folder `tag` (checkpoint.tag: epochNNNN or epochNNNN-stepSSSSSS); old ones go as checkpoint.superseded says."""
    final = os.path.join(out_dir, DCP_DIR, tag)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    extra = {**extra, "processes": dist.get_world_size()}  # read by checkpoint.by_progress on resume
    dcp.save({"model": model_state, "optim": optim_state, "extra": pickle.dumps(extra)}, checkpoint_id=tmp)
    dist.barrier()  # every rank's shard is written
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        folder = os.path.dirname(final)
        for old in superseded(sorted((n for n in os.listdir(folder) if not n.endswith(".tmp")), reverse=True), keep):
            shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    dist.barrier()


def latest_sharded(out_dir):
    folder = os.path.join(out_dir, DCP_DIR)
    done = sorted(n for n in os.listdir(folder) if n.startswith("epoch") and not n.endswith(".tmp")) \
        if os.path.isdir(folder) else []
    return os.path.join(folder, done[-1]) if done else None


def load_sharded(path, model, optimizer):
    """dcp.load into this rank's shards (resharded to this world size); returns the saved `extra`."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "extra": b""}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return pickle.loads(state["extra"])
