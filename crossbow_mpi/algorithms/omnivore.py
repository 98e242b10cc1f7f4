"""Omnivore (Hadjis, Zhang, Mitliagkas, Iter, Ré, arXiv 1606.04487): S-SGD inside compute groups, asynchronous
updates of one central model across groups.

The P ranks form G groups of P/G consecutive ranks. Every step of group γ (crossbow_mpi.transports.model_server):

    g = (1 / K_γ) Σ_{ranks of γ} Σ_j ∇ℓ(w_j)        (w_j = z_γ, the central model γ last read; K_γ its learners)
    at the server, applied to whatever z is then:  u ← μ u + (g + λ z);  z ← z − η u
    every learner of γ becomes the new z

μ is the explicit momentum: `--momentum` less asynchrony's implicit 1 − 1/G (`explicit_momentum`), or as given with
`--explicit-momentum`. The momentum u is held with the central model on the server. z's BatchNorm buffers become the mean over the
group's learners, like S-SGD's over all. G = 1 is S-SGD, bit for bit; G = P is fully asynchronous. Groups meet,
and every rank takes the server's z and u, only where the whole world meets: at evaluations, checkpoints and
the end (`meet`). The loop runs in rounds of samples: within a round each group steps at its own pace on the
positions the server hands out, so a faster group takes more steps, no sample is taken twice in an epoch, and
a slow group holds the others up only at the round's end, for at most one of its steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crossbow_mpi.algorithms.rounds import RoundsAlgorithm
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.state import HyperParams
from crossbow_mpi.transports.model_server import ModelServer


def explicit_momentum(total: float, groups: int) -> float:
    """Return the explicit momentum that, beside the implicit momentum 1 − 1/G of G asynchronous groups, makes
    `total` (Hadjis et al., arXiv 1606.04487; Mitliagkas et al., arXiv 1605.09774), with a floor of 0."""
    return max(0.0, total - (1 - 1 / groups))


class Omnivore(RoundsAlgorithm):
    name = "omnivore"
    learners_share_z = True
    stages_gradients = True

    def __init__(self, hp: HyperParams, transport: ModelServer, central: CentralModel, learners: Learners):
        super().__init__(hp, transport, central, learners)
        self.transport.serve((self.central.z, self.central.u), self.update_central)

    def local_step(self, rows: slice, lr: float) -> None:
        self.staged_rows(rows)  # beside the gradients, which are in place already

    def sync(self, lr: float) -> None:
        hp = self.hp
        self.next_position = self.transport.exchange(
            self.sum_staged(), self.central.z, (lr, hp.momentum, hp.weight_decay), self.group_step
        )
        self.learners.reset_to(self.central.z)

    def update_central(self, held: Sequence[torch.Tensor], message: torch.Tensor, params: Sequence[float]) -> None:
        """Apply one group's summed message [gradients | buffers | learners] to the server's z and u."""
        (z, u), (lr, momentum, weight_decay) = held, params
        num_params, carried = u.numel(), message[-1:]
        torch.div(message[num_params:-1], carried, out=z[num_params:])
        g = message[:num_params].div_(carried)
        g.add_(z[:num_params], alpha=weight_decay)
        u.mul_(momentum).add_(g)
        z[:num_params].sub_(u, alpha=lr)

    def meet(self) -> None:
        """Every rank takes the server's z and u, and its non-float buffers (collective)."""
        self.transport.meet((self.central.z, self.central.u))
        self.share_extra_state()
        self.learners.reset_to(self.central.z)

    def load_state_dict(self, state: dict) -> None:
        self.transport.load_state_dict(state, (self.central.z, self.central.u))
