"""eager-SGD (Li, Ben-Nun, Di Girolamo, Alistarh, Hoefler, PPoPP 2020): S-SGD over a partial allreduce.

At every step each rank puts the sum of its learners' gradients into its accumulator and applies its next round n
(crossbow_mpi.transports.partial_allreduce: solo or majority rounds, a synchronous one at least every
`--eager-sync-every`):

    g_n = Σ_{contributions carried by round n} Σ_j ω_r ∇ℓ(w_j) / (k Σ_ranks ω_r)   (a late one lands in a later
                                                                                 round; ω_r as in S-SGD)
    d = g_n + λ z;  u ← μ u + d;  z ← z − η u;  every learner becomes z

This is SynchronousSGD's step over the partial allreduce (its transport), dividing by every learner of every rank
rather than by those the round carried, so every rank applies the same rounds in the same order and holds the
same z at every step, and a round that carries every rank's fresh gradient is S-SGD's step, bit for bit (with
`--comm mpi`; rounds always travel over MPI). BatchNorm running statistics travel in every round with the
gradients: z's buffers become the mean over the learners whose gradients the round carried. `drain` fires one
synchronous round that empties every accumulator and applies it like a step, so a checkpoint or the end of a run
holds every gradient. The number of learners per rank stays fixed (no `--learners auto`): a round divides by one k.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.ssgd import SynchronousSGD
from crossbow_mpi.transports.partial_allreduce import PartialAllreduce


class EagerSGD(SynchronousSGD):
    name = "eager"
    transport: PartialAllreduce
    transport_kind = "partial"

    lr: float | None = None
    """The latest step's learning rate; a drained round is applied with it."""

    def sync(self, lr: float) -> None:
        self.lr = lr
        super().sync(lr)

    def gradient_divisor(self, carried: torch.Tensor) -> float:
        return self.learners.k * sum(self.weights)

    def drain(self) -> None:
        if self.transport.drain():
            assert self.lr is not None, "a round drains after a step"
            super().sync(self.lr)

    def statistics(self) -> dict:
        return self.transport.statistics()

    def state_dict(self) -> dict:
        return {"lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.lr = state.get("lr")
