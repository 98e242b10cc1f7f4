"""Hierarchical allreduce over MPI: sum within each node, then among one leader per node, then copy the total
back within each node, so that only one rank per node sends the model over the network."""

from __future__ import annotations

from collections.abc import Callable

import torch

from crossbow_mpi.comm.base import Reduction
from crossbow_mpi.comm.mpi import MpiCommunicator, _host_view

NodeOf = Callable[[int], int]
"""Maps a rank of the scope to its node's number (tests use it to pretend that one machine is several nodes)."""


def node_scope(mpi_comm, node_of: NodeOf | None = None):
    """Return the MPI communicator of this rank's node within `mpi_comm`, ranks in scope order (collective): the
    ranks that share memory with it, or those that `node_of` puts on the same node."""
    rank = mpi_comm.Get_rank()
    if node_of is None:
        return mpi_comm.Split_type(MpiCommunicator.mpi().COMM_TYPE_SHARED, key=rank)
    return mpi_comm.Split(node_of(rank), rank)


class HierarchicalCommunicator(MpiCommunicator):
    """The MPI backend whose sums run in three phases: reduce to the first rank of each node, allreduce among
    those leaders, broadcast within each node. Broadcasts, splits and control messages span the whole scope,
    as with MpiCommunicator.

    The total equals the flat allreduce's up to the grouping of the floating-point additions: bit for bit when
    each node holds at most two ranks and there are at most two nodes (every grouping is then the same sum)."""

    hierarchy = "node"

    def __init__(self, mpi_comm, node_of: NodeOf | None = None):
        super().__init__(mpi_comm)
        self.node = MpiCommunicator(node_scope(mpi_comm, node_of))
        MPI = self.mpi()
        leaders = mpi_comm.Split(0 if self.node.rank == 0 else MPI.UNDEFINED, self.rank)
        self.leaders = MpiCommunicator(leaders) if leaders != MPI.COMM_NULL else None
        self.nodes = int(self.allreduce_sum_numbers([float(self.leaders is not None)])[0])

    def mpi_comms(self) -> list:
        return [self.mpi_comm, self.node.mpi_comm] + ([self.leaders.mpi_comm] if self.leaders is not None else [])

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        return self.allreduce_cast_(tensor, tensor.dtype)

    def allreduce_cast_(self, tensor: torch.Tensor, dtype: torch.dtype) -> Reduction:
        """The three phases, with only the leaders' (across nodes) payload cast to `dtype` for the wire."""
        MPI = self.mpi()
        with _host_view(tensor) as host:
            if self.node.size > 1:
                leader = self.node.rank == 0
                self.node.mpi_comm.Reduce(MPI.IN_PLACE if leader else host, host if leader else None, root=0)
            if self.leaders is not None and self.leaders.size > 1:
                self.leaders.allreduce_cast_(torch.from_numpy(host), dtype)
            if self.node.size > 1:
                self.node.mpi_comm.Bcast(host, root=0)
        return Reduction(tensor, self.size)
