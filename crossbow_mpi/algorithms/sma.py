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

With `--sync-every H` the ranks sync every H-th step only. `central` keeps the equations above but applies the
correction (α) at the sync steps only, as EASGD's communication period τ (Zhang, Choromanska and LeCun,
arXiv 1412.6651, Algorithm 1); between syncs every learner takes plain momentum-SGD steps (α = 0). With
`--outer-optimizer nesterov|sgd`, the sync reduces the learners' mean m instead, z takes one outer step on
Δ = z − m (crossbow_mpi.algorithms.outer) and every learner restarts from z, keeping its momentum; with
`--fragments F` one run of whole tensors at a time, every H/F steps, round-robin (Streaming DiLoCo).
BatchNorm statistics are averaged at every sync either way. With `--sync-every-node Hn` (`--hierarchy node`)
the learners of each node also average their parameters every Hn-th step between the syncs, over the node's fast
links; the syncs across nodes stay every H steps.

A learner reads z only in its own `local_step`, so its next forward pass may overlap the sync. With
`--fused-step` the learners' update, correction and staging run as one fused kernel, and the central update as
another, with the same bits (crossbow_mpi.replicas.kernels).

With sgd a learner stages c_j (and the outer sync z − w_j) over its gradient, which its step has read by then, so
SMA holds no staging row per learner (`stages_in_gradients`). The sync reads those rows and reduces in learner
0's, and no learner writes its row before the sync is done: the threads and sequential engines run the sync
between the steps, and the stream engine's learner stream, which runs the next forward and backward pass during
the sync, waits for the sync before it takes its gradient into its row (autograd writes fresh tensors until
then). Another optimizer's step needs g after c_j is taken from w_j, so with one each learner stages c_j in a
row of its own.
"""

from __future__ import annotations

import torch

from crossbow_mpi.algorithms.base import Algorithm, ring_bytes
from crossbow_mpi.algorithms.outer import fragment_columns, outer_step
from crossbow_mpi.comm import Communicator
from crossbow_mpi.config import ConfigError
from crossbow_mpi.replicas.kernels import SmaCentralUpdate, SmaUpdate
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.optimizers import clip_rows
from crossbow_mpi.replicas.state import HyperParams


class SynchronousModelAveraging(Algorithm):
    name = "sma"
    fused_update: SmaUpdate | None = None
    """The fused learner step (`--fused-step`), or None for the in-place sequence (the same bits)."""
    fused_central: SmaCentralUpdate | None = None
    """The fused central step (`--fused-step`), or None for the in-place sequence (the same bits)."""

    def __init__(self, hp: HyperParams, transport: Communicator, central: CentralModel, learners: Learners):
        super().__init__(hp, transport, central, learners)
        if hp.sync_every_node and not hasattr(transport, "node"):
            raise ConfigError("--sync-every-node needs the ranks grouped by node: pass --hierarchy node")
        slots = learners.layout.param_slots
        if hp.fragments > len(slots):
            raise ConfigError(f"--fragments {hp.fragments} exceeds the model's {len(slots)} parameter tensors")
        self.fragments = fragment_columns(slots, hp.fragments) if hp.fragments > 1 else [None]
        """The parameter columns each sync carries in turn (None: all)."""
        self.fragment = 0
        """The fragment the next sync carries."""
        flat_mpi = hasattr(transport, "iallreduce_sum_") and transport.hierarchy == "flat"
        if hp.sync_delay and not flat_mpi:
            raise ConfigError("--sync-delay needs a flat MPI transport (--comm mpi --hierarchy flat)")
        if hp.sync_dtype == "int8" and not flat_mpi:
            raise ConfigError("--sync-dtype int8 needs a flat MPI transport (--comm mpi --hierarchy flat)")
        self.since_sync = 0
        """Local steps taken since the last sync."""
        self.in_flight: tuple | None = None
        """A delayed sync: (message on the host, length of its first part, its columns, its pending sum)."""
        self.delay_left = 0
        """Steps until the delayed sync applies."""

    @property
    def stages_in_gradients(self) -> bool:  # type: ignore[override]
        return self.learners.optimizers is None

    @property
    def overlaps_sync(self) -> bool:  # type: ignore[override]
        return self.hp.outer_optimizer == "central" and not self.hp.sync_every_node

    @property
    def syncs_now(self) -> bool:
        """Whether the current step ends with a sync (every H-th step; every H/F-th with F fragments)."""
        return self.since_sync + 1 >= self.hp.sync_every // self.hp.fragments

    @property
    def alpha(self) -> float:
        """α at this step: SMA's at the sync steps of `central`, else 0 (no pull towards z between syncs)."""
        return self.hp.alpha if self.syncs_now and self.hp.outer_optimizer == "central" else 0.0

    def local_step(self, rows: slice, lr: float) -> None:
        hp, learners, z = self.hp, self.learners, self.central.params
        w, v, g = learners.params[rows], learners.momentum[rows], learners.grads[rows]
        corrections = self.staged_rows(rows)  # g's memory with sgd (`stages_in_gradients`)
        if hp.clip_grad_norm:
            clip_rows(g, hp.clip_grad_norm)
        if self.fused_update is not None:  # sgd only: it writes the corrections over g
            self.fused_update(w, v, g, z, lr, hp.weight_decay, hp.momentum, self.alpha)
            return
        if learners.optimizers is not None:
            torch.sub(w, z, out=corrections).mul_(self.alpha)
            learners.optimizers.step(rows, g, lr)
            w.sub_(corrections)
            return
        g.add_(w, alpha=hp.weight_decay)
        v.mul_(hp.momentum).sub_(g, alpha=lr)
        torch.sub(w, z, out=corrections).mul_(self.alpha)
        w.add_(v).sub_(corrections)

    def sync(self, lr: float) -> None:
        central, hp = self.central, self.hp
        self.delay_left -= 1
        if self.delay_left == 0:
            self.drain()
        if not self.syncs_now:
            self.since_sync += 1
            if hp.sync_every_node and self.since_sync % hp.sync_every_node == 0:
                self.node_sync()
            return
        self.since_sync = 0
        if hp.outer_optimizer != "central":
            columns = self.fragments[self.fragment]
            self.fragment = (self.fragment + 1) % len(self.fragments)
            (self.start_sync if hp.sync_delay else self.outer_sync)(columns)
            return
        dz, _ = self.allreduce_staged()
        central_momentum = hp.central_momentum if hp.momentum > 0 or hp.central_momentum_always else 0.0
        if self.fused_central is not None:
            self.fused_central(dz, central.params, central.u, central_momentum)
            return
        dz.add_(central.u, alpha=central_momentum)
        central.u.copy_(dz)
        central.params.add_(dz)

    def outer_sync(self, columns: slice | None) -> None:
        """Reduce the pseudo-gradient z − mean(w) (as differences, which a low-precision wire carries better than
        weights), step z on it, restart every learner from z; with `columns` (a fragment) for those columns only,
        and the buffers."""
        self.stage_pseudo_gradients()
        total, carried = self.allreduce_staged(columns=columns)
        self.outer_apply(total.div_(carried), columns)

    def start_sync(self, columns: slice | None) -> None:
        """Start `outer_sync`'s reduction without waiting (`--sync-delay τ`): it completes and applies τ steps later,
        or at `drain`, and the learners' progress on its columns in between is replaced by z's, as Streaming
        DiLoCo's merge with mixing factor 0."""
        self.stage_pseudo_gradients()
        message, num_params = self.staged_message(self.transport, columns)
        host = message.to("cpu", copy=True)
        pending = self.transport.iallreduce_sum_(host)  # type: ignore[attr-defined]
        self.comm_bytes += ring_bytes(self.transport.size, host.numel() * host.element_size())
        self.in_flight, self.delay_left = (host, num_params, columns, pending), self.hp.sync_delay

    def drain(self) -> None:
        """Complete and apply a delayed sync."""
        if self.in_flight is None:
            return
        host, num_params, columns, pending = self.in_flight
        self.in_flight = None
        pending.wait()
        message = host.to(self.central.z.device)
        carried = self.take_buffers(message, num_params)
        self.outer_apply(message[:num_params].div_(carried), columns)

    def stage_pseudo_gradients(self) -> None:
        """Stage each learner's z − w_j as its row of the sync message."""
        learners = self.learners
        torch.sub(self.central.params, learners.params, out=self.staged[:, : learners.layout.num_params])

    def outer_apply(self, delta: torch.Tensor, columns: slice | None) -> None:
        """Step z on the pseudo-gradient `delta` (of `columns`: all when None) and restart the learners from z there."""
        hp, central, learners = self.hp, self.central, self.learners
        part = columns or slice(None)
        outer_step(hp.outer_optimizer, delta, central.params[part], central.u[part], hp.outer_lr, hp.outer_momentum)
        if columns is None:
            learners.reset_to(central.z)
            return
        learners.params[:, columns] = central.params[columns]
        learners.buffers[:] = central.buffers

    def node_sync(self) -> None:
        """Average the learners' parameters within this rank's node (`--sync-every-node`): every learner becomes the
        node's mean; z, the buffers and the momenta stay."""
        learners, node = self.learners, self.transport.node  # type: ignore[attr-defined]
        message = torch.cat([learners.params.sum(0), learners.params.new_tensor([learners.k])])
        node.allreduce_sum_(message)
        self.comm_bytes += ring_bytes(node.size, message.numel() * message.element_size())
        learners.params.copy_((message[:-1] / message[-1]).expand_as(learners.params))

    def on_lr_drop(self) -> None:
        self.learners.reset_to(self.central.z)

    def statistics(self) -> dict:
        return {"comm_bytes": self.comm_bytes}

    def state_dict(self) -> dict:
        return {"since_sync": self.since_sync, "fragment": self.fragment, "comm_bytes": self.comm_bytes}

    def load_state_dict(self, state: dict) -> None:
        self.since_sync, self.comm_bytes = state.get("since_sync", 0), state.get("comm_bytes", 0)
        self.fragment = state.get("fragment", 0) % len(self.fragments)
