"""Hang watchdog: abort the job, naming the missing ranks, when a rank stops taking part.

A background thread on a duplicated communicator exchanges heartbeats (rank, iteration) between rank 0 and
every other rank every `interval(timeout)` seconds, and calls MPI only then. When this rank's training loop has
made no progress for `timeout` seconds, the peers it has not heard from for that long, or that sat behind it at
one iteration for that long, are named and the job is aborted (within one interval after the timeout). A live
rank keeps sending heartbeats while it computes or writes, so only a rank that stopped (SIGSTOP, a hung node, a
deadlock) is ever blamed.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from crossbow_mpi.comm import Communicator
from crossbow_mpi.runtime import ulfm

if TYPE_CHECKING:
    from mpi4py import MPI

HEARTBEAT_TAG = 0x0CB0
MAX_INTERVAL_S = 5.0
BEATS_PER_TIMEOUT = 20


def interval(timeout: float) -> float:
    """Seconds between heartbeats, and between the thread's MPI calls: a twentieth of the timeout, at most
    MAX_INTERVAL_S. The thread's MPI calls slow the training loop's transfers over a slow link: at 10 Mbit/s SMA
    H = 4 fp32 trained at 0.86-0.93x the samples/s of a run without the watchdog with a beat a second and a poll
    every 50 ms, and at the same speed with 5 s (benchmarks/README.md, "The hang watchdog over a slow link")."""
    return min(MAX_INTERVAL_S, timeout / BEATS_PER_TIMEOUT)


class Watchdog:
    """Watch this rank's progress and its peers' heartbeats; abort the job on a hang."""

    def __init__(self, comm: Communicator, timeout: float):
        self.channel = comm.control_channel()
        self.rank = self.channel.rank
        self.size = self.channel.size
        self.timeout = timeout
        self.interval = interval(timeout)
        self.iteration = 0
        self.progressed_at = time.monotonic()
        peers = range(1, self.size) if self.rank == 0 else [0]
        now = time.monotonic()
        self.heard = {peer: (now, -1, now) for peer in peers}
        self.sent = np.zeros(self.size, dtype=np.int64)
        self.received = np.zeros(self.size, dtype=np.int64)
        """Heartbeats sent to and received from each rank (to receive every one before the channel is freed)."""
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self.thread.start()

    def progress(self, iteration: int) -> None:
        """Record that this rank's training loop reached an iteration."""
        self.iteration = iteration
        self.progressed_at = time.monotonic()

    def close(self) -> None:
        """Stop the thread, receive every heartbeat still in flight and free the channel (collective: call on every
        rank at the same point, after the last collective).

        Open MPI gives a freed communicator's id to the next one made, and a message still in flight would arrive
        there."""
        self.stop()
        expected = np.zeros(self.size, dtype=np.int64)
        self.channel.alltoall(self.sent, expected)
        while (self.received < expected).any():
            self.request.Wait()
            self._heard(time.monotonic())
        self.request.Cancel()
        self.request.Wait()
        self.channel.free()

    def stop(self) -> None:
        """Stop the thread only (after an error, when the other ranks may be anywhere: nothing collective)."""
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        try:
            self._beat()
        except Exception as err:
            if not ulfm.is_rank_loss(err):
                raise  # a peer that died (ULFM) ends the heartbeats: the training loop's collectives see it too

    def _beat(self) -> None:
        self.incoming = np.zeros(2, dtype=np.int64)
        self.request = self.channel.irecv_any(self.incoming, HEARTBEAT_TAG)
        sends: list[MPI.Request] = []
        while True:
            now = time.monotonic()
            beat = np.array([self.rank, self.iteration], dtype=np.int64)
            sends = [r for r in sends if not r.Test()]
            sends += [self.channel.isend(beat, peer, HEARTBEAT_TAG) for peer in self.heard]
            self.sent[list(self.heard)] += 1
            while self.request.Test():
                self._heard(now)
            missing = self.missing(now)
            if missing:
                self._abort(missing)
            if self.stopping.wait(self.interval):
                break
        self._mpi().Request.Waitall(sends)

    def _heard(self, now: float) -> None:
        """Record the heartbeat just received and listen for the next one."""
        peer, iteration = int(self.incoming[0]), int(self.incoming[1])
        _, previous, since = self.heard[peer]
        self.heard[peer] = (now, iteration, since if iteration == previous else now)
        self.received[peer] += 1
        self.request = self.channel.irecv_any(self.incoming, HEARTBEAT_TAG)

    def missing(self, now: float) -> list[int]:
        """Return the peers to blame when this rank has made no progress for `timeout` seconds."""
        if now - self.progressed_at <= self.timeout:
            return []
        return sorted(
            peer
            for peer, (last_heard, iteration, since) in self.heard.items()
            if now - last_heard > self.timeout or (iteration < self.iteration and now - since > self.timeout)
        )

    def _abort(self, missing: list[int]) -> None:
        names = ", ".join(map(str, missing))
        sys.stderr.write(
            f"crossbow_mpi: error: collective timeout: rank(s) {names} did not arrive within "
            f"{self.timeout:g} s (rank {self.rank} waiting after iteration {self.iteration}); "
            "aborting the job\n"
        )
        sys.stderr.flush()
        self._mpi().COMM_WORLD.Abort(4)

    @staticmethod
    def _mpi():
        from mpi4py import MPI

        return MPI
