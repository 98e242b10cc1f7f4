"""Synchronous SGD: average every learner's gradient, one momentum step of z, learners become z.

g = (1 / K) Σ_ranks Σ_j ∇ℓ(w_j)          (w_j = z for every learner; K learners over all ranks)
d = g + λ z;  u ← μ u + d;  z ← z − η u
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.base import Algorithm


class SynchronousSGD(Algorithm):
    name = "ssgd"

    def local_step(self, rows: slice, lr: float) -> None:
        self.staged_rows(rows).copy_(self.learners.grads[rows])

    def sync(self, lr: float) -> None:
        hp, central = self.hp, self.central
        g, carried = self.allreduce_staged()
        g.div_(self.gradient_divisor(carried))
        g.add_(central.params, alpha=hp.weight_decay)
        central.u.mul_(hp.momentum).add_(g)
        central.params.sub_(central.u, alpha=lr)
        self.learners.reset_to(central.z)

    def gradient_divisor(self, carried: torch.Tensor) -> torch.Tensor | int:
        """Return K, the learners whose gradients one step averages: those the allreduce carried."""
        return carried
