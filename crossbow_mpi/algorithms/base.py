"""What every algorithm shares: the central model, the learners, the communicator and one sync message."""

from __future__ import annotations

import torch

from crossbow_mpi.comm import Communicator
from crossbow_mpi.config import Config
from crossbow_mpi.learners import CentralModel, Learners


class Algorithm:
    """Update learners and the central model once every learner's gradient is in `learners.grads`.

    A step has two parts. `prepare(rows, lr)` is each learner's own: it updates what the equations let a
    learner update alone and stages the learner's part of the sync message in its row of `staged`.
    `sync(lr)` sums the staged rows into one message, allreduces it and updates the central model. The
    stream engine runs `prepare` per learner on the learner's CUDA stream and `sync` on a sync stream;
    elsewhere `step` runs both for all learners at once.
    """

    name = "base"
    overlaps_sync = False
    """Whether a learner's next forward pass may run during the sync: true when the sync writes nothing a
    learner reads before its own `prepare`."""

    def __init__(self, config: Config, comm: Communicator, central: CentralModel, learners: Learners):
        self.config = config
        self.comm = comm
        self.central = central
        self.learners = learners
        self.staged = torch.empty(0)
        """Row j: learner j's part of the sync message [its rows' part | its float buffers]."""
        self.message = torch.empty(0)
        """The sync message: the sum of the staged rows."""

    def step(self, lr: float) -> None:
        """Apply one iteration's update and synchronisation."""
        self.allocate_message()
        self.prepare(slice(None), lr)
        self.sync(lr)

    def allocate_message(self) -> None:
        """(Re)allocate the staged rows and the message for the current number of learners, before `prepare`
        (on a GPU: on the stream that every learner's and the sync stream wait for)."""
        weights = self.learners.weights
        if self.staged.shape != weights.shape:
            self.staged = weights.new_empty(weights.shape)
            self.message = weights.new_empty(weights.shape[1])

    def prepare(self, rows: slice, lr: float) -> None:
        """Run the learners' own part of the step for the learners in `rows`, staging their sync message rows."""
        raise NotImplementedError

    def sync(self, lr: float) -> None:
        """Reduce the staged rows over the learners and ranks and update the central model (and learners)."""
        raise NotImplementedError

    def on_lr_drop(self) -> None:
        """React to a learning-rate drop."""

    def drain(self) -> None:
        """Finish outstanding communication, so that every rank holds the same, complete state."""

    def statistics(self) -> dict:
        """Return fields for the next evaluation record, the same on every rank."""
        return {}

    def staged_rows(self, rows: slice) -> torch.Tensor:
        """Return the staged rows' first part (one column per parameter), staging the learners' buffers beside it."""
        learners = self.learners
        assert self.staged.shape == learners.weights.shape, "allocate_message() before prepare()"
        num_params = learners.layout.num_params
        self.staged[rows, num_params:] = learners.buffers[rows]
        return self.staged[rows, :num_params]

    def allreduce_staged(self) -> torch.Tensor:
        """Allreduce [sum of the staged rows' first parts | mean of the learners' buffers] as one message; return
        the first part.

        BatchNorm running statistics follow one rule for every algorithm: z's buffers become the mean of
        all learners' buffers (over every learner of every rank) at each sync.
        """
        num_params, message = self.learners.layout.num_params, self.message
        torch.sum(self.staged, 0, out=message)
        message[num_params:].div_(self.learners.k * self.comm.size)
        self.comm.allreduce_sum_(message)
        self.central.buffers.copy_(message[num_params:])
        return message[:num_params]
