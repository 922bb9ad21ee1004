"""What the DistributedSampler does, stated as facts (the seed tutorials teach these by printing).

Step 04 relies on each of them: disjoint shards, padding so every rank gets the same number of
samples, a new permutation per epoch only through set_epoch, and drop_last trimming instead.
"""
import torch
from torch.utils.data.distributed import DistributedSampler

N = 10  # does not divide by 3 ranks


def shards(world_size, epoch=0, **kwargs):
    out = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(N), num_replicas=world_size, rank=rank, seed=0, **kwargs)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_shards_are_disjoint_and_cover_the_data():
    parts = shards(2)
    assert set(parts[0]).isdisjoint(parts[1])
    assert sorted(parts[0] + parts[1]) == list(range(N))


def test_uneven_data_is_padded_with_repeats():
    parts = shards(3)
    assert [len(p) for p in parts] == [4, 4, 4]  # ceil(10 / 3)
    flat = sum(parts, [])
    assert set(flat) == set(range(N)) and len(flat) - len(set(flat)) == 2  # two samples seen twice


def test_drop_last_trims_instead_of_padding():
    parts = shards(3, drop_last=True)
    assert [len(p) for p in parts] == [3, 3, 3]
    flat = sum(parts, [])
    assert len(set(flat)) == 9  # one sample left out this epoch, none repeated


def test_set_epoch_reshuffles_and_forgetting_it_repeats_the_order():
    assert shards(2, epoch=0) != shards(2, epoch=1)
    sampler = DistributedSampler(range(N), num_replicas=2, rank=0, seed=0)
    assert list(sampler) == list(sampler)  # no set_epoch: every epoch the same order


def test_ranks_agree_on_the_permutation_without_communicating():
    """Every rank computes the same permutation from (seed, epoch); rank r takes every world-th item."""
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0 + 5)).tolist()
    assert shards(2, epoch=5) == [perm[0::2], perm[1::2]]
