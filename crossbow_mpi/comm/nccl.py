"""NCCL backend through CuPy: tensor collectives on torch CUDA tensors, on torch's current stream.

Rank 0 creates the NCCL unique id and broadcasts it over MPI; every rank must own a distinct GPU. NCCL
errors, including asynchronous ones, abort the job with NCCL's message instead of hanging it.
"""

from __future__ import annotations

import socket
import sys
from typing import Callable

import torch

from crossbow_mpi.comm.base import Communicator, Reduction
from crossbow_mpi.config import ConfigError


def nccl_module():
    """Return cupy.cuda.nccl, or None when CuPy or its NCCL binding is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return None
    return nccl if getattr(nccl, "available", True) else None


class NcclCommunicator(Communicator):
    """Allreduce and broadcast of contiguous CUDA tensors with NCCL, by pointer, on the current stream."""

    def __init__(self, mpi_comm, device: torch.device):
        super().__init__(mpi_comm)
        self.nccl = nccl_module()
        if self.nccl is None:
            raise ConfigError("--comm nccl: CuPy with NCCL is not installed (pip install cupy-cuda13x)")
        gpu = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))
        owners = self.allgather_json([socket.gethostname(), gpu])
        sharing = [rank for rank, owner in enumerate(owners) if owners.count(owner) > 1]
        if sharing:
            raise ConfigError(f"--comm nccl needs one GPU per rank, but ranks {', '.join(map(str, sharing))} "
                              "share GPUs; use --comm mpi or one rank per GPU")
        import cupy

        cupy.cuda.Device(device.index).use()
        unique_id = self.bcast_json(list(self.nccl.get_unique_id()) if self.rank == 0 else None)
        self.comm = self.nccl.NcclCommunicator(self.size, tuple(unique_id), self.rank)
        self.dtypes = {torch.float32: self.nccl.NCCL_FLOAT32, torch.float16: self.nccl.NCCL_FLOAT16,
                       torch.float64: self.nccl.NCCL_FLOAT64}
        if hasattr(self.nccl, "NCCL_BFLOAT16"):
            self.dtypes[torch.bfloat16] = self.nccl.NCCL_BFLOAT16

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        self._run(tensor, lambda ptr, count, dtype, stream:
                  self.comm.allReduce(ptr, ptr, count, dtype, self.nccl.NCCL_SUM, stream))
        return Reduction(tensor, self.size)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self._run(tensor, lambda ptr, count, dtype, stream: self.comm.bcast(ptr, count, dtype, root, stream))

    def _run(self, tensor: torch.Tensor, collective: Callable) -> torch.Tensor:
        assert tensor.is_cuda and tensor.is_contiguous(), "NCCL collectives need contiguous CUDA tensors"
        if tensor.dtype not in self.dtypes:
            raise ValueError(f"the NCCL backend does not reduce {tensor.dtype}")
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        try:
            collective(tensor.data_ptr(), tensor.numel(), self.dtypes[tensor.dtype], stream)
            self.comm.check_async_error()
        except self.nccl.NcclError as err:
            sys.stderr.write(f"crossbow_mpi: error: NCCL failed on rank {self.rank}: {err}; aborting the job\n")
            sys.stderr.flush()
            self.mpi().COMM_WORLD.Abort(5)
        return tensor
