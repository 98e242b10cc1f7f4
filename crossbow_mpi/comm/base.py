"""The communicator interface: tensor collectives for the data path, MPI messages for the control plane."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from crossbow_mpi.tensor_bytes import dtype_name, from_bytes, named_dtype, nbytes, to_bytes

if TYPE_CHECKING:
    from crossbow_mpi.comm.int8 import Feedback

T = TypeVar("T")
POLL_MIN_S = 5e-5
POLL_MAX_S = 1e-3


@dataclass
class Reduction:
    """What an allreduce returned: the summed tensor, and how many ranks' contributions the sum carries."""

    total: torch.Tensor
    contributions: int


@dataclass
class Pending:
    """A started reduction: its MPI requests, and what completes it once they are done (None: nothing)."""

    requests: list
    finish: Callable[[], None] | None = None

    def wait(self) -> None:
        """Complete the requests without spinning (`wait_sleeping`), then the reduction."""
        wait_sleeping(self.requests)
        if self.finish is not None:
            self.finish()


class Communicator(ABC):
    """Collectives over the ranks of one scope (the world, or a split of it).

    Tensor collectives (`allreduce_sum_`, `broadcast_`) are what a backend implements; control messages
    (JSON, bytes, NumPy arrays, votes, heartbeats) always travel over the scope's MPI communicator as byte
    buffers, never as Python objects.
    """

    hierarchy = "flat"
    """How `allreduce_sum_` spans the scope's nodes: `flat` (one collective over all ranks) or `node`."""

    def __init__(self, mpi_comm):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()

    @abstractmethod
    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        """Replace a contiguous tensor, in place, by its sum over the ranks; return it with its contribution count."""

    def allreduce_cast_(self, tensor: torch.Tensor, dtype: torch.dtype) -> Reduction:
        """`allreduce_sum_` with the payload cast to `dtype` for the wire and summed in float32 (MPI transports)."""
        if dtype == tensor.dtype:
            return self.allreduce_sum_(tensor)
        from crossbow_mpi.config import ConfigError

        raise ConfigError(f"--sync-dtype applies to --comm mpi: {type(self).__name__} sends the message's own type")

    def allreduce_int8_(self, tensor: torch.Tensor, feedback: Feedback) -> Reduction:
        """`allreduce_sum_` of a float32 host tensor as int8 blocks with error feedback (flat MPI transports)."""
        from crossbow_mpi.config import ConfigError

        raise ConfigError(f"--sync-dtype int8 applies to --comm mpi --hierarchy flat, not {type(self).__name__}")

    @abstractmethod
    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Replace a contiguous tensor, in place, by root's copy."""

    def control_channel(self) -> ControlChannel:
        """Return a private duplicate of this scope for control traffic beside the training loop (collective)."""
        return ControlChannel(self.mpi_comm.Dup())

    def barrier(self) -> None:
        self.mpi_comm.Barrier()

    # Not abstract: a hook that transports with no threads or communicators of their own leave empty.
    def close(self) -> None:  # noqa: B027
        """Stop the threads and free the communicators this transport made for itself; those it was given stay
        (collective; after the algorithm's `drain`, when no message is in flight)."""

    def mpi_comms(self) -> list:
        """Return the MPI communicators this scope's collectives use (to revoke them all after a rank loss)."""
        return [self.mpi_comm]

    # Not abstract, as close.
    def abandon(self) -> None:  # noqa: B027
        """Release what this scope holds beside MPI without its peers, which may be dead (after a rank loss)."""

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Return every rank's bytes, in rank order, on every rank."""
        sizes = np.empty(self.size, dtype=np.int64)
        self.mpi_comm.Allgather(np.array([len(data)], dtype=np.int64), sizes)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.mpi_comm.Allgatherv(np.frombuffer(data, dtype=np.uint8), [out, sizes])
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return [out[offsets[i] : offsets[i + 1]].tobytes() for i in range(self.size)]

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Return every rank's bytes, in rank order, on root (None elsewhere)."""
        size, message = np.array([len(data)], dtype=np.int64), np.frombuffer(data, dtype=np.uint8)
        if self.rank != root:
            self.mpi_comm.Gather(size, None, root=root)
            self.mpi_comm.Gatherv(message, None, root=root)
            return None
        sizes = np.empty(self.size, dtype=np.int64)
        self.mpi_comm.Gather(size, sizes, root=root)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.mpi_comm.Gatherv(message, [out, sizes], root=root)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return [out[offsets[i] : offsets[i + 1]].tobytes() for i in range(self.size)]

    def scatter_bytes(self, parts: list[bytes] | None, root: int = 0) -> bytes:
        """Send root's parts[i] to rank i; return this rank's part."""
        sizes = np.zeros(self.size, dtype=np.int64)
        data: np.ndarray | None = None
        if self.rank == root:
            assert parts is not None and len(parts) == self.size
            sizes[:] = [len(p) for p in parts]
            data = np.frombuffer(b"".join(parts), dtype=np.uint8)
        self.mpi_comm.Bcast(sizes, root=root)
        out = np.empty(int(sizes[self.rank]), dtype=np.uint8)
        self.mpi_comm.Scatterv([data, sizes] if self.rank == root else None, out, root=root)
        return out.tobytes()

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Return root's bytes on every rank."""
        if self.rank == root:
            assert data is not None
            buf = np.frombuffer(data, dtype=np.uint8).copy()
            self.mpi_comm.Bcast(np.array([len(buf)], dtype=np.int64), root=root)
        else:
            size = np.zeros(1, dtype=np.int64)
            self.mpi_comm.Bcast(size, root=root)
            buf = np.empty(int(size[0]), np.uint8)
        self.mpi_comm.Bcast(buf, root=root)
        return buf.tobytes()

    def bcast_json(self, obj, root: int = 0):
        """Return root's JSON-serialisable object on every rank."""
        data = json.dumps(obj).encode() if self.rank == root else None
        return json.loads(self.bcast_bytes(data, root))

    def bcast_tensors(self, tensors: dict[str, torch.Tensor] | None, root: int = 0) -> dict[str, torch.Tensor]:
        """Return root's named tensors on every rank, on the CPU: a JSON layout, then their raw bytes."""
        mine = tensors or {}
        layout = self.bcast_json({name: [list(t.shape), dtype_name(t.dtype)] for name, t in mine.items()}, root)
        raw = b"".join(map(to_bytes, mine.values()))
        received, out, offset = self.bcast_bytes(raw if self.rank == root else None, root), {}, 0
        for name, (shape, dtype_text) in layout.items():
            dtype = named_dtype(dtype_text)
            size = nbytes(dtype, shape)
            out[name] = from_bytes(received[offset : offset + size], dtype, shape)
            offset += size
        return out

    def allgather_json(self, obj) -> list:
        """Return every rank's JSON-serialisable object, in rank order."""
        return [json.loads(b) for b in self.allgather_bytes(json.dumps(obj).encode())]

    def allreduce_sum_numbers(self, values: list[float]) -> list[float]:
        """Sum a short list of float64 numbers over all ranks."""
        buf = np.asarray(values, dtype=np.float64)
        self.mpi_comm.Allreduce(self.mpi().IN_PLACE, buf)
        return buf.tolist()

    @staticmethod
    def mpi():
        from mpi4py import MPI

        return MPI


class ControlChannel:
    """A duplicated scope for control traffic that runs beside the training loop's collectives: non-blocking
    votes and point-to-point heartbeats. Its rank order is its scope's."""

    def __init__(self, mpi_comm):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()

    def iallreduce_sum_(self, values: np.ndarray):
        """Start summing a float64 array in place over the ranks; return the request."""
        return self.mpi_comm.Iallreduce(Communicator.mpi().IN_PLACE, values)

    def isend(self, values: np.ndarray, dest: int, tag: int):
        return self.mpi_comm.Isend(values, dest=dest, tag=tag)

    def irecv_any(self, values: np.ndarray, tag: int):
        """Start receiving into `values` from any rank."""
        return self.mpi_comm.Irecv(values, source=Communicator.mpi().ANY_SOURCE, tag=tag)

    def irecv(self, values: np.ndarray, source: int, tag: int):
        return self.mpi_comm.Irecv(values, source=source, tag=tag)

    def alltoall(self, values: np.ndarray, out: np.ndarray) -> None:
        """Send values[i] to rank i; receive rank i's into out[i] (collective)."""
        self.mpi_comm.Alltoall(values, out)

    def free(self) -> None:
        self.mpi_comm.Free()


def wait_sleeping(requests: list, timeout: float | None = None) -> bool:
    """Complete MPI requests, sleeping between tests instead of spinning: MPI's blocking waits spin and would take
    a core from the threads still computing. With `timeout`, give up after that many seconds; return whether they
    completed."""
    poll, deadline = POLL_MIN_S, None if timeout is None else time.monotonic() + timeout
    statuses = [Communicator.mpi().Status() for _ in requests]
    while not _test_all(requests, statuses):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(poll)
        poll = min(2 * poll, POLL_MAX_S)
    return True


def wait_all(requests: list) -> None:
    """`Request.Waitall`, raising a failed request's own error (such as a dead peer's) instead of
    MPI_ERR_IN_STATUS."""
    statuses = [Communicator.mpi().Status() for _ in requests]
    _own_error(lambda: Communicator.mpi().Request.Waitall(requests, statuses), statuses)


def _test_all(requests: list, statuses: list) -> bool:
    """`Request.Testall`, raising a failed request's own error as `wait_all` does."""
    return _own_error(lambda: Communicator.mpi().Request.Testall(requests, statuses), statuses)


def _own_error(complete: Callable[[], T], statuses: list) -> T:
    MPI = Communicator.mpi()
    try:
        return complete()
    except MPI.Exception as err:
        if err.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        errors = [s.Get_error() for s in statuses if s.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
        raise MPI.Exception(errors[0]) from err


class LaggedVote:
    """Agree across ranks whether any rank raised a flag (received a stop signal; on rank 0, found a re-tune due),
    without a blocking collective per step.

    `poll()` posts a non-blocking allreduce of this rank's flag on a private channel and returns the outcome
    of the one posted `lag` calls earlier, so every rank acts at the same step while ranks may run up to
    `lag` steps apart (eager-SGD's do)."""

    def __init__(self, comm: Communicator, lag: int, requested):
        assert lag >= 0
        self.channel = comm.control_channel()
        self.lag = lag
        self.requested = requested
        self.pending: list[tuple[np.ndarray, object]] = []

    def poll(self) -> bool:
        """Vote, and return whether the vote of `lag` calls ago found the flag on any rank (collective)."""
        flag = np.array([float(self.requested())])
        self.pending.append((flag, self.channel.iallreduce_sum_(flag)))
        if len(self.pending) <= self.lag:
            return False
        flag, request = self.pending.pop(0)
        wait_sleeping([request])
        return bool(flag[0])

    def now(self) -> bool:
        """Vote, and return whether any rank raises the flag now (collective)."""
        flag = np.array([float(self.requested())])
        wait_sleeping([self.channel.iallreduce_sum_(flag)])
        return bool(flag[0])

    def forget(self) -> None:
        """Complete the votes in flight and drop their outcomes (collective: every rank voted as often)."""
        wait_sleeping([request for _, request in self.pending])
        self.pending = []

    def close(self) -> None:
        """Complete the votes in flight and free the channel (collective)."""
        self.forget()
        self.channel.free()
