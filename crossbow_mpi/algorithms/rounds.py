"""What the asynchronous algorithms share: rounds of data positions handed out by the model server (transport
`server`, crossbow_mpi.transports.model_server), so that every group of ranks steps at its own pace within a round."""

from __future__ import annotations

from crossbow_mpi.algorithms.base import Algorithm
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.state import HyperParams
from crossbow_mpi.transports.model_server import ModelServer


class RoundsAlgorithm(Algorithm):
    """Steps in rounds: `begin_round` gives this group its first position, each `sync` sets `next_position`, and
    `end_round` waits for every group."""

    transport: ModelServer
    transport_kind = "server"
    rounds = True

    def __init__(self, hp: HyperParams, transport: ModelServer, central: CentralModel, learners: Learners):
        super().__init__(hp, transport, central, learners)
        self.group_step = 0
        """Samples of one step of this group in the current round."""
        self.next_position: int | None = None
        """Where this group's next step in the round starts (None: the round is taken)."""

    def begin_round(self, offset: int, end: int, limit: int, learners: int, batch_sizes: tuple[int, ...]) -> int | None:
        """Start a round of the epoch's samples from `offset` to `end` (collective); return this group's first
        position, or None."""
        size = self.transport.group.size
        group_steps = [learners * sum(batch_sizes[g * size : (g + 1) * size]) for g in range(self.transport.groups)]
        self.group_step = group_steps[self.transport.group_index]
        return self.transport.begin_round(offset, end, limit, group_steps)

    def batch_sizes(self, batch_size: int | tuple[int, ...]) -> tuple[int, ...]:
        """Return every rank's batch size (of `--batch-size`, one for every rank or one per rank)."""
        size = self.transport.data.size
        return (batch_size,) * size if isinstance(batch_size, int) else tuple(batch_size)

    def group_batch_sizes(self, batch_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Return the batch sizes of this group's ranks."""
        size, index = self.transport.group.size, self.transport.group_index
        return batch_sizes[index * size : (index + 1) * size]

    def end_round(self) -> int:
        """Wait for every group to finish the round (collective); return the position where it ended."""
        return self.transport.end_round()

    def share_extra_state(self) -> None:
        """Give z and every learner the server rank's non-float buffers (a BatchNorm's batch count: every rank
        counts its own steps) (collective)."""
        self.central.broadcast_extra_state(self.transport.data)
        self.learners.take_extra_state()

    def drain(self) -> None:
        self.transport.stop()

    def statistics(self) -> dict:
        return self.transport.statistics()

    def state_dict(self) -> dict:
        """Return the server's counters (its held state is the run's central model after `meet`)."""
        return self.transport.state_dict()
