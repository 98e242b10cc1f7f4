"""Partial allreduce (eager-SGD's solo and majority collectives): rounds that fire without waiting for every rank.

Every rank keeps an accumulator. `allreduce_sum_(x)` puts x into it (the rank *arrives* at its next round) and
returns that round's sum. Rounds are numbered and fire in order; when a round fires, every rank joins it with
whatever its accumulator holds at that moment (nothing, if its own x is not there yet) and empties it. A late x
goes into a later round: it is stale, never lost and never counted twice.

    solo       any rank's arrival activates a round
    majority   only the arrival of the round's initiator, drawn from the seed (the same on every rank), does
    sync       the first round, where every rank starts its progress thread, and every `sync_every`-th round
               after it wait for every rank's arrival, so no x waits more than `sync_every` − 1 rounds
    drain      a synchronous round that adds nothing and stops the progress threads; the next round is a first

Activation spreads over a hypercube: a rank activated by its own arrival or by a neighbour's message sends one
message to each neighbour, so every rank receives exactly one message from each neighbour per eager round.
A progress thread per rank, on its own duplicated communicator, handles activations and the rounds' collectives
while the main thread computes: a small non-blocking allreduce of the round's staleness histogram, which every
rank joins, then, when the round carries anything, one blocking `MpiCommunicator.allreduce_sum_` of the sums,
so that a round holding every rank's fresh x gives the bits of an MPI allreduce (rounds always travel over MPI,
also when the job's communicator is NCCL). Waits poll with short sleeps: MPI's blocking waits spin and would take
a core from the learners.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from crossbow_mpi.comm.base import POLL_MAX_S, POLL_MIN_S, Communicator, Reduction, wait_sleeping
from crossbow_mpi.comm.mpi import MpiCommunicator
from crossbow_mpi.config import EAGER_MODES, ConfigError
from crossbow_mpi.runtime import ulfm

ACTIVATE_TAG = 0x0EA6


@dataclass
class Round:
    """One fired round, the same on every rank."""

    kind: str
    """`eager` (activated by solo or majority arrivals), `sync` (waits for every rank) or `drain`."""
    staleness: np.ndarray
    """Contributions it carried by rounds waited (index 0: fresh, arrived for this round)."""
    total: torch.Tensor | None
    """The sum of its contributions; None when it carried none."""
    carried: list[int]
    """The rounds this rank's contributions that it carried arrived for."""

    @property
    def contributions(self) -> int:
        return int(self.staleness.sum())


class PartialAllreduce(Communicator):
    """`allreduce_sum_` as a partial collective over the ranks of `comm` (see the module docstring)."""

    def __init__(self, comm: Communicator, mode: str, sync_every: int, seed: int):
        super().__init__(comm.mpi_comm)
        assert mode in EAGER_MODES and sync_every >= 1
        if self.mpi().Query_thread() < self.mpi().THREAD_MULTIPLE:
            raise ConfigError("partial collectives need MPI initialised with MPI_THREAD_MULTIPLE")
        self.comm = comm
        self.mode = mode
        self.sync_every = sync_every
        self.seed = seed
        self.neighbours = [
            self.rank ^ bit
            for bit in (1 << i for i in range((self.size - 1).bit_length()))
            if self.rank ^ bit < self.size
        ]
        self.cond = threading.Condition()
        self.pending: list[tuple[int, torch.Tensor]] = []
        """Contributions not yet in a round, with the round each arrived for (shared, under cond)."""
        self.arrival = (-1, "eager")
        """The round the main thread last arrived at, and its kind (shared, under cond)."""
        self.fired: dict[int, Round] = {}
        """Rounds fired and not yet returned to the main thread (shared, under cond)."""
        self.arrived: dict[int, list[torch.Tensor]] = {}
        """This rank's contributions by the round they arrived for, until the main thread has the round that
        carried them (the main thread's own; `unlanded`)."""
        self.error: BaseException | None = None
        self.next_round = 0
        self.eager_since_sync = 0
        self.thread: threading.Thread | None = None
        self.drained: Round | None = None
        self.last: Round | None = None
        """The round the last `allreduce_sum_` returned (for inspection)."""
        self.window = self._empty_window()

    def initiator(self, number: int) -> int:
        """Return the rank whose arrival activates majority round `number` (the same draw on every rank)."""
        return random.Random(self.seed * 1_000_003 + number).randrange(self.size)

    def allreduce_sum_(self, tensor: torch.Tensor) -> Reduction:
        """Put a copy of `tensor` into this rank's accumulator, wait for this rank's next round and replace `tensor`
        by the round's sum, which carries the round's contributions. After `drain` returned True, return the
        drained round instead, adding nothing."""
        if self.drained is None:
            synchronous = self.thread is None or self.eager_since_sync == self.sync_every - 1
            self.last = self._arrive(_settled(tensor.clone()), "sync" if synchronous else "eager")
        else:
            self.last, self.drained = self.drained, None
        assert self.last.total is not None, "a round this rank arrived at carries its contribution"
        return Reduction(tensor.copy_(self.last.total), self.last.contributions)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self.comm.broadcast_(tensor, root)

    def drain(self) -> bool:
        """Fire a synchronous round that empties every rank's accumulator, adding nothing, and stop the progress
        thread (collective). Return whether the round carried anything; then the next `allreduce_sum_` returns it."""
        if self.thread is None:
            return False
        drained = self._arrive(None, "drain")
        self.thread.join()
        self.thread = None
        self.channel.Free()
        if drained.total is not None:
            self.drained = drained
        return self.drained is not None

    def close(self) -> None:
        assert self.thread is None, "drain before close: the drain frees the progress thread's communicator"

    def mpi_comms(self) -> list:
        return [self.mpi_comm, *([self.channel] if self.thread is not None else [])]

    def abandon(self) -> None:
        """Stop the progress thread without its peers, which may be dead (after a rank loss, once its channel is
        revoked: its waits on them have failed)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def unlanded(self) -> list[torch.Tensor]:
        """Return this rank's contributions that no round returned to the main thread has carried yet."""
        return [contribution for held in self.arrived.values() for contribution in held]

    def restore(self, unlanded: list[torch.Tensor]) -> None:
        """Put contributions that no round carried yet (`unlanded` of a rollback, before the first round) into
        the accumulator: the first round, synchronous, carries them."""
        assert self.thread is None
        self.arrived = {self.next_round: list(unlanded)} if unlanded else {}
        self.pending = [(self.next_round, contribution) for contribution in unlanded]

    def statistics(self) -> dict:
        """Return and reset what the rounds returned since the last call: rounds fired, synchronous rounds (firsts
        and every sync_every-th), fresh contributions per round (drains aside), the staleness histogram, and the
        main thread's mean wait per round for its round to fire (ms)."""
        window, self.window = self.window, self._empty_window()
        staleness = window["staleness"].tolist()
        while staleness and staleness[-1] == 0:
            staleness.pop()
        return {
            "eager_rounds": window["rounds"],
            "eager_sync_rounds": window["sync"],
            "eager_fresh_per_round": window["fresh"] / max(window["rounds"] - window["drains"], 1),
            "eager_staleness": staleness,
            "eager_wait_ms": 1e3 * window["wait_s"] / max(window["rounds"], 1),
        }

    def _empty_window(self) -> dict:
        return {
            "rounds": 0,
            "sync": 0,
            "drains": 0,
            "fresh": 0,
            "staleness": np.zeros(self.sync_every, np.int64),
            "wait_s": 0.0,
        }

    def _arrive(self, contribution: torch.Tensor | None, kind: str) -> Round:
        """Arrive at the next round with a contribution (or none) and return the round once it fired."""
        if self.thread is None:
            assert kind == "sync" and contribution is not None
            self._start(contribution)
        number = self.next_round
        if contribution is not None:
            self.arrived.setdefault(number, []).append(contribution)
        started = time.perf_counter()
        with self.cond:
            if contribution is not None:
                self.pending.append((number, contribution))
            self.arrival = (number, kind)
            self.cond.notify_all()
            self.cond.wait_for(lambda: number in self.fired or self.error is not None)
            if self.error is not None:
                raise RuntimeError("the partial allreduce's progress thread failed") from self.error
            fired = self.fired.pop(number)
        assert fired.kind == kind
        for arrived in fired.carried:
            self.arrived.pop(arrived, None)
        self.next_round += 1
        self.eager_since_sync = self.eager_since_sync + 1 if kind == "eager" else 0
        self.window["wait_s"] += time.perf_counter() - started
        self.window["rounds"] += 1
        self.window["sync"] += kind == "sync"
        self.window["drains"] += kind == "drain"
        self.window["fresh"] += int(fired.staleness[0])
        self.window["staleness"] += fired.staleness
        return fired

    def _start(self, template: torch.Tensor) -> None:
        """Start the progress thread on a duplicated communicator (collective: the first round is synchronous)."""
        self.channel = self.mpi_comm.Dup()
        self.transport = MpiCommunicator(self.channel)
        self.zeros = torch.zeros_like(template)
        self.thread = threading.Thread(
            target=self._progress, args=(self.next_round,), name="partial-allreduce", daemon=True
        )
        self.thread.start()

    def _progress(self, number: int) -> None:
        try:
            self._rounds(number)
        except BaseException as err:
            with self.cond:
                self.error = err
                self.cond.notify_all()
            if not ulfm.is_rank_loss(err):
                raise  # a lost peer is the main thread's to handle, without this thread's traceback

    def _rounds(self, number: int) -> None:
        """Fire rounds from `number` on, in order, until a drain round."""
        inbox = np.zeros(len(self.neighbours), dtype=np.int64)
        recvs = self._listen(inbox)
        while True:
            kind = self._activation(number, recvs)
            outbox = np.array([number], dtype=np.int64)
            sends = (
                [self.channel.Isend(outbox, dest=n, tag=ACTIVATE_TAG) for n in self.neighbours]
                if kind == "eager"
                else []
            )
            with self.cond:
                taken, self.pending = self.pending, []
            staleness = np.bincount([number - arrived for arrived, _ in taken], minlength=self.sync_every)
            assert len(staleness) == self.sync_every, "a contribution waited past a synchronous round"
            wait_sleeping([self.channel.Iallreduce(self.mpi().IN_PLACE, staleness)])  # every rank joins
            total = None
            if staleness.any():
                contributions = [contribution for _, contribution in taken] or [self.zeros]
                # a sum of its own, reduced in place: a contribution stays as it arrived (a rollback copies it)
                total = functools.reduce(torch.add, contributions[1:], contributions[0].clone())
                _settled(self.transport.allreduce_sum_(total).total)
            if kind == "eager":
                wait_sleeping(recvs + sends)
                assert (inbox == number).all(), "activation messages out of step"
                recvs = self._listen(inbox)
            with self.cond:
                self.fired[number] = Round(kind, staleness, total, [arrived for arrived, _ in taken])
                self.cond.notify_all()
            if kind == "drain":
                break
            number += 1
        for request in recvs:
            request.Cancel()
        self.mpi().Request.Waitall(recvs)

    def _listen(self, inbox: np.ndarray) -> list:
        """Post one receive per neighbour for the next activation message."""
        return [
            self.channel.Irecv(inbox[i : i + 1], source=neighbour, tag=ACTIVATE_TAG)
            for i, neighbour in enumerate(self.neighbours)
        ]

    def _activation(self, number: int, recvs: list) -> str:
        """Wait until round `number` is activated, by this rank's arrival or a neighbour's message; return its kind."""
        activates = self.mode == "solo" or self.initiator(number) == self.rank
        poll = POLL_MIN_S
        while True:
            with self.cond:
                arrived, kind = self.arrival
                if arrived == number and (kind != "eager" or activates):
                    return kind
                self.cond.wait(poll)
            if any(request.Test() for request in recvs):
                return "eager"
            poll = min(2 * poll, POLL_MAX_S)


def _settled(tensor: torch.Tensor) -> torch.Tensor:
    """Wait until the current CUDA stream has written a device tensor, so that another thread (on its own
    stream) may read it; CPU tensors are returned as they are."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    return tensor
