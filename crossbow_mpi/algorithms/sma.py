"""Synchronous model averaging (CROSSBOW).

Learner j, every iteration:
    g = ∇ℓ(w_j) + λ w_j;  v_j ← μ v_j − η g;  w_j' = w_j;  w_j ← w_j + v_j
Sync, every iteration:
    c_j = α (w_j' − z);  w_j ← w_j − c_j
    Δz = Σ_ranks Σ_j c_j;  Δz ← Δz + μ_z u;  u ← Δz;  z ← z + Δz
At a learning-rate drop every learner is reset to z.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.base import Algorithm


class SynchronousModelAveraging(Algorithm):
    name = "sma"

    def __init__(self, *args):
        super().__init__(*args)
        self.corrections = torch.empty(0)

    def step(self, lr: float) -> None:
        cfg, central, learners = self.config, self.central, self.learners
        w, v, g = learners.params, learners.momentum, learners.grads
        g.add_(w, alpha=cfg.weight_decay)
        v.mul_(cfg.momentum).sub_(g, alpha=lr)
        if self.corrections.shape != w.shape:
            self.corrections = torch.empty_like(w)
        corrections = torch.sub(w, central.params, out=self.corrections).mul_(cfg.alpha)
        w.add_(v).sub_(corrections)
        dz = self.allreduce_with_buffers(corrections)
        dz.add_(central.u, alpha=cfg.central_momentum)
        central.u.copy_(dz)
        central.params.add_(dz)

    def on_lr_drop(self) -> None:
        self.learners.reset_to(self.central.z)
