"""The training order of every distributed step: common/data.py's EpochSampler over torch's
DistributedSampler, the pair 04-08 build
(`EpochSampler(DistributedSampler(train_set, shuffle=True, seed=args.seed), batch x accumulation)`;
that the steps build it so, their runs hold: tests/test_preemption.py), stated as the facts the
steps rely on: disjoint shards from one permutation that every rank computes alone from (seed,
epoch), a new one each epoch only through set_epoch, every image of the shard in every epoch (the
last optimizer step smaller), and a resumed epoch that goes on where it stopped.
"""
import torch
from torch.utils.data.distributed import DistributedSampler

from common import data

# 20 images on 2 ranks: 10 each, 4 optimizer steps, 3 of 3 images and the last of 1
N, STEP = 20, 3


def shards(world_size, epoch=1, part=None, seed=0):
    out = []
    for rank in range(world_size):
        sampler = data.EpochSampler(DistributedSampler(range(N), num_replicas=world_size, rank=rank,
                                                       shuffle=True, seed=seed), STEP)
        sampler.set_epoch(epoch, part)
        out.append(list(sampler))
    return out


def test_ranks_take_disjoint_whole_shards_of_one_permutation_computed_alone():
    # seed + epoch, no messages
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0 + 5)).tolist()
    assert shards(2, epoch=5) == [perm[0::2], perm[1::2]]
    assert set(shards(2)[0]).isdisjoint(shards(2)[1])


def test_set_epoch_reshuffles_and_the_seed_chooses_the_order():
    assert shards(2, epoch=1) != shards(2, epoch=2) and shards(2, epoch=1) == shards(2, epoch=1)
    assert shards(2, seed=0) != shards(2, seed=1)


def test_a_resumed_epoch_goes_on_after_the_steps_done():
    whole = shards(2, epoch=3)
    resumed = shards(2, epoch=3, part={"steps": 2, "of_steps": 4})
    assert resumed == [rank[2 * STEP:] for rank in whole]
    # a row of all 4 steps done: the last, smaller step again, never an empty epoch
    resumed = shards(2, epoch=3, part={"steps": 4, "of_steps": 4})
    assert resumed == [rank[3 * STEP:] for rank in whole] and all(len(r) == 1 for r in resumed)
