"""NCCL backend through CuPy: tensor collectives on torch CUDA tensors, on torch's current stream.

Rank 0 creates the NCCL unique id and broadcasts it over MPI as bytes; every rank must own a distinct GPU.
Each step of the start-up is agreed on by all ranks, so a failure on any rank raises ConfigError on every rank
instead of leaving the others waiting. NCCL errors after the start-up, including asynchronous ones, abort the
job with NCCL's message instead of hanging it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from crossbow_mpi.comm.base import Communicator, Reduction
from crossbow_mpi.comm.gpus import gpu_owners, ranks_sharing_gpus
from crossbow_mpi.config import ConfigError

T = TypeVar("T")
BYTES_ID_CUPY = 14
"""The first CuPy major version whose `get_unique_id` returns bytes and whose `NcclCommunicator` takes bytes."""


def nccl_module():
    """Return cupy.cuda.nccl, or None when CuPy or its NCCL binding is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return None
    return nccl if getattr(nccl, "available", True) else None


def unique_id_bytes(unique_id: bytes | tuple[int, ...]) -> bytes:
    """Return CuPy's NCCL unique id as bytes: CuPy ≥ 14 gives bytes, CuPy 13 a tuple of C chars."""
    return unique_id if isinstance(unique_id, bytes) else bytes(value % 256 for value in unique_id)


def unique_id_for_cupy(unique_id: bytes, cupy_version: str) -> bytes | tuple[int, ...]:
    """Return the id as this CuPy's `NcclCommunicator` takes it: bytes since CuPy 14, before a tuple of signed
    chars (CuPy 13 rejects bytes, CuPy 14 rejects a tuple)."""
    if int(cupy_version.split(".")[0]) >= BYTES_ID_CUPY:
        return unique_id
    return tuple(np.frombuffer(unique_id, dtype=np.int8).tolist())


def _load_cupy(device: torch.device):
    """Import CuPy with NCCL and make `device` CuPy's current device."""
    if nccl_module() is None:
        raise ConfigError(
            "CuPy with NCCL is not installed (pip install cupy-cuda12x or cupy-cuda13x, as torch.version.cuda)"
        )
    import cupy

    cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()).use()
    return cupy


class NcclCommunicator(Communicator):
    """Allreduce and broadcast of contiguous CUDA tensors with NCCL, by pointer, on the current stream."""

    def __init__(self, mpi_comm, device: torch.device):
        super().__init__(mpi_comm)
        self.device = device
        sharing = ranks_sharing_gpus(gpu_owners(self, device))
        if sharing:
            raise ConfigError(f"ranks {', '.join(map(str, sharing))} share GPUs, and NCCL needs one GPU per rank")
        cupy = self._on_every_rank("loading CuPy", lambda: _load_cupy(device))
        self.nccl = cupy.cuda.nccl
        root_id = self._on_every_rank(
            "creating the NCCL unique id", lambda: unique_id_bytes(self.nccl.get_unique_id()) if self.rank == 0 else b""
        )
        unique_id = unique_id_for_cupy(self.bcast_bytes(root_id), cupy.__version__)
        self.comm = self._on_every_rank(
            "starting NCCL",
            lambda: self.nccl.NcclCommunicator(self.size, unique_id, self.rank),
            undo=lambda comm: comm.abort(),
        )
        self.dtypes = {
            torch.float32: self.nccl.NCCL_FLOAT32,
            torch.float16: self.nccl.NCCL_FLOAT16,
            torch.float64: self.nccl.NCCL_FLOAT64,
        }
        if hasattr(self.nccl, "NCCL_BFLOAT16"):
            self.dtypes[torch.bfloat16] = self.nccl.NCCL_BFLOAT16

    def _on_every_rank(self, step: str, action: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
        """Run one start-up step on every rank; if it failed on any rank, undo it where it succeeded and raise
        ConfigError naming the first failure on every rank (collective)."""
        failure = None
        try:
            result = action()  # bound unless `failure` is set, and then neither undone nor returned
        except ConfigError as err:
            failure = str(err)
        except Exception as err:  # any failure (CUDA, NCCL, CuPy's argument types) means: no NCCL on this job
            reason = (str(err).strip().splitlines() or [""])[0]
            failure = f"{step} failed on rank {self.rank}: {type(err).__name__}: {reason}"
        failures = [f for f in self.allgather_json(failure) if f]
        if failures:
            if failure is None and undo is not None:
                undo(result)
            raise ConfigError(failures[0])
        return result

    def close(self) -> None:
        """Destroy the NCCL communicator once the device has finished its collectives; a second call does nothing."""
        if self.comm is not None:
            torch.cuda.synchronize(self.device)
            self.comm.destroy()
            self.comm = None

    def abandon(self) -> None:
        """Abort the NCCL communicator: its collectives in flight with a dead rank would never complete."""
        if self.comm is not None:
            self.comm.abort()
            self.comm = None

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        self._run(
            tensor,
            lambda ptr, count, dtype, stream: self.comm.allReduce(ptr, ptr, count, dtype, self.nccl.NCCL_SUM, stream),
        )
        return Reduction(tensor, self.size)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self._run(tensor, lambda ptr, count, dtype, stream: self.comm.bcast(ptr, count, dtype, root, stream))

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> None:
        """Send each (tensor, peer) and receive into each (tensor, peer) as one NCCL group on the current stream,
        as bytes (any dtype); on the GPU the group completes when every peer has run its matching group."""
        stream = torch.cuda.current_stream(self.device).cuda_stream

        def group() -> None:
            self.nccl.groupStart()
            try:
                for tensor, peer in sends:
                    self.comm.send(tensor.data_ptr(), _bytes(tensor), self.nccl.NCCL_UINT8, peer, stream)
                for tensor, peer in receives:
                    self.comm.recv(tensor.data_ptr(), _bytes(tensor), self.nccl.NCCL_UINT8, peer, stream)
            finally:
                self.nccl.groupEnd()

        self._checked(group)

    def _run(self, tensor: torch.Tensor, collective: Callable) -> torch.Tensor:
        assert tensor.is_cuda and tensor.is_contiguous(), "NCCL collectives need contiguous CUDA tensors"
        if tensor.dtype not in self.dtypes:
            raise ValueError(f"the NCCL backend does not reduce {tensor.dtype}")
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        self._checked(lambda: collective(tensor.data_ptr(), tensor.numel(), self.dtypes[tensor.dtype], stream))
        return tensor

    def _checked(self, call: Callable[[], None]) -> None:
        """Run NCCL calls; abort the job with NCCL's message when they or an earlier asynchronous call failed."""
        try:
            call()
            self.comm.check_async_error()
        except self.nccl.NcclError as err:
            sys.stderr.write(f"crossbow_mpi: error: NCCL failed on rank {self.rank}: {err}; aborting the job\n")
            sys.stderr.flush()
            self.mpi().COMM_WORLD.Abort(5)


def _bytes(tensor: torch.Tensor) -> int:
    assert tensor.is_contiguous(), "NCCL sends and receives contiguous tensors"
    return tensor.numel() * tensor.element_size()
