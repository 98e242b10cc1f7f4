"""Learner engines: how the k learners of a rank compute their gradients.

An engine fills `learners.grads[j]` with the gradient of learner j's loss on its own batch and returns the
losses. Algorithms only see the filled matrices, so engines (sequential, threads, CUDA streams) can be
swapped without touching them.
"""

from __future__ import annotations

from typing import Callable

import torch

from crossbow_mpi.learners import Learners

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LearnerEngine:
    """Compute every learner's gradient on its batch; subclasses choose how the learners share the device."""

    name = "base"

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn

    def compute_gradients(self, learners: Learners, batches: list[Batch]) -> torch.Tensor:
        """Fill learners.grads and return the k losses."""
        raise NotImplementedError

    def learner_step(self, learners: Learners, j: int, batch: Batch) -> torch.Tensor:
        """Run learner j's forward and backward pass on its batch; return its loss."""
        module = learners.modules[j]
        module.train()
        learners.grads[j].zero_()
        inputs, targets = batch
        loss = self.loss_fn(module(inputs), targets)
        loss.backward()
        assert learners.layout.grads_are_bound(module, learners.grads[j]), "autograd replaced a flat gradient view"
        return loss.detach()

    def close(self) -> None:
        """Release worker resources."""


class SequentialEngine(LearnerEngine):
    """Run the learners one after another on the rank's threads."""

    name = "sequential"

    def compute_gradients(self, learners: Learners, batches: list[Batch]) -> torch.Tensor:
        assert len(batches) == learners.k
        return torch.stack([self.learner_step(learners, j, batch) for j, batch in enumerate(batches)])
