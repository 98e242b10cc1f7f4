"""Synchronous model averaging (CROSSBOW).

Learner j, every iteration (`local_step`, the learner's own):
    g = ∇ℓ(w_j) + λ w_j;  v_j ← μ v_j − η g;  c_j = α (w_j − z);  w_j ← w_j + v_j − c_j
Sync, every iteration:
    Δz = Σ_ranks Σ_j c_j;  Δz ← Δz + μ_z u;  u ← Δz;  z ← z + Δz
At a learning-rate drop every learner is reset to z.

A learner reads z only in its own `local_step`, so its next forward pass may overlap the sync.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.base import Algorithm


class SynchronousModelAveraging(Algorithm):
    name = "sma"
    overlaps_sync = True

    def local_step(self, rows: slice, lr: float) -> None:
        hp, learners = self.hp, self.learners
        w, v, g = learners.params[rows], learners.momentum[rows], learners.grads[rows]
        g.add_(w, alpha=hp.weight_decay)
        v.mul_(hp.momentum).sub_(g, alpha=lr)
        corrections = torch.sub(w, self.central.params, out=self.staged_rows(rows)).mul_(hp.alpha)
        w.add_(v).sub_(corrections)

    def sync(self, lr: float) -> None:
        central = self.central
        dz, _ = self.allreduce_staged()
        dz.add_(central.u, alpha=self.hp.central_momentum)
        central.u.copy_(dz)
        central.params.add_(dz)

    def on_lr_drop(self) -> None:
        self.learners.reset_to(self.central.z)
