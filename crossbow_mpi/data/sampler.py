"""Global data order: one seeded permutation per epoch, cut into disjoint slices for every learner."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crossbow_mpi.data.datasets import DataError


class GlobalSampler:
    """Give learner j of rank r its batch for the global step that starts at `offset` in the epoch.

    With k learners per rank and b_q samples per learner on rank q, a global step takes k·Σ_q b_q consecutive
    samples of the epoch's permutation; learner j of rank r gets the b_r samples at
    offset + k·Σ_{q<r} b_q + j·b_r. No sample appears twice in an epoch, whatever k and the b_q are at each step.
    A batch size given as one number is every rank's.
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

    def batch_sizes(self, batch_size: int | Sequence[int]) -> tuple[int, ...]:
        """Return every rank's batch size."""
        sizes = (batch_size,) * self.world_size if isinstance(batch_size, int) else tuple(batch_size)
        assert len(sizes) == self.world_size, f"{len(sizes)} batch sizes for {self.world_size} ranks"
        return sizes

    def step_size(self, learners: int, batch_size: int | Sequence[int]) -> int:
        return learners * sum(self.batch_sizes(batch_size))

    def fits(self, offset: int, learners: int, batch_size: int | Sequence[int]) -> bool:
        """Tell whether a full global step starting at `offset` fits in the epoch."""
        return offset + self.step_size(learners, batch_size) <= self.num_samples

    def indices(self, epoch: int, offset: int, learners: int, batch_size: int | Sequence[int]) -> torch.Tensor:
        """Return this rank's [learners, its batch size] sample indices."""
        assert self.fits(offset, learners, batch_size)
        sizes = self.batch_sizes(batch_size)
        start = offset + learners * sum(sizes[: self.rank])
        mine = sizes[self.rank]
        return self.permutation(epoch)[start : start + learners * mine].view(learners, mine)


def fetch_batch(dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (inputs, int64 targets) for the indices: the dataset's own `get_batch`, else its items stacked;
    DataError naming the sample when the samples' or the labels' shapes differ or a label is not an integer."""
    if hasattr(dataset, "get_batch"):
        inputs, targets = dataset.get_batch(indices)
    else:
        rows = indices.tolist()
        items = [dataset[i] for i in rows]
        samples, labels = [torch.as_tensor(x) for x, _ in items], [torch.as_tensor(y) for _, y in items]
        for i, x, y in zip(rows, samples, labels, strict=True):
            if x.shape != samples[0].shape:
                raise DataError(
                    f"sample {i} of {describe(dataset)} has shape {tuple(x.shape)}, "
                    f"sample {rows[0]} has {tuple(samples[0].shape)}"
                )
            if y.shape != labels[0].shape and not y.numel() == labels[0].numel() == 1:
                raise DataError(
                    f"sample {i} of {describe(dataset)} has a label of shape {tuple(y.shape)}, "
                    f"sample {rows[0]} has {tuple(labels[0].shape)}"
                )
        scalar = labels[0].numel() == 1  # a class index, also when given as a one-element tensor
        inputs, targets = torch.stack(samples), torch.stack([y.reshape(()) if scalar else y for y in labels])
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise DataError(
            f"sample {int(indices[0])} of {describe(dataset)} has label {targets[0].item()!r} "
            f"({targets.dtype}): labels must be integer class indices"
        )
    return inputs, targets.to(torch.int64)


def describe(dataset) -> str:
    """Name a dataset in a message."""
    return f"the dataset {type(dataset).__name__}"
