"""Communicators: one interface, one backend per transport."""

import torch

from crossbow_mpi.comm.base import Communicator
from crossbow_mpi.comm.mpi import MpiCommunicator
from crossbow_mpi.config import ConfigError

__all__ = ["Communicator", "MpiCommunicator", "build_communicator", "build_transport"]


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


def build_transport(kind: str, data: Communicator, config) -> Communicator:
    """Return what an algorithm reduces over (collective): the data scope's communicator for `allreduce`, or
    eager-SGD's partial collective over it for `partial`."""
    if kind == "partial":
        from crossbow_mpi.comm.partial import PartialAllreduce

        return PartialAllreduce(data, config.eager_mode, config.eager_sync_every, config.seed)
    assert kind == "allreduce", kind
    return data
