"""A central model held by a server thread on rank 0, updated asynchronously by compute groups (Omnivore's transport).

The ranks form G compute groups of consecutive ranks. A step of a group is one `exchange`: the group sums its
message (an allreduce over the group), its leader (the group's first rank) sends the sum to the server and gets
back the central state the server holds after applying it, and the leader broadcasts that state to its group.
The server applies each message as it arrives, whatever the other groups are doing, so no group waits for
another: the staleness of a message is the number of other groups' messages applied between its leader's read
and its write.

The server is a progress thread on rank 0 with its own duplicated communicator. It waits for the next message
by polling with short sleeps (MPI's blocking waits spin and would take a core from the learners), receives it,
applies it under a lock and replies. Rank 0's own group (group 0) applies its messages by a direct call. `meet`
brings every rank to the server's state where the whole world meets (evaluation, checkpoints, the end).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from crossbow_mpi.comm.base import POLL_MAX_S, POLL_MIN_S, Communicator, Reduction, wait_sleeping
from crossbow_mpi.comm.mpi import MpiCommunicator

SERVER_RANK = 0
HEADER_TAG, MESSAGE_TAG, REPLY_TAG, VERSION_TAG = 0x0A1, 0x0A2, 0x0A3, 0x0A4

Apply = Callable[[Sequence[torch.Tensor], torch.Tensor, Sequence[float]], None]
"""apply(held, message, params): update the held tensors in place by one group's summed message."""


class ModelServer(Communicator):
    """The group's collectives, plus the exchange of each group's message with the state held on rank 0 of `data`.

    `data` spans the world (every group); `group` is this rank's compute group, one of `groups` of equal size.
    """

    def __init__(self, data: Communicator, group: Communicator, groups: int):
        self.data = data
        self.splits = {groups: group}
        """The compute groups of each number of groups used so far."""
        self._use_group(groups)
        self.channel = data.mpi_comm.Dup()
        self.read_version = 0
        """The version of the state this group last read (the server's updates applied up to then)."""
        self.held: tuple[torch.Tensor, ...] = ()
        """On the server's rank: the central state, first the tensor every reply carries."""
        self.apply: Apply | None = None
        self.lock = threading.Lock()
        self.version = 0
        """Updates applied since the start of the run (on the server's rank; elsewhere as of the last `meet`)."""
        self.updates = np.zeros(groups, np.int64)
        """On the server's rank: updates applied per group since the start of the run."""
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.cpu_before = self.cpu_s = 0.0
        """The server thread's CPU seconds: of its finished runs, and in all up to its latest update."""
        self.window = self._empty_window()

    def regroup(self, groups: int) -> None:
        """Use `groups` compute groups of consecutive ranks from now on (collective over `data`, after `meet` and
        `stop`); the per-group counts start afresh."""
        assert self.thread is None and self.data.size % groups == 0
        if groups not in self.splits:
            size = self.data.size // groups
            self.splits[groups] = MpiCommunicator(self.data.mpi_comm.Split(self.data.rank // size, self.data.rank))
        self._use_group(groups)
        self.updates = np.zeros(groups, np.int64)
        self.window = self._empty_window()

    def _use_group(self, groups: int) -> None:
        group = self.splits[groups]
        super().__init__(group.mpi_comm)
        assert self.data.size == group.size * groups, "groups of equal size that cover the world"
        self.group = group
        self.groups = groups
        self.group_index = self.data.rank // group.size

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        return self.group.allreduce_sum_(tensor)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self.group.broadcast_(tensor, root)

    def serve(self, held: Sequence[torch.Tensor], apply: Apply) -> None:
        """On the server's rank, hold host copies of `held` (the run's start) and update them with `apply`."""
        if self.data.rank == SERVER_RANK:
            self.held = tuple(tensor.detach().cpu().clone() for tensor in held)
            self.apply = apply

    def exchange(self, message: torch.Tensor, out: torch.Tensor, params: Sequence[float]) -> None:
        """Sum `message` over the group, have the server apply the sum with `params`, and put the state the server
        then holds into `out` on every rank of the group (collective over the group)."""
        self.group.allreduce_sum_(message)
        if self.group.rank == 0:
            self._push_pull(message, out, params)
        self.group.broadcast_(out)

    def _push_pull(self, message: torch.Tensor, out: torch.Tensor, params: Sequence[float]) -> None:
        if self.data.rank == SERVER_RANK:
            self._start()
            out.copy_(self._apply(self.group_index, self.read_version, message.cpu(), params))
            self.read_version = self.version
            return
        header = np.array([self.read_version, *params], dtype=np.float64)
        host = message.detach().cpu().numpy()
        reply = np.empty(out.numel(), dtype=host.dtype)
        version = np.zeros(1, np.int64)
        wait_sleeping(
            [
                self.channel.Isend(header, dest=SERVER_RANK, tag=HEADER_TAG),
                self.channel.Isend(host, dest=SERVER_RANK, tag=MESSAGE_TAG),
                self.channel.Irecv(reply, source=SERVER_RANK, tag=REPLY_TAG),
                self.channel.Irecv(version, source=SERVER_RANK, tag=VERSION_TAG),
            ]
        )
        out.copy_(torch.from_numpy(reply))
        self.read_version = int(version[0])

    def _apply(self, group: int, read_version: int, message: torch.Tensor, params: Sequence[float]) -> torch.Tensor:
        """Apply one group's message to the held state; return a copy of the state's first tensor."""
        with self.lock:
            staleness = self.version - read_version
            self.apply(self.held, message, params)
            self.version += 1
            self.updates[group] += 1
            self.window["updates"][group] += 1
            histogram = self.window["staleness"]
            if staleness >= len(histogram):
                self.window["staleness"] = histogram = np.concatenate(
                    [histogram, np.zeros(staleness + 1 - len(histogram), np.int64)]
                )
            histogram[staleness] += 1
            return self.held[0].clone()

    def meet(self, outs: Sequence[torch.Tensor]) -> None:
        """Give every rank the server's state once every group's last update is applied (collective over `data`):
        `outs[i]` becomes held tensor i."""
        wait_sleeping([self.data.mpi_comm.Ibarrier()])
        if self.data.rank == SERVER_RANK:
            with self.lock:
                for out, held in zip(outs, self.held):
                    out.copy_(held)
        for out in outs:
            self.data.broadcast_(out, SERVER_RANK)
        self.version = self.read_version = self.data.bcast_json(self.version)

    def stop(self) -> None:
        """Stop the server thread (after `meet`: no message is in flight); the next exchange of group 0 restarts it."""
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None
            self._raise_error()

    def statistics(self) -> dict:
        """Return and reset, on every rank, what the server did since the last call (collective over `data`):
        updates per group, the staleness histogram, its mean and maximum, and the server thread's CPU share."""
        window, self.window = self.window, self._empty_window()
        wall_s = time.perf_counter() - window["started"]
        cpu_s = self.cpu_s - window["cpu_s"]
        if self.data.rank == SERVER_RANK:
            staleness = window["staleness"]
            applied = max(int(staleness.sum()), 1)
            stats = {
                "omnivore_updates": window["updates"].tolist(),
                "omnivore_staleness": staleness.tolist(),
                "omnivore_staleness_mean": float(np.arange(len(staleness)) @ staleness) / applied,
                "omnivore_staleness_max": int(np.flatnonzero(staleness).max(initial=0)),
                "omnivore_server_cpu_share": cpu_s / max(wall_s, 1e-9),
            }
        else:
            stats = None
        return self.data.bcast_json(stats)

    def state_dict(self) -> dict:
        """Return the server's counters (its tensors are the run's central model after `meet`)."""
        return {"version": self.version, "updates": self.updates.tolist()}

    def load_state_dict(self, state: dict, held: Sequence[torch.Tensor]) -> None:
        """Restore the counters and, on the server's rank, the held state from `held`. The per-group counts start
        afresh when the groups changed (or the state is another algorithm's, without counters)."""
        self.version = self.read_version = state.get("version", 0)
        updates = np.array(state.get("updates", []), np.int64)
        self.updates = updates if len(updates) == self.groups else np.zeros(self.groups, np.int64)
        if self.data.rank == SERVER_RANK:
            with self.lock:
                for mine, restored in zip(self.held, held):
                    mine.copy_(restored)

    def _empty_window(self) -> dict:
        return {
            "updates": np.zeros(self.groups, np.int64),
            "staleness": np.zeros(1, np.int64),
            "started": time.perf_counter(),
            "cpu_s": self.cpu_s,
        }

    def _start(self) -> None:
        """Start the server thread on the server's rank, unless it runs or no other group exists."""
        self._raise_error()
        if self.thread is None and self.groups > 1:
            self.stopping.clear()
            self.thread = threading.Thread(target=self._serve, name="omnivore-server", daemon=True)
            self.thread.start()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError("the Omnivore model server's thread failed") from self.error

    def _serve(self) -> None:
        try:
            self._requests()
        except BaseException as err:
            self.error = err
            raise

    def _requests(self) -> None:
        """Serve messages in their order of arrival until `stop`, counting the thread's CPU seconds."""
        cpu_at_start, status = time.thread_time(), self.mpi().Status()
        while self._probe(status, self.mpi().ANY_SOURCE, HEADER_TAG):
            source = status.Get_source()
            header = np.empty(status.Get_count(self.mpi().DOUBLE), np.float64)
            self.channel.Recv(header, source=source, tag=HEADER_TAG)
            self._probe(status, source, MESSAGE_TAG)  # sent right after its header; `stop` comes after `meet`
            message = torch.empty(
                status.Get_count(self.mpi().BYTE) // self.held[0].element_size(), dtype=self.held[0].dtype
            )
            self.channel.Recv(message.numpy(), source=source, tag=MESSAGE_TAG)
            reply = self._apply(source // self.group.size, int(header[0]), message, header[1:].tolist())
            version = np.array([self.version], np.int64)
            wait_sleeping(
                [
                    self.channel.Isend(reply.numpy(), dest=source, tag=REPLY_TAG),
                    self.channel.Isend(version, dest=source, tag=VERSION_TAG),
                ]
            )
            self.cpu_s = self.cpu_before + time.thread_time() - cpu_at_start
        self.cpu_before = self.cpu_s = self.cpu_before + time.thread_time() - cpu_at_start

    def _probe(self, status, source: int, tag: int) -> bool:
        """Wait, sleeping between polls, until a message from `source` with `tag` arrived (True) or `stop` (False)."""
        poll = POLL_MIN_S
        while not self.channel.Iprobe(source=source, tag=tag, status=status):
            if self.stopping.wait(poll):
                return False
            poll = min(2 * poll, POLL_MAX_S)
        return True
