"""Omnivore (Hadjis, Zhang, Mitliagkas, Iter, Ré, arXiv 1606.04487): S-SGD inside compute groups, asynchronous
updates of one central model across groups.

The P ranks form G groups of P/G consecutive ranks. Every step of group γ (crossbow_mpi.transports.model_server):

    g = Σ_r β_r Σ_j ∇ℓ(w_j) / Σ_r β_r k        (w_j = z_γ, the central model γ last read; β_r = b_r / max b: rank
                                                 r's share of the group's batch; k learners per rank)
    g ← g · min(1, c / (‖g‖ + 10⁻⁶))           (with `--clip-grad-norm c`: the norm of the group's gradient)
    at the server, applied to whatever z is then:  u ← μ u + s (g + λ z);  z ← z − η u
                                                 (s = 1, or hogbatch's b_r / B; with another optimizer than sgd:
                                                  the server's optimizer steps z with g and step size s η; its
                                                  state is held beside z and u)
    every learner of γ becomes the new z

μ is the explicit momentum: `--momentum` less asynchrony's implicit 1 − 1/G (`explicit_momentum`), or as given
with `--explicit-momentum`; it applies to sgd only (AdamW keeps its β₁: asynchrony's implicit momentum is not taken
from it). The momentum u is held with the central model on the server. As in the released artifact, the group's
batch is fixed: an int `--batch-size` b is one group step's batch per learner, split over the group's P/G ranks
(G·b/P each, as evenly as it goes), so that changing G changes the staleness only. z's BatchNorm buffers become the
mean over the group's learners, like S-SGD's over all. G = 1 is S-SGD with `--batch-size` b/P, bit for bit (with
AdamW and clipping too); G = P is fully asynchronous. Groups meet, and every rank takes the server's z and u (and
its optimizer's state), only where the whole world meets: at evaluations, checkpoints and the end (`meet`). The
loop runs in rounds of samples: within a round each group steps at its own pace on the positions the server hands
out, so a faster group takes more steps, no sample is taken twice in an epoch, and a slow group holds the others up
only at the round's end, for at most one of its steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crossbow_mpi.algorithms.rounds import RoundsAlgorithm
from crossbow_mpi.config import ConfigError
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.optimizers import RowOptimizers, clip_rows
from crossbow_mpi.replicas.state import HyperParams
from crossbow_mpi.transports.model_server import ModelServer


def explicit_momentum(total: float, groups: int) -> float:
    """Return the explicit momentum that, beside the implicit momentum 1 − 1/G of G asynchronous groups, makes
    `total` (Hadjis et al., arXiv 1606.04487; Mitliagkas et al., arXiv 1605.09774), with a floor of 0."""
    return max(0.0, total - (1 - 1 / groups))


class Omnivore(RoundsAlgorithm):
    name = "omnivore"
    learners_share_z = True
    stages_in_gradients = True
    weighs_by_samples = True

    def __init__(self, hp: HyperParams, transport: ModelServer, central: CentralModel, learners: Learners):
        super().__init__(hp, transport, central, learners)
        self.server_optimizer: RowOptimizers | None = None
        """On the server's rank, with another optimizer than sgd: the server's, stepping its held z (made at its
        first use: the run gives z its optimizer after building the algorithm)."""
        self.step_scale = 1.0
        """s: the factor of this group's updates at the server (hogbatch with `batch_scaled_lr`: b_r / B)."""
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
            self.sum_staged(), self.central.z, (lr, hp.momentum, hp.weight_decay, self.step_scale), self.group_step
        )
        self.learners.reset_to(self.central.z)

    def update_central(self, held: Sequence[torch.Tensor], message: torch.Tensor, params: Sequence[float]) -> None:
        """Apply one group's summed message [gradients | buffers | learners] to the server's z and u, or step z with
        the server's optimizer."""
        (z, u), (lr, momentum, weight_decay, scale) = held, params
        num_params, carried = u.numel(), message[-1:]
        torch.div(message[num_params:-1], carried, out=z[num_params:])
        g = message[:num_params].div_(carried)
        if self.hp.clip_grad_norm:
            clip_rows(g.unsqueeze(0), self.hp.clip_grad_norm)
        optimizer = self._server_optimizer()
        if optimizer is not None:
            optimizer.step(slice(None), g.unsqueeze(0), lr * scale)
            return
        g.add_(z[:num_params], alpha=weight_decay)
        u.mul_(momentum).add_(g, alpha=scale)
        z[:num_params].sub_(u, alpha=lr)

    def _server_optimizer(self) -> RowOptimizers | None:
        """Return the server's optimizer (on the server's rank, with another optimizer than sgd), else None."""
        if self.central.optimizer is None or not self.transport.held:
            return None
        if self.server_optimizer is None:
            params = self.transport.held[0][: self.central.u.numel()].unsqueeze(0)
            self.server_optimizer = RowOptimizers(self.central.optimizer.optimizer_fn, params)
        return self.server_optimizer

    def meet(self) -> None:
        """Every rank takes the server's z and u, its optimizer's state, and its non-float buffers (collective)."""
        self.transport.meet((self.central.z, self.central.u))
        if self.central.optimizer is not None:
            self._share_optimizer_state()
        self.share_extra_state()
        self.learners.reset_to(self.central.z)

    def _share_optimizer_state(self) -> None:
        """Give every rank's z's optimizer the server optimizer's state (collective, after `meet`: no update is in
        flight), so that checkpoints and exports hold it."""
        optimizer = self._server_optimizer()
        state = self.transport.data.bcast_tensors(optimizer.state_dict() if optimizer is not None else None)
        assert self.central.optimizer is not None
        self.central.optimizer.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        """Restore the server's counters, held z and u, and its optimizer's state from z's (loaded before)."""
        self.transport.load_state_dict(state, (self.central.z, self.central.u))
        optimizer = self._server_optimizer()
        if optimizer is not None:
            assert self.central.optimizer is not None
            with self.transport.lock:
                optimizer.load_state_dict(self.central.optimizer.state_dict())
