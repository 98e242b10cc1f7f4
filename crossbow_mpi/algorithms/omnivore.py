"""Omnivore (Hadjis, Zhang, Mitliagkas, Iter, Ré, arXiv 1606.04487): S-SGD inside compute groups, asynchronous
updates of one central model across groups.

The P ranks form G groups of P/G consecutive ranks. Every step of group γ (crossbow_mpi.transports.model_server):

    g = Σ_r β_r Σ_j ∇ℓ(w_j) / Σ_r β_r k        (w_j = z_γ, the central model γ last read; β_r = b_r / max b: rank
                                                 r's share of the group's batch; k learners per rank)
    at the server, applied to whatever z is then:  u ← μ u + (g + λ z);  z ← z − η u
    every learner of γ becomes the new z

μ is the explicit momentum: `--momentum` less asynchrony's implicit 1 − 1/G (`explicit_momentum`), or as given
with `--explicit-momentum`. The momentum u is held with the central model on the server. As in the released
artifact, the group's batch is fixed: an int `--batch-size` b is one group step's batch per learner, split over
the group's P/G ranks (G·b/P each, as evenly as it goes), so that changing G changes the staleness only. z's
BatchNorm buffers become the mean over the group's learners, like S-SGD's over all. G = 1 is S-SGD with
`--batch-size` b/P, bit for bit; G = P is fully asynchronous. Groups meet, and every rank takes the server's z and
u, only where the whole world meets: at evaluations, checkpoints and the end (`meet`). The loop runs in rounds of
samples: within a round each group steps at its own pace on the positions the server hands out, so a faster group
takes more steps, no sample is taken twice in an epoch, and a slow group holds the others up only at the round's
end, for at most one of its steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crossbow_mpi.algorithms.rounds import RoundsAlgorithm
from crossbow_mpi.config import ConfigError
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
    weighs_by_samples = True

    def __init__(self, hp: HyperParams, transport: ModelServer, central: CentralModel, learners: Learners):
        super().__init__(hp, transport, central, learners)
        self.transport.serve((self.central.z, self.central.u), self.update_central)

    def batch_sizes(self, batch_size: int | tuple[int, ...]) -> tuple[int, ...]:
        """Return every rank's batch: an int is the group's batch, split over its ranks as evenly as it goes (the
        group's gradient weighs each rank by its samples); per-rank sizes (`hogbatch`: one group per rank) as given."""
        if not isinstance(batch_size, int):
            return tuple(batch_size)
        size = self.transport.group.size
        if batch_size < size:
            raise ConfigError(
                f"--batch-size {batch_size} is the batch of a compute group, split over its {size} ranks: use "
                f"{size} or more, or more --groups"
            )
        shares = [batch_size // size + (rank < batch_size % size) for rank in range(size)]
        return tuple(shares) * self.transport.groups

    def local_step(self, rows: slice, lr: float) -> None:
        gradients = self.staged_rows(rows)  # beside the gradients, which are in place already
        if self.weight != 1.0:
            gradients.mul_(self.weight)

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
