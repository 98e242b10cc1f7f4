"""Global data order: one seeded permutation per epoch, cut into disjoint slices for every learner."""

from __future__ import annotations

import torch


class GlobalSampler:
    """Give learner j of rank r its batch for the global step that starts at `offset` in the epoch.

    A global step takes k·P·b consecutive samples of the epoch's permutation; learner j of rank r gets
    the b samples at offset + (r·k + j)·b. No sample appears twice in an epoch, whatever k is at each step.
    """

    def __init__(self, num_samples: int, seed: int, rank: int, world_size: int):
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._permutation = torch.randperm(self.num_samples, generator=generator)
            self._epoch = epoch
        return self._permutation

    def step_size(self, learners: int, batch_size: int) -> int:
        return learners * self.world_size * batch_size

    def fits(self, offset: int, learners: int, batch_size: int) -> bool:
        """Tell whether a full global step starting at `offset` fits in the epoch."""
        return offset + self.step_size(learners, batch_size) <= self.num_samples

    def indices(self, epoch: int, offset: int, learners: int, batch_size: int) -> torch.Tensor:
        """Return this rank's [learners, batch_size] sample indices."""
        assert self.fits(offset, learners, batch_size)
        start = offset + self.rank * learners * batch_size
        return self.permutation(epoch)[start:start + learners * batch_size].view(learners, batch_size)


def fetch_batch(dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (inputs, targets) for the indices: the dataset's own `get_batch`, else its items stacked."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    items = [dataset[i] for i in indices.tolist()]
    return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.as_tensor([int(y) for _, y in items])
