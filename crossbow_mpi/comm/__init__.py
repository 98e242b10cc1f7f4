"""Communicators: one interface, one backend per transport."""

import torch

from crossbow_mpi.comm.base import Communicator
from crossbow_mpi.comm.mpi import MpiCommunicator
from crossbow_mpi.config import ConfigError

__all__ = ["Communicator", "MpiCommunicator", "build_communicator"]


def build_communicator(mpi_comm, kind: str = "mpi", device: torch.device = torch.device("cpu")) -> Communicator:
    """Return the communicator for this job's ranks (collective): `mpi`, `nccl`, or `auto`."""
    from crossbow_mpi.comm.nccl import NcclCommunicator, nccl_module

    if kind == "nccl" and device.type != "cuda":
        raise ConfigError("--comm nccl needs CUDA devices (--device cuda)")
    if kind == "nccl" or (kind == "auto" and device.type == "cuda" and nccl_module() is not None):
        try:
            return NcclCommunicator(mpi_comm, device)
        except ConfigError:
            if kind == "nccl":
                raise
    return MpiCommunicator(mpi_comm)
