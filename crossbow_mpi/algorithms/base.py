"""What every algorithm shares: the central model, the learners, the transport and one sync message."""

from __future__ import annotations

from collections.abc import Callable

import torch

from crossbow_mpi.comm import Communicator
from crossbow_mpi.comm.int8 import Feedback, wire_bytes
from crossbow_mpi.config import ConfigError
from crossbow_mpi.replicas.flat import sum_rows
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.state import HyperParams

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""`--sync-dtype`s that cast the sync message for the wire (`fp32`: the message's own type)."""


class Algorithm:
    """Update learners and the central model once every learner's gradient is in `learners.grads`.

    A step has two parts. `local_step(rows, lr)` is each learner's own: it updates what the equations let a
    learner update alone and stages the learner's part of the sync message in its row of `staged`.
    `sync(lr)` sums the staged rows into one message, reduces it over the transport and updates the central
    model. An engine runs `local_step` once per step and `sync` when a sync round is due (every step for the
    synchronous algorithms); the stream engine runs `local_step` per learner on the learner's CUDA stream and
    `sync` on a sync stream. Hyper-parameters are read from `hp` at every step, so a controller may change
    them during a run.
    """

    name = "base"
    transport_kind = "allreduce"
    """The transport the algorithm reduces over: `allreduce` (the data scope's) or `partial` (eager-SGD's)."""
    weighs_by_samples = False
    """Whether each learner's part of the sync message is weighted by its batch size, so that the sync averages
    over samples (S-SGD, eager-SGD), rather than counted once, so that it averages over learners."""
    rounds = False
    """Whether the ranks step at their own pace within rounds of samples that the transport hands out
    (`begin_round`, `next_position`, `end_round`), rather than in lockstep (asynchronous algorithms)."""
    learners_share_z = False
    """Whether every learner equals z after every sync, so that the learners' parameters can be z's own
    (`Learners.share_z`) instead of copies written at every sync."""
    stages_in_gradients = False
    """Whether the staged rows are the learners' `staging`, so that the message has no rows of its own: a learner's
    part is written over its gradient (its gradient itself, times its weight, where staging copies nothing: S-SGD,
    Omnivore; or a part computed once the learner's step has read its gradient: SMA). An engine that overlaps the
    sync with the learners' next passes then writes a learner's next gradient into its row after the sync."""
    overlaps_sync = False
    """Whether a learner's next forward pass may run during the sync: true when the sync writes nothing a
    learner reads before its own `local_step`."""
    fused_update: Callable[..., None] | None = None
    """The fused learner step of `--fused-step` (SMA's) or central step (S-SGD's), or None for the in-place
    sequence."""

    def __init__(self, hp: HyperParams, transport: Communicator, central: CentralModel, learners: Learners):
        self.hp = hp
        self.transport = transport
        self.central = central
        self.learners = learners
        learners.share_z(self.learners_share_z)
        self.staged = torch.empty(0)
        """Row j: learner j's part of the sync message, times its weight [its part | its float buffers | its weight]."""
        self.message = torch.empty(0)
        """The sync message: the sum of the staged rows, summed into the first (no buffer of its own: every staged
        row is written afresh before the next sync reads it); its last element sums the weights of the learners it
        carries."""
        self.weights: tuple[float, ...] = (1.0,) * transport.size
        """Each rank's learner weight in the sync message: 1, or b_r / max_q b_q when weighing by samples."""
        self.weight = 1.0
        """This rank's learner weight."""
        self.comm_bytes = 0
        """Bytes this rank sent in sync messages, by the ring allreduce's model: 2 (P − 1) / P of the payload."""
        self.feedback = Feedback()
        """This rank's residuals of its int8 casts (`--sync-dtype int8`)."""
        self.wire_checked = False
        """Whether this process's first float16 sync message was checked against float16's range (a resume checks
        its own first)."""

    def step(self, lr: float) -> None:
        """Apply one iteration's local update and synchronisation."""
        self.allocate_message()
        self.local_step(slice(None), lr)
        self.sync(lr)

    def weigh(self, batch_sizes: tuple[int, ...], rank: int) -> None:
        """Set the learners' weights for a step with these batch sizes per rank (before `local_step`)."""
        if self.weighs_by_samples:
            largest = max(batch_sizes)
            self.weights = tuple(b / largest for b in batch_sizes)
            self.weight = self.weights[rank]

    def allocate_message(self) -> None:
        """(Re)allocate the staged rows and the message for the current number of learners, before `local_step`
        (on a GPU: on the stream that every learner's and the sync stream wait for)."""
        learners = self.learners
        staged = learners.staging if self.stages_in_gradients else self.staged
        if staged.shape != learners.staging.shape:
            staged = learners.staging.new_ones(learners.staging.shape)
        if staged is not self.staged:
            self.staged = staged
            self.message = staged[0]

    @property
    def steps_rows_apart(self) -> bool:
        """Whether `local_step` may run for disjoint rows on several threads at once: not with per-learner optimizers
        (a row's first step allocates state matrices the rows share) nor with a fused step (compiled at its first
        call)."""
        return self.learners.optimizers is None and self.fused_update is None

    def local_step(self, rows: slice, lr: float) -> None:
        """Run the learners' own part of the step for the learners in `rows`, staging their sync message rows."""
        raise NotImplementedError

    def sync(self, lr: float) -> None:
        """Reduce the staged rows over the learners and ranks and update the central model (and learners)."""
        raise NotImplementedError

    def on_lr_drop(self) -> None:
        """React to a learning-rate drop."""

    def meet(self) -> None:
        """Bring every rank to the same central model where the whole world meets: evaluations, checkpoints and
        the end (collective). Only algorithms whose ranks may hold different models between meetings act."""

    def drain(self) -> None:
        """Finish outstanding communication, so that every rank holds the same, complete state."""

    def statistics(self) -> dict:
        """Return fields for the next evaluation record, the same on every rank."""
        return {}

    def state_dict(self) -> dict:
        """Return the algorithm's own state beyond z and the learners (JSON-serialisable; `drain` first)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""

    def staged_rows(self, rows: slice) -> torch.Tensor:
        """Return the staged rows' first part (one column per parameter), staging the learners' weighted buffers and
        weight beside it; the caller stages its part times `weight` (with `stages_in_gradients` the part holds the
        learners' gradients until the caller writes it)."""
        learners = self.learners
        assert self.staged.shape[0] == learners.k, "allocate_message() before local_step()"
        num_params = learners.layout.num_params
        if learners.layout.buffer_slots:
            torch.mul(learners.buffers[rows], self.weight, out=self.staged[rows, num_params:-1])
        self.staged[rows, -1] = self.weight
        return self.staged[rows, :num_params]

    def sum_staged(self) -> torch.Tensor:
        """Sum the staged rows into the message, the first, and return it."""
        if self.staged.shape[0] > 1:
            sum_rows(self.staged, out=self.message)
        return self.message

    def refuse_overflow(self, message: torch.Tensor, scope: Communicator, when: str) -> None:
        """Raise WireOverflow on every rank when a rank's `message` holds a value beyond float16's range, naming the
        first tensor and `when` (collective)."""
        beyond = (message[:-1].abs() > torch.finfo(torch.float16).max).nonzero()
        first = [int(beyond[0]) if len(beyond) else -1]
        found = [i for [i] in scope.allgather_json(first) if i >= 0]
        if found:
            layout = self.learners.layout
            slots = (*layout.param_slots, *layout.buffer_slots)
            slot = max((s for s in slots if s.offset <= min(found)), key=lambda s: s.offset)
            raise WireOverflow(
                f"--sync-dtype fp16: {slot.module}.{slot.name} holds values beyond float16's range (65504) {when}; "
                "use --sync-dtype bf16"
            )

    def dry_message(self) -> torch.Tensor:
        """Return what a sync message would carry now that is known before the first step: no parameter part (the
        learners equal z), this rank's learners' float buffers summed and weighted, and the weight."""
        learners = self.learners
        buffers = learners.buffers.sum(0) * self.weight
        return torch.cat([buffers.new_zeros(learners.layout.num_params), buffers, buffers.new_ones(1)])

    def staged_message(self, scope: Communicator, columns: slice | None = None) -> tuple[torch.Tensor, int]:
        """Return the sync message (the staged rows' sum; with `columns`, only those columns of its first part) and
        the length of its first part; a float16 wire refuses a first message beyond float16's range."""
        num_params, message = self.learners.layout.num_params, self.sum_staged()
        if self.hp.sync_dtype == "fp16" and scope.size > 1 and not self.wire_checked:
            self.refuse_overflow(message, scope, "at the first sync")
            self.wire_checked = True
        if columns is not None:
            message, num_params = torch.cat([message[columns], message[num_params:]]), columns.stop - columns.start
        return message, num_params

    def allreduce_staged(
        self, scope: Communicator | None = None, columns: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce [sum of the staged rows' first parts | weighted sum of the learners' buffers | sum of their weights]
        as one message; return the first part and the summed weight of the learners the reduction carried (a
        one-element tensor: the number of learners, when every weight is 1); over `scope`, default the transport;
        with `columns`, only those columns of the first part travel (a fragment).

        BatchNorm running statistics follow one rule for every algorithm: z's buffers become the weighted mean of
        the buffers of every learner the reduction carried (every learner of every rank, for a full allreduce).
        """
        scope = scope or self.transport
        message, num_params = self.staged_message(scope, columns)
        if self.hp.sync_dtype == "int8":  # the parameters' part; the buffers and the weights travel in float32
            scope.allreduce_int8_(message[:num_params], self.feedback)
            scope.allreduce_sum_(message[num_params:])
            tail = (message.numel() - num_params) * message.element_size()
            self.comm_bytes += ring_bytes(scope.size, wire_bytes(num_params)) + ring_bytes(scope.size, tail)
            return message[:num_params], self.take_buffers(message, num_params)
        wire = WIRE_DTYPES.get(self.hp.sync_dtype, message.dtype)
        scope.allreduce_cast_(message, wire)
        self.comm_bytes += ring_bytes(scope.size, message.numel() * wire.itemsize)
        return message[:num_params], self.take_buffers(message, num_params)

    def take_buffers(self, message: torch.Tensor, num_params: int) -> torch.Tensor:
        """Set z's buffers to the weighted mean a reduced message carries; return its summed weight (one element)."""
        carried = message[-1:]
        torch.div(message[num_params:-1], carried, out=self.central.buffers)
        return carried


class WireOverflow(ConfigError):
    """`--sync-dtype fp16` with a sync message beyond float16's range."""


def ring_bytes(ranks: int, payload: int) -> int:
    """Bytes each rank sends in a ring allreduce of `payload` bytes over `ranks` ranks: 2 (P − 1) / P of it."""
    return 2 * (ranks - 1) * payload // ranks
