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

The server also hands out the data. A round is a range of an epoch's samples: `begin_round` gives every group
its first step's position, and each exchange's reply carries the group's next one, in the order the groups ask,
until the round is taken; so a faster group takes more steps, and no sample is taken twice. `end_round` waits
for every group and returns where the round ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from crossbow_mpi.comm.base import POLL_MAX_S, POLL_MIN_S, Communicator, Reduction, wait_sleeping
from crossbow_mpi.comm.mpi import MpiCommunicator
from crossbow_mpi.runtime import ulfm

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
        self.given = group
        """The compute groups this transport was given (not its own to free)."""
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
        self.met = self._counters()
        """`version` and `updates` of the state every rank took at the last `meet` (or load), on every rank: what
        `state_dict` gives, since the server's thread may already apply a faster group's next round."""
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.cpu_before = self.cpu_s = 0.0
        """The server thread's CPU seconds: of its finished runs, and in all up to its latest update."""
        self.window = self._empty_window()
        self.position = self.round_end = self.limit = 0
        """On the server's rank: the next sample position to hand out, the round's end and the epoch's size."""

    def regroup(self, groups: int) -> None:
        """Use `groups` compute groups of consecutive ranks from now on (collective over `data`, after `meet` and
        `stop`); the per-group counts start afresh."""
        assert self.thread is None and self.data.size % groups == 0
        if groups not in self.splits:
            size = self.data.size // groups
            self.splits[groups] = MpiCommunicator(self.data.mpi_comm.Split(self.data.rank // size, self.data.rank))
        self._use_group(groups)
        self.updates = np.zeros(groups, np.int64)
        self.met = {**self.met, "updates": self.updates.tolist()}
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

    def begin_round(self, offset: int, end: int, limit: int, group_steps: Sequence[int]) -> int | None:
        """Start a round of the samples from `offset` to `end` of an epoch of `limit` samples, group γ taking
        `group_steps[γ]` samples per step; return this group's first position, None when it has none (collective
        over `data`, after `end_round`)."""
        position, firsts = offset, []
        for step in group_steps:
            first, position = take(position, step, end, limit)
            firsts.append(first)
        if self.data.rank == SERVER_RANK:
            with self.lock:
                self.position, self.round_end, self.limit = position, end, limit
            self._start()
        return firsts[self.group_index]

    def end_round(self) -> int:
        """Wait until every group took its last step of the round; return the position where the round ended
        (collective over `data`)."""
        wait_sleeping([self.data.mpi_comm.Ibarrier()])
        return self.data.bcast_json(self.position if self.data.rank == SERVER_RANK else None)

    def exchange(self, message: torch.Tensor, out: torch.Tensor, params: Sequence[float], step: int = 0) -> int | None:
        """Sum `message` over the group, have the server apply the sum with `params`, and put the state the server
        then holds into `out` on every rank of the group; return the position of the group's next step of `step`
        samples in the round, None when the round is taken (collective over the group)."""
        self.group.allreduce_sum_(message)
        position = self._push_pull(message, out, params, step) if self.group.rank == 0 else None
        self.group.broadcast_(out)
        return self.group.bcast_json(position) if self.group.size > 1 else position

    def _push_pull(self, message: torch.Tensor, out: torch.Tensor, params: Sequence[float], step: int) -> int | None:
        if self.data.rank == SERVER_RANK:
            self._start()
            state, position = self._apply(self.group_index, self.read_version, message.cpu(), params, step)
            out.copy_(state)
            self.read_version = self.version
            return position
        header = np.array([self.read_version, step, *params], dtype=np.float64)
        host = message.detach().cpu().numpy()
        reply = np.empty(out.numel(), dtype=host.dtype)
        version = np.zeros(2, np.int64)
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
        return None if version[1] < 0 else int(version[1])

    def _apply(
        self, group: int, read_version: int, message: torch.Tensor, params: Sequence[float], step: int
    ) -> tuple[torch.Tensor, int | None]:
        """Apply one group's message to the held state; return a copy of the state's first tensor and the position
        of the group's next step of `step` samples."""
        with self.lock:
            staleness = self.version - read_version
            assert self.apply is not None, "serve() sets it on the server's rank"
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
            position, self.position = take(self.position, step, self.round_end, self.limit)
            return self.held[0].clone(), position

    def meet(self, outs: Sequence[torch.Tensor]) -> None:
        """Give every rank the server's state once every group's last update is applied (collective over `data`):
        `outs[i]` becomes held tensor i."""
        wait_sleeping([self.data.mpi_comm.Ibarrier()])
        counters = None
        if self.data.rank == SERVER_RANK:
            with self.lock:
                for out, held in zip(outs, self.held, strict=True):
                    out.copy_(held)
                counters = self._counters()
        for out in outs:
            self.data.broadcast_(out, SERVER_RANK)
        self.met = self.data.bcast_json(counters)
        self.read_version = self.met["version"]
        if self.data.rank != SERVER_RANK:
            self.version = self.read_version

    def stop(self) -> None:
        """Stop the server thread (after `meet`: no message is in flight); the next exchange of group 0 restarts it."""
        if self.thread is not None:
            self.abandon()
            self._raise_error()

    def abandon(self) -> None:
        """Stop the server thread without its peers, which may be dead (after a rank loss, once its channel is
        revoked: a wait on a dead rank has failed)."""
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None

    def mpi_comms(self) -> list:
        return [self.channel, *(group.mpi_comm for group in self.splits.values())]

    def close(self) -> None:
        """Stop the server thread and free the server's channel and the compute groups made by `regroup`
        (collective over `data`, after `meet`: every exchange was answered, so no message is in flight)."""
        self.stop()
        self.channel.Free()
        for group in self.splits.values():
            if group is not self.given:
                group.mpi_comm.Free()
        self.splits = {}

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
                "async_updates": window["updates"].tolist(),
                "async_staleness": staleness.tolist(),
                "async_staleness_mean": float(np.arange(len(staleness)) @ staleness) / applied,
                "async_staleness_max": int(np.flatnonzero(staleness).max(initial=0)),
                "async_server_cpu_share": cpu_s / max(wall_s, 1e-9),
            }
        else:
            stats = None
        return self.data.bcast_json(stats)

    def state_dict(self) -> dict:
        """Return the server's counters as of the last `meet` (its tensors then are the run's central model)."""
        return {"version": self.met["version"], "updates": list(self.met["updates"])}

    def _counters(self) -> dict:
        return {"version": self.version, "updates": self.updates.tolist()}

    def load_state_dict(self, state: dict, held: Sequence[torch.Tensor]) -> None:
        """Restore the counters and, on the server's rank, the held state from `held`. The per-group counts start
        afresh when the groups changed (or the state is another algorithm's, without counters)."""
        self.version = self.read_version = state.get("version", 0)
        updates = np.array(state.get("updates", []), np.int64)
        self.updates = updates if len(updates) == self.groups else np.zeros(self.groups, np.int64)
        self.met = self._counters()
        if self.data.rank == SERVER_RANK:
            with self.lock:
                for mine, restored in zip(self.held, held, strict=True):
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
            if not ulfm.is_rank_loss(err):
                raise  # a lost peer is the main thread's to handle, without this thread's traceback

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
            reply, position = self._apply(
                source // self.group.size, int(header[0]), message, header[2:].tolist(), int(header[1])
            )
            version = np.array([self.version, -1 if position is None else position], np.int64)
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


def take(position: int, step: int, end: int, limit: int) -> tuple[int | None, int]:
    """Hand out a step of `step` samples at `position` if the round still has samples before `end` and the step
    fits in the epoch's `limit`; return its position (None when not) and the next position."""
    if position < end and position + step <= limit:
        return position, position + step
    return None, position
