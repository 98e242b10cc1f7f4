"""Global data order: disjoint slices for every learner of every rank, no sample twice in an epoch."""

import torch

from crossbow_mpi.data.sampler import GlobalSampler


def epoch_slices(num_samples, world_size, learner_counts, batch_size, epoch=0, seed=5):
    samplers = [GlobalSampler(num_samples, seed, rank, world_size) for rank in range(world_size)]
    offset, seen = 0, []
    for k in learner_counts:
        if not samplers[0].fits(offset, k, batch_size):
            break
        for sampler in samplers:
            seen.append(sampler.indices(epoch, offset, k, batch_size))
        offset += samplers[0].step_size(k, batch_size)
    return torch.cat([s.reshape(-1) for s in seen])


def test_no_sample_twice_in_an_epoch_even_when_k_changes():
    seen = epoch_slices(1000, world_size=4, learner_counts=[1, 2, 3, 3, 1, 2, 4, 4, 4], batch_size=5)
    assert len(seen) == len(set(seen.tolist())) == 5 * 4 * 24


def test_steps_cover_the_permutation_in_rank_then_learner_order():
    sampler = GlobalSampler(48, seed=1, rank=1, world_size=2)
    order = sampler.permutation(0)
    assert torch.equal(sampler.indices(0, 0, 3, 4), order[12:24].view(3, 4))
    assert torch.equal(sampler.indices(0, 24, 3, 4), order[36:48].view(3, 4))
    assert not sampler.fits(48, 1, 1)


def test_each_epoch_has_its_own_seeded_permutation():
    a, b = GlobalSampler(100, 3, 0, 1), GlobalSampler(100, 3, 0, 1)
    assert torch.equal(a.permutation(2), b.permutation(2))
    assert not torch.equal(a.permutation(0), a.permutation(1))
    assert sorted(a.permutation(4).tolist()) == list(range(100))
