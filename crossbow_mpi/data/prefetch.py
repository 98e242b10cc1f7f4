"""Batches on the device: fetched from the sampler's order, and on a GPU copied one step ahead.

On a GPU, `prefetch` copies the next step's batches from pinned host memory on a copy stream while the
learners compute the current step; `batches` hands them out once the current stream waits for the copy. A
prefetched step whose position no longer matches (a new epoch, another number of learners) is fetched again.
On a CPU there is nothing to overlap: `batches` fetches, `prefetch` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crossbow_mpi.data.sampler import GlobalSampler, fetch_batch

Batch = tuple[torch.Tensor, torch.Tensor]


def to_format(inputs: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Return a batch's inputs in the learners' memory format (4-D inputs only)."""
    return inputs.contiguous(memory_format=torch.channels_last) if channels_last and inputs.dim() == 4 else inputs


def to_device(batch: Batch, device: torch.device, dtype: torch.dtype, channels_last: bool = False) -> Batch:
    """Move a batch to the device (floating inputs as `dtype`, 4-D ones channels-last with `channels_last`): from
    pinned host memory, without blocking, on a GPU."""
    inputs, targets = batch
    if inputs.is_floating_point():
        inputs = to_format(inputs.to(dtype=dtype), channels_last)
    if device.type == "cuda":
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


class BatchPrefetcher:
    """Give this rank's learners their batches for a global step, prefetched one step ahead on a GPU."""

    def __init__(
        self, dataset, sampler: GlobalSampler, device: torch.device, dtype: torch.dtype, channels_last: bool = False
    ):
        self.dataset = dataset
        self.channels_last = channels_last
        self.sampler = sampler
        self.device = device
        self.dtype = dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead: tuple[tuple, list[Batch], torch.cuda.Event] | None = None
        self.step_bytes = 0
        """The bytes of the last step's batches fetched."""

    @property
    def held_bytes(self) -> int:
        """The bytes of batches held at once: a step's, and on a GPU the next step's beside it."""
        return self.step_bytes * (1 if self.stream is None else 2)

    def batches(self, epoch: int, offset: int, learners: int, batch_size: int | Sequence[int]) -> list[Batch]:
        """Return the k batches of the step at `offset` of `epoch`, ready for work on the current stream."""
        position = (epoch, offset, learners, batch_size)
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] != position:
            return self._fetch(position)
        _, batches, copied = ahead
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        for batch in batches:
            for tensor in batch:
                tensor.record_stream(current)
        return batches

    def prefetch(self, epoch: int, offset: int, learners: int, batch_size: int | Sequence[int]) -> None:
        """Start copying the batches of the step at `offset` of `epoch`, if it fits in the epoch (GPU only)."""
        if self.stream is None or not self.sampler.fits(offset, learners, batch_size):
            return
        position = (epoch, offset, learners, batch_size)
        with torch.cuda.stream(self.stream):
            batches = self._fetch(position)
        self.ahead = (position, batches, self.stream.record_event())

    def _fetch(self, position: tuple) -> list[Batch]:
        indices = self.sampler.indices(*position)
        batches = [
            to_device(fetch_batch(self.dataset, row), self.device, self.dtype, self.channels_last) for row in indices
        ]
        self.step_bytes = sum(t.numel() * t.element_size() for batch in batches for t in batch)
        return batches
