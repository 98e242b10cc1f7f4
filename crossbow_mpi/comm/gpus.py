"""Which ranks share a GPU: a GPU is told apart from others by its host's name and its UUID."""

from __future__ import annotations

import socket

import torch

from crossbow_mpi.comm.base import Communicator


def gpu_owners(comm: Communicator, device: torch.device) -> list[list[str] | None]:
    """Return each rank's [host, GPU UUID], in rank order; None for a rank on the CPU (collective)."""
    mine = None
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        mine = [socket.gethostname(), str(getattr(properties, "uuid", device.index))]
    return comm.allgather_json(mine)


def ranks_sharing_gpus(owners: list[list[str] | None]) -> list[int]:
    """Return the ranks whose GPU another rank uses too."""
    return [rank for rank, owner in enumerate(owners) if owner is not None and owners.count(owner) > 1]


def ranks_per_gpu(owners: list[list[str] | None], rank: int) -> int:
    """Return how many ranks use this rank's GPU (1 on the CPU)."""
    return owners.count(owners[rank]) if owners[rank] is not None else 1
