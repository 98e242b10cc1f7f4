"""What every algorithm shares: the central model, the learners, the communicator and one sync message."""

from __future__ import annotations

import torch

from crossbow_mpi.comm import Communicator
from crossbow_mpi.config import Config
from crossbow_mpi.learners import CentralModel, Learners


class Algorithm:
    """Update learners and the central model once every learner's gradient is in `learners.grads`."""

    name = "base"

    def __init__(self, config: Config, comm: Communicator, central: CentralModel, learners: Learners):
        self.config = config
        self.comm = comm
        self.central = central
        self.learners = learners
        self.message = torch.empty(0)
        """The sync message, allocated once."""

    def step(self, lr: float) -> None:
        """Apply one iteration's update and synchronisation."""
        raise NotImplementedError

    def on_lr_drop(self) -> None:
        """React to a learning-rate drop."""

    def drain(self) -> None:
        """Finish outstanding communication, so that every rank holds the same, complete state."""

    def statistics(self) -> dict:
        """Return fields for the next evaluation record, the same on every rank."""
        return {}

    def allreduce_with_buffers(self, rows: torch.Tensor) -> torch.Tensor:
        """Allreduce [sum of the learners' rows | mean of the learners' float buffers] as one message; return the
        first part.

        BatchNorm running statistics follow one rule for every algorithm: z's buffers become the mean of
        all learners' buffers (over every learner of every rank) at each sync.
        """
        num_params = rows.shape[1]
        if self.message.numel() != num_params + self.central.buffers.numel():
            self.message = rows.new_empty(num_params + self.central.buffers.numel())
        message = self.message
        torch.sum(rows, 0, out=message[:num_params])
        torch.sum(self.learners.buffers, 0, out=message[num_params:]).div_(self.learners.k * self.comm.size)
        self.comm.allreduce_sum_(message)
        self.central.buffers.copy_(message[num_params:])
        return message[:num_params]
