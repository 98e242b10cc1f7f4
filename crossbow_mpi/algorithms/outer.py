"""The outer optimizer of local-step SMA (DiLoCo; Douillard et al., arXiv 2311.08105, as torchft's
torchft/local_sgd.py implements it): after H local steps the learners' mean m is reduced and z takes one
torch.optim.SGD step on the pseudo-gradient Δ = z − m, then every learner restarts from z.

    nesterov:  u ← μ_o u + Δ;  z ← z − η_o (Δ + μ_o u)
    sgd:       u ← μ_o u + Δ;  z ← z − η_o u

With `--fragments F` (Streaming DiLoCo; Douillard et al., arXiv 2501.18512) the parameters are cut into F runs of
whole tensors, and every H/F steps one run, round-robin, takes this step alone: each run every H steps.
"""

from __future__ import annotations

import torch

from crossbow_mpi.replicas.flat import Slot


def outer_step(kind: str, delta: torch.Tensor, z: torch.Tensor, u: torch.Tensor, lr: float, momentum: float) -> None:
    """Move z by one SGD step of `kind` (`nesterov` or `sgd`) on the pseudo-gradient `delta` (overwritten), with the
    momentum buffer u."""
    if momentum > 0:
        u.mul_(momentum).add_(delta)
        if kind == "nesterov":
            delta.add_(u, alpha=momentum)
        else:
            delta = u
    z.sub_(delta, alpha=lr)


def fragment_columns(slots: list[Slot], fragments: int) -> list[slice]:
    """Cut the parameters' columns into `fragments` runs of whole tensors, in order, the runs' tensor counts
    differing by at most one (the first runs take the extra tensors)."""
    per, extra = divmod(len(slots), fragments)
    runs, first = [], 0
    for f in range(fragments):
        last = first + per + (f < extra)
        runs.append(slice(slots[first].offset, slots[last - 1].offset + slots[last - 1].numel))
        first = last
    return runs
