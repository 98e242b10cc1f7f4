"""MPI backend: tensor collectives through mpi4py, staged through host memory for device tensors."""

from __future__ import annotations

import torch

from crossbow_mpi.comm.base import Communicator, Reduction
from crossbow_mpi.comm.int8 import BLOCK, Feedback, dequantise


class MpiCommunicator(Communicator):
    """Tensor collectives with mpi4py on host buffers (CPU tensors are used in place)."""

    def split(self, color: int, key: int = 0) -> MpiCommunicator:
        """Return the scope of the ranks that passed the same color, ordered by key (collective)."""
        return MpiCommunicator(self.mpi_comm.Split(color, key))

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        if self.size > 1:
            with _host_view(tensor) as host:
                self.mpi_comm.Allreduce(self.mpi().IN_PLACE, host)
        return Reduction(tensor, self.size)

    def allreduce_cast_(self, tensor: torch.Tensor, dtype: torch.dtype) -> Reduction:
        """A ring allreduce's two halves with the payload in `dtype` on the wire: each rank receives every rank's
        cast copy of its 1/P chunk (Alltoall), sums the copies in float32 in rank order, and the cast sums are
        gathered (Allgather); every rank ends with the same bits."""
        if dtype == tensor.dtype or self.size == 1:
            return self.allreduce_sum_(tensor)
        p, n = self.size, tensor.numel()
        chunk = -(-n // p)
        wire = torch.zeros(p * chunk, dtype=dtype)
        wire[:n] = tensor.reshape(-1)
        received = torch.empty_like(wire)
        self.mpi_comm.Alltoall(_raw(wire), _raw(received))
        own = received.view(p, chunk).float().sum(0).to(dtype)
        self.mpi_comm.Allgather(_raw(own), _raw(wire))
        tensor.copy_(wire[:n].view(tensor.shape))
        return Reduction(tensor, self.size)

    def allreduce_int8_(self, tensor: torch.Tensor, feedback: Feedback) -> Reduction:
        """The ring's two halves in int8 (crossbow_mpi.comm.int8): each rank sends its payload, cast with its
        residual, to the chunks' owners (Alltoall), each owner sums the received chunks in float32 in rank order and
        casts the sum with its own residual, and the cast sums are gathered (Allgather); every rank ends with the
        same bits."""
        if self.size == 1:
            return Reduction(tensor, 1)
        p, n = self.size, tensor.numel()
        chunk = BLOCK * -(-n // (p * BLOCK))
        payload = torch.zeros(p * chunk)
        payload[:n] = tensor.reshape(-1)
        q, scales = feedback.cast("payload", payload)
        received, received_scales = torch.empty_like(q), torch.empty_like(scales)
        self.mpi_comm.Alltoall(q.numpy(), received.numpy())
        self.mpi_comm.Alltoall(scales.numpy(), received_scales.numpy())
        own = dequantise(received, received_scales).view(p, chunk).sum(0)
        own_q, own_scales = feedback.cast("sum", own)
        self.mpi_comm.Allgather(own_q.numpy(), q.numpy())
        self.mpi_comm.Allgather(own_scales.numpy(), scales.numpy())
        tensor.copy_(dequantise(q, scales)[:n].view(tensor.shape))
        return Reduction(tensor, self.size)

    def iallreduce_sum_(self, tensor: torch.Tensor):
        """Start replacing a contiguous host tensor by its sum over the ranks; return the MPI request."""
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        return self.mpi_comm.Iallreduce(self.mpi().IN_PLACE, tensor.numpy())

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.size > 1:
            with _host_view(tensor) as host:
                self.mpi_comm.Bcast(host, root=root)
        return tensor


def _raw(tensor: torch.Tensor):
    """A host tensor's bytes as a NumPy view (NumPy has no bfloat16)."""
    return tensor.view(torch.uint8).numpy()


class _host_view:
    """A NumPy view of a tensor on the host, copied back to the device on exit when needed."""

    def __init__(self, tensor: torch.Tensor):
        assert tensor.is_contiguous(), "collectives need contiguous tensors"
        self.tensor = tensor
        self.host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")

    def __enter__(self):
        return self.host.numpy()

    def __exit__(self, *exc):
        if self.host is not self.tensor:
            self.tensor.copy_(self.host)
