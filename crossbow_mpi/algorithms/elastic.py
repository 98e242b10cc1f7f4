"""Adaptive elastic averaging (Ma, Rusu, Wu and Sim, arXiv 2110.07029): every rank takes local momentum-SGD steps
at its own pace on batches handed out as it is free, and the models merge every round, weighted by the updates
each rank made (normalised merging).

Learner j of rank i, every local step (its own batch of b_i samples, taken from the round as soon as the rank is
free; its step size scaled linearly with its batch size, as the paper's code does):
    g = ∇ℓ(w_j) + λ w_j;  η_i = η b_i / mean_q b_q;  v_j ← μ v_j − η_i g;  w_j ← w_j + v_j
At the round's end (every `--round-samples` samples), with u_i the local steps rank i took in the round:
    p_i = u_i / Σ_q u_q                                  (normalised merging)
    m = Σ_i p_i (1/k) Σ_j w_j                            (z's BatchNorm buffers: the same mean of the learners')
    Δz = m − z;  Δz ← Δz + μ_z u;  u ← Δz;  z ← z + Δz       (SMA's central momentum step; μ_z: `merge_momentum`)
    every learner restarts from z (keeping its momentum v_j)
With `--outer-optimizer nesterov|sgd` z takes the outer optimizer's step on Δ = z − m instead
(crossbow_mpi.algorithms.outer; `sgd` with outer lr 1 and outer momentum μ_z is the step above).

With `--adaptive-batch`, a faster rank's batches grow until the ranks make equal numbers of updates per round,
as in Adaptive Hogbatch. The model server only hands out the data: it holds no model.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.outer import outer_step
from crossbow_mpi.algorithms.rounds import RoundsAlgorithm
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.state import HyperParams
from crossbow_mpi.transports.model_server import ModelServer


class ElasticAveraging(RoundsAlgorithm):
    name = "elastic"

    def __init__(self, hp: HyperParams, transport: ModelServer, central: CentralModel, learners: Learners):
        super().__init__(hp, transport, central, learners)
        self.ticket = central.z.new_zeros(1)
        """What a step sends the server: nothing to apply, only the request for the next position."""
        self.round_steps = 0
        """Local steps this rank took in the current round."""
        self.lr_scale = 1.0
        """b_i / mean_q b_q for the current round."""
        self.transport.serve((self.ticket,), lambda held, message, params: None)

    def begin_round(self, offset: int, end: int, limit: int, learners: int, batch_sizes: tuple[int, ...]) -> int | None:
        self.lr_scale = batch_sizes[self.transport.data.rank] * len(batch_sizes) / sum(batch_sizes)
        return super().begin_round(offset, end, limit, learners, batch_sizes)

    def local_step(self, rows: slice, lr: float) -> None:
        hp, learners = self.hp, self.learners
        w, v, g = learners.params[rows], learners.momentum[rows], learners.grads[rows]
        g.add_(w, alpha=hp.weight_decay)
        v.mul_(hp.momentum).sub_(g, alpha=lr * self.lr_scale)
        w.add_(v)

    def sync(self, lr: float) -> None:
        self.next_position = self.transport.exchange(self.ticket, self.ticket, (), self.group_step)
        self.round_steps += 1

    def end_round(self) -> int:
        """Wait for every rank to finish the round, then merge the models by their update shares (collective)."""
        position = super().end_round()
        hp, central, learners = self.hp, self.central, self.learners
        self.allocate_message()
        self.weight = float(self.round_steps)
        torch.mul(learners.params, self.weight, out=self.staged_rows(slice(None)))
        merged, carried = self.allreduce_staged(self.transport.data)
        if hp.outer_optimizer != "central":
            delta = torch.sub(central.params, merged.div_(carried))
            outer_step(hp.outer_optimizer, delta, central.params, central.u, hp.outer_lr, hp.outer_momentum)
        else:
            dz = merged.div_(carried).sub_(central.params)
            dz.add_(central.u, alpha=hp.merge_momentum)
            central.u.copy_(dz)
            central.params.add_(dz)
        learners.reset_to(central.z)
        self.round_steps = 0
        return position

    def meet(self) -> None:
        """Give every rank the server rank's non-float buffers (z is the same on every rank after a round)."""
        self.share_extra_state()

    def statistics(self) -> dict:
        stats = super().statistics()
        return {"async_updates": stats["async_updates"], "async_server_cpu_share": stats["async_server_cpu_share"]}

    def load_state_dict(self, state: dict) -> None:
        self.transport.load_state_dict(state, (self.ticket,))
