"""Synchronous SGD: average every learner's gradient, one momentum step of z, learners become z.

    g = (1 / kP) Σ_ranks Σ_j ∇ℓ(w_j)          (w_j = z for every learner)
    d = g + λ z;  u ← μ u + d;  z ← z − η u
"""

from __future__ import annotations

from crossbow_mpi.algorithms.base import Algorithm


class SynchronousSGD(Algorithm):
    name = "ssgd"

    def prepare(self, rows: slice, lr: float) -> None:
        self.staged_rows(rows).copy_(self.learners.grads[rows])

    def sync(self, lr: float) -> None:
        cfg, central = self.config, self.central
        g = self.allreduce_staged()
        g.div_(self.learners.k * self.comm.size)
        g.add_(central.params, alpha=cfg.weight_decay)
        central.u.mul_(cfg.momentum).add_(g)
        central.params.sub_(central.u, alpha=lr)
        self.learners.reset_to(central.z)
