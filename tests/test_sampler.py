"""DistributedSampler: every index once per epoch across ranks, new shuffles per epoch, exact eval."""
import numpy as np
import pytest

from hpcpar.data.sampler import DistributedSampler


@pytest.mark.parametrize("n, replicas", [(20, 4), (23, 4), (7, 2), (5, 1), (3, 4)])
def test_every_index_once_per_epoch_with_padding(n, replicas):
    for epoch in range(3):
        shards = []
        for rank in range(replicas):
            sampler = DistributedSampler(n, replicas, rank, seed=5)
            sampler.set_epoch(epoch)
            shards.append(sampler.indices())
        assert len({len(s) for s in shards}) == 1, "every rank gets the same count"
        together = np.concatenate(shards)
        assert sorted(set(together.tolist())) == list(range(n))
        assert len(together) - n == (-n) % replicas, "padding only to the next multiple"


@pytest.mark.parametrize("n, replicas", [(23, 4), (20, 4)])
def test_drop_last_gives_disjoint_equal_shards(n, replicas):
    shards = [DistributedSampler(n, replicas, r, drop_last=True).indices() for r in range(replicas)]
    together = np.concatenate(shards)
    assert len(together) == len(set(together.tolist())) == n - n % replicas


def test_shuffles_differ_between_epochs_and_agree_between_ranks():
    a, b = DistributedSampler(100, 2, 0, seed=1), DistributedSampler(100, 2, 1, seed=1)
    first = a.indices()
    a.set_epoch(1)
    assert not np.array_equal(first, a.indices())
    b.set_epoch(1)
    assert set(a.indices()).isdisjoint(b.indices())


def test_eval_indices_count_each_sample_exactly_once():
    n, replicas = 23, 4
    shards = [DistributedSampler(n, replicas, r).eval_indices() for r in range(replicas)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert DistributedSampler(n, replicas, 0).eval_batches(2) == 3


def test_next_batch_walks_epochs_and_resumes_from_state():
    sampler = DistributedSampler(10, 2, 0, seed=3)
    seen = [sampler.next_batch(2) for _ in range(4)]  # 5 per rank: 2 batches, then epoch 1
    assert sampler.epoch == 1
    resumed = DistributedSampler(10, 2, 0)
    resumed.load_state_dict(sampler.state_dict())
    assert np.array_equal(resumed.next_batch(2), sampler.next_batch(2))
    assert len(seen) == 4


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        DistributedSampler(10, 4, 4)
    with pytest.raises(ValueError, match="batch size 6 per rank exceeds the 5"):
        DistributedSampler(10, 2, 0).next_batch(6)
