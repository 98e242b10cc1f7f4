"""Synchronous model averaging (CROSSBOW).

Learner j, every iteration (`local_step`, the learner's own):
    g = ∇ℓ(w_j) + λ w_j;  v_j ← μ v_j − η g;  c_j = α (w_j − z);  w_j ← w_j + v_j − c_j
    (with `--clip-grad-norm c`, ∇ℓ(w_j) ← ∇ℓ(w_j) · min(1, c / (‖∇ℓ(w_j)‖ + 10⁻⁶)) first; with another optimizer
    than sgd, c_j = α (w_j − z);  w_j ← (learner j's optimizer step of w_j with ∇ℓ(w_j)) − c_j)
Sync, every iteration:
    Δz = Σ_ranks Σ_j c_j;  Δz ← Δz + μ_z u;  u ← Δz;  z ← z + Δz
    (μ_z = 0 while the learners' μ is 0, as CROSSBOW's synch/sma.c applies its central momentum only when the
    model's momentum is above 0; `--central-momentum-always` applies it regardless)
At a learning-rate drop every learner is reset to z.

A learner reads z only in its own `local_step`, so its next forward pass may overlap the sync. With
`--fused-step` the learners' update, correction and staging run as one fused kernel, and the central update as
another, with the same bits (crossbow_mpi.replicas.kernels).
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.base import Algorithm
from crossbow_mpi.replicas.kernels import SmaCentralUpdate, SmaUpdate
from crossbow_mpi.replicas.optimizers import clip_rows


class SynchronousModelAveraging(Algorithm):
    name = "sma"
    overlaps_sync = True
    fused_update: SmaUpdate | None = None
    """The fused learner step (`--fused-step`), or None for the in-place sequence (the same bits)."""
    fused_central: SmaCentralUpdate | None = None
    """The fused central step (`--fused-step`), or None for the in-place sequence (the same bits)."""

    def local_step(self, rows: slice, lr: float) -> None:
        hp, learners, z = self.hp, self.learners, self.central.params
        w, v, g = learners.params[rows], learners.momentum[rows], learners.grads[rows]
        corrections = self.staged_rows(rows)
        if hp.clip_grad_norm:
            clip_rows(g, hp.clip_grad_norm)
        if self.fused_update is not None:
            self.fused_update(w, v, g, z, corrections, lr, hp.weight_decay, hp.momentum, hp.alpha)
            return
        if learners.optimizers is not None:
            torch.sub(w, z, out=corrections).mul_(hp.alpha)
            learners.optimizers.step(rows, g, lr)
            w.sub_(corrections)
            return
        g.add_(w, alpha=hp.weight_decay)
        v.mul_(hp.momentum).sub_(g, alpha=lr)
        torch.sub(w, z, out=corrections).mul_(hp.alpha)
        w.add_(v).sub_(corrections)

    def sync(self, lr: float) -> None:
        central, hp = self.central, self.hp
        dz, _ = self.allreduce_staged()
        central_momentum = hp.central_momentum if hp.momentum > 0 or hp.central_momentum_always else 0.0
        if self.fused_central is not None:
            self.fused_central(dz, central.params, central.u, central_momentum)
            return
        dz.add_(central.u, alpha=central_momentum)
        central.u.copy_(dz)
        central.params.add_(dz)

    def on_lr_drop(self) -> None:
        self.learners.reset_to(self.central.z)
