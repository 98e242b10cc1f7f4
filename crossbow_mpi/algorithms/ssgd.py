"""Synchronous SGD: average every learner's gradient by samples, one momentum step of z, learners become z.

g = Σ_ranks Σ_j ω_r ∇ℓ(w_j) / Σ_ranks Σ_j ω_r    (w_j = z for every learner; ω_r = b_r / max_q b_q, so that g is
                                                  the mean over every sample of the step; all 1 for equal batches)
g ← g · min(1, c / (‖g‖ + 10⁻⁶))                (with `--clip-grad-norm c`: the norm of every rank's gradient)
d = g + λ z;  u ← μ u + d;  z ← z − η u          (with another optimizer than sgd: z ← z's optimizer step with g)

With `--fused-step` the update of u and z runs as one fused kernel with the same bits (crossbow_mpi.replicas.kernels);
with clipping or another optimizer the step runs in place.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.base import Algorithm
from crossbow_mpi.replicas.kernels import SsgdUpdate
from crossbow_mpi.replicas.optimizers import clip_rows


class SynchronousSGD(Algorithm):
    name = "ssgd"
    weighs_by_samples = True
    learners_share_z = True
    stages_in_gradients = True
    fused_update: SsgdUpdate | None = None
    """The fused step of u and z (`--fused-step`), or None for the in-place sequence (the same bits)."""

    def local_step(self, rows: slice, lr: float) -> None:
        gradients = self.staged_rows(rows)
        if self.weight != 1.0:
            gradients.mul_(self.weight)

    def sync(self, lr: float) -> None:
        hp, central = self.hp, self.central
        g, carried = self.allreduce_staged()
        divisor = self.gradient_divisor(carried)
        if self.fused_update is not None:
            assert divisor is carried, "the fused step divides by the summed weight that the allreduce carried"
            self.fused_update(g, carried, central.params, central.u, lr, hp.weight_decay, hp.momentum)
        else:
            g.div_(divisor)
            if hp.clip_grad_norm:
                clip_rows(g.unsqueeze(0), hp.clip_grad_norm)
            if central.optimizer is not None:
                central.optimizer.step(slice(None), g.unsqueeze(0), lr)
                self.learners.reset_to(central.z)
                return
            g.add_(central.params, alpha=hp.weight_decay)
            central.u.mul_(hp.momentum).add_(g)
            central.params.sub_(central.u, alpha=lr)
        self.learners.reset_to(central.z)

    def gradient_divisor(self, carried: torch.Tensor) -> torch.Tensor | float:
        """Return the summed weight of the learners whose gradients one step averages: those the allreduce carried."""
        return carried
