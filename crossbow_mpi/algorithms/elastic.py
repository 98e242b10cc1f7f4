"""Adaptive elastic averaging (Ma, Rusu, Wu and Sim, arXiv 2110.07029; their code: YMA33/HeteroGPU,
`Scheduler/source/GPUGDScheduler.cu`): every rank takes local SGD steps at its own pace on batches handed out as
it is free, and the models merge every round, weighted by the updates each rank made (normalised merging).

Learner j of rank i, every local step (its own batch of b_i samples, taken from the round as soon as the rank is
free; its step size scaled by its batch size over a fixed base batch B, as the artifact's lr_i):
    g = ∇ℓ(w_j) + λ w_j;  η_i = η b_i / B;  v_j ← μ_l v_j − η_i g;  w_j ← w_j + v_j
    (with `--clip-grad-norm`, ∇ℓ(w_j) clipped first, as SMA's; with another optimizer than sgd,
    w_j ← learner j's optimizer step of w_j with ∇ℓ(w_j) and learning rate η_i)
At the round's end (every `--round-samples` samples), with u_i the local steps rank i took in the round:
    p_i = u_i / Σ_q u_q                                  (normalised merging)
    with `merge_l2`: p_max ← 1.1 p_max, p_min ← 0.9 p_min   (the artifact's adaptive normalisation, not renormalised)
    m = Σ_i p_i (1/k) Σ_j w_j                            (z's BatchNorm buffers: the mean weighted by u_i)
    Δz = m − z;  Δz ← Δz + μ_z u;  u ← Δz;  z ← z + Δz       (SMA's central momentum step)
    every learner restarts from z (keeping v_j)
The artifact's local steps are plain SGD and its momentum is at the merge: μ_l = 0, μ_z = `momentum`; with
`local_momentum`, μ_l = `momentum` and μ_z = `merge_momentum`. (The artifact's merge-momentum kernel is not in
its released code; SMA's step stands in for it.)
With `--outer-optimizer nesterov|sgd` z takes the outer optimizer's step on Δ = z − m instead
(crossbow_mpi.algorithms.outer; `sgd` with outer lr 1 and outer momentum μ_z is the step above).

With `--adaptive-batch`, a faster rank's batches grow until the ranks make equal numbers of updates per round,
as in the artifact. The model server only hands out the data: it holds no model.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.outer import outer_step
from crossbow_mpi.algorithms.rounds import RoundsAlgorithm
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.optimizers import clip_rows
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
        """b_i / B for the current round."""
        self.transport.serve((self.ticket,), lambda held, message, params: None)

    def begin_round(self, offset: int, end: int, limit: int, learners: int, batch_sizes: tuple[int, ...]) -> int | None:
        base = self.hp.base_batch or sum(batch_sizes) / len(batch_sizes)  # 0 only in a checkpoint from before B
        self.lr_scale = batch_sizes[self.transport.data.rank] / base
        return super().begin_round(offset, end, limit, learners, batch_sizes)

    def local_step(self, rows: slice, lr: float) -> None:
        hp, learners = self.hp, self.learners
        w, v, g = learners.params[rows], learners.momentum[rows], learners.grads[rows]
        if hp.clip_grad_norm:
            clip_rows(g, hp.clip_grad_norm)
        if learners.optimizers is not None:
            learners.optimizers.step(rows, g, lr * self.lr_scale)
            return
        g.add_(w, alpha=hp.weight_decay)
        v.mul_(hp.momentum if hp.local_momentum else 0.0).sub_(g, alpha=lr * self.lr_scale)
        w.add_(v)

    def sync(self, lr: float) -> None:
        self.next_position = self.transport.exchange(self.ticket, self.ticket, (), self.group_step)
        self.round_steps += 1

    def end_round(self) -> int:
        """Wait for every rank to finish the round, then merge the models by their update shares (collective)."""
        position = super().end_round()
        hp, central, learners = self.hp, self.central, self.learners
        self.allocate_message()
        self.weight, unnormalised = float(self.round_steps), 1.0
        if hp.merge_l2:
            steps = [float(u) for u in self.transport.data.allgather_json(self.round_steps)]
            weights = normalised_l2(steps)
            self.weight, unnormalised = weights[self.transport.data.rank], sum(steps) / sum(weights)
        torch.mul(learners.params, self.weight, out=self.staged_rows(slice(None)))
        merged, carried = self.allreduce_staged(self.transport.data)
        merged.div_(carried * unnormalised)  # with merge_l2: Σ_i p_i w_i, Σ p_i ≠ 1
        if hp.outer_optimizer != "central":
            delta = torch.sub(central.params, merged)
            outer_step(hp.outer_optimizer, delta, central.params, central.u, hp.outer_lr, hp.outer_momentum)
        else:
            dz = merged.sub_(central.params)
            dz.add_(central.u, alpha=hp.merge_momentum if hp.local_momentum else hp.momentum)
            central.u.copy_(dz)
            central.params.add_(dz)
        learners.reset_to(central.z)
        self.round_steps = 0
        return position

    def dry_message(self) -> torch.Tensor:
        """The merge carries the learners' parameters themselves (weighted by at least 1 step)."""
        message = super().dry_message()
        message[: self.learners.layout.num_params] = self.learners.params.sum(0)
        return message

    def meet(self) -> None:
        """Give every rank the server's counters and the server rank's non-float buffers (z is the same on every
        rank after a round), so that any rank can take the server over (collective)."""
        self.transport.meet((self.ticket,))
        self.share_extra_state()

    def statistics(self) -> dict:
        stats = super().statistics()
        return {"async_updates": stats["async_updates"], "async_server_cpu_share": stats["async_server_cpu_share"]}

    def load_state_dict(self, state: dict) -> None:
        self.transport.load_state_dict(state, (self.ticket,))


def normalised_l2(steps: list[float]) -> list[float]:
    """HeteroGPU's adaptive normalisation: the first rank with the most updates gains a tenth of its weight, the
    first with the fewest loses a tenth of its own (both the same rank when all are equal: no change)."""
    top, bottom = steps.index(max(steps)), steps.index(min(steps))
    weights = list(steps)
    weights[top] += steps[top] / 10
    weights[bottom] -= steps[bottom] / 10
    return weights
