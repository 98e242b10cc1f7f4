"""Communicators: one interface, one backend per transport."""

from crossbow_mpi.comm.base import Communicator
from crossbow_mpi.comm.mpi import MpiCommunicator

__all__ = ["Communicator", "MpiCommunicator", "build_communicator"]


def build_communicator(mpi_comm) -> Communicator:
    """Return the communicator for this job's ranks."""
    return MpiCommunicator(mpi_comm)
