"""MPI backend: tensor collectives through mpi4py, staged through host memory for device tensors."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from crossbow_mpi.comm.base import Communicator, Pending, Reduction, wait_all
from crossbow_mpi.comm.int8 import BLOCK, Feedback, dequantise

PAIR_TAG = 0x05A1
"""The tag of the two-rank sum's messages on the scope's own communicator."""
DELAYED_PAIR_TAG = 0x05A2
"""The tag of the two-rank started sum's messages (`iallreduce_sum_`), apart from the blocking sum's."""
PAIR_CHUNK_BYTES = 16 << 20
"""The two-rank sum's message size: a larger tensor goes in chunks, the next in flight while one is added."""


class MpiCommunicator(Communicator):
    """Tensor collectives with mpi4py on host buffers (CPU tensors are used in place)."""

    def __init__(self, mpi_comm, pair: bool | None = None):
        """`pair`: whether a scope of two ranks sums by one exchange of the whole message (`_pair_exchange`; None:
        where the two share no memory, found at the first sum)."""
        super().__init__(mpi_comm)
        self._pair = pair
        self._pair_rooms: dict[np.dtype, np.ndarray] = {}
        """The two-rank sum's receive buffers, two chunks of each element type."""

    def split(self, color: int, key: int = 0) -> MpiCommunicator:
        """Return the scope of the ranks that passed the same color, ordered by key (collective)."""
        return MpiCommunicator(self.mpi_comm.Split(color, key))

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        if self.size > 1:
            with _host_view(tensor) as host:
                if self._pairs():
                    self._pair_exchange(host.reshape(-1), _add)
                else:
                    self.mpi_comm.Allreduce(self.mpi().IN_PLACE, host)
        return Reduction(tensor, self.size)

    def allreduce_cast_(self, tensor: torch.Tensor, dtype: torch.dtype) -> Reduction:
        """A ring allreduce's two halves with the payload in `dtype` on the wire: each rank receives every rank's
        cast copy of its 1/P chunk (Alltoall), sums the copies in float32 in rank order, and the cast sums are
        gathered (Allgather); every rank ends with the same bits. Two ranks on two nodes exchange their cast copies
        whole and each sums both (`_pair_exchange`): the same bits, in one exchange."""
        if dtype == tensor.dtype or self.size == 1:
            return self.allreduce_sum_(tensor)
        p, n = self.size, tensor.numel()
        if self._pairs():
            wire = tensor.reshape(-1).to("cpu", dtype)
            self._pair_exchange(_bits(wire), lambda mine, theirs: _cast_add(mine, theirs, dtype))
            tensor.copy_(wire.view(tensor.shape))
            return Reduction(tensor, p)
        chunk = -(-n // p)
        wire = torch.zeros(p * chunk, dtype=dtype)
        wire[:n] = tensor.reshape(-1)
        received = torch.empty_like(wire)
        self.mpi_comm.Alltoall(_raw(wire), _raw(received))
        own = received.view(p, chunk).float().sum(0).to(dtype)
        self.mpi_comm.Allgather(_raw(own), _raw(wire))
        tensor.copy_(wire[:n].view(tensor.shape))
        return Reduction(tensor, self.size)

    def _pairs(self) -> bool:
        """Whether this scope sums by `_pair_exchange` (at its first call where `pair` was None: collective)."""
        if self.size != 2:
            return False
        if self._pair is None:
            shared = self.mpi_comm.Split_type(self.mpi().COMM_TYPE_SHARED, key=self.rank)
            self._pair = shared.Get_size() == 1
            shared.Free()
        return self._pair

    def _pair_exchange(self, flat: np.ndarray, combine: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Two ranks' reduction as one exchange of the message: each sends its `flat` and receives the other's, a
        chunk of PAIR_CHUNK_BYTES at a time with the next in flight, and `combine(mine, theirs)` writes the result
        into its chunk of `flat`. A combine that commutes (one IEEE addition) gives both ranks the same bits, and
        the bits of MPI's Allreduce, whose default algorithm at two ranks took 1.3-1.5x as long over a TCP link (in
        shared memory less, so ranks that share memory keep it: benchmarks/README.md, "Two ranks' sum"). The send
        is posted first: with the receive first, as in Open MPI's own exchanges, back-to-back sums were steadier, but
        per-step SMA trained a third slower over a TCP link."""
        step = max(1, PAIR_CHUNK_BYTES // flat.itemsize)
        rooms = self._pair_rooms.get(flat.dtype)
        if rooms is None or rooms.shape[1] < min(step, flat.size):
            rooms = self._pair_rooms[flat.dtype] = np.empty((2, min(step, flat.size)), flat.dtype)
        pending = None
        for i, start in enumerate(range(0, flat.size, step)):
            mine = flat[start : start + step]
            theirs = rooms[i % 2, : mine.size]
            requests = self._post_pair(mine, theirs, PAIR_TAG)
            if pending is not None:
                _combine_when_done(*pending)
            pending = (requests, combine, mine, theirs)
        if pending is not None:
            _combine_when_done(*pending)

    def _post_pair(self, mine: np.ndarray, theirs: np.ndarray, tag: int) -> list:
        """Post the send of `mine` to the other rank of two, then the receive of its message into `theirs`."""
        peer = 1 - self.rank
        return [self.mpi_comm.Isend(mine, dest=peer, tag=tag), self.mpi_comm.Irecv(theirs, source=peer, tag=tag)]

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

    def iallreduce_sum_(self, tensor: torch.Tensor) -> Pending:
        """Start replacing a contiguous host tensor by its sum over the ranks. Two ranks that share no memory
        exchange the whole tensor, one message each way (as `_pair_exchange`, the same bits); the rest take MPI's
        Iallreduce."""
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        flat = tensor.numpy().reshape(-1)
        if not self._pairs():
            return Pending([self.mpi_comm.Iallreduce(self.mpi().IN_PLACE, flat)])
        theirs = np.empty_like(flat)
        return Pending(self._post_pair(flat, theirs, DELAYED_PAIR_TAG), lambda: _add(flat, theirs))

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.size > 1:
            with _host_view(tensor) as host:
                self.mpi_comm.Bcast(host, root=root)
        return tensor


def _combine_when_done(requests: list, combine: Callable, mine: np.ndarray, theirs: np.ndarray) -> None:
    wait_all(requests)
    combine(mine, theirs)


def _add(mine: np.ndarray, theirs: np.ndarray) -> None:
    np.add(mine, theirs, out=mine)


def _cast_add(mine: np.ndarray, theirs: np.ndarray, dtype: torch.dtype) -> None:
    """mine = mine + theirs in float32, cast to `dtype`; both hold `dtype` values as same-sized integers (_bits)."""
    typed = torch.from_numpy(mine).view(dtype)
    typed.copy_(typed.float() + torch.from_numpy(theirs).view(dtype).float())


def _raw(tensor: torch.Tensor):
    """A host tensor's bytes as a NumPy view (NumPy has no bfloat16)."""
    return tensor.view(torch.uint8).numpy()


def _bits(tensor: torch.Tensor):
    """A host tensor's values as a NumPy view of integers of their size, one element each."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]).numpy()


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
