"""Pipeline stages: each learner's model split over the consecutive ranks of the `stage` scope.

Rank i of a stage scope holds stage i of every learner's model (a `PipelineStage`), so the learners, their flat
buffers, the algorithm and checkpoints all work on that stage's shard and reduce over the `data` scope (the
ranks that hold the same stage). The `PipelineEngine` cuts each learner's batch into micro-batches and runs them
through the stages by a schedule (`gpipe` or `1f1b`); activations and their gradients travel between neighbouring
stages by a `StageLink`: MPI point-to-point messages, or NCCL send/recv between CUDA ranks (`NcclLink`). Each
schedule's communication steps are groups of paired sends and receives, as Megatron's send_forward_recv_backward,
so that it progresses even where a send completes only when its receive is posted (NCCL). The last stage owns the
loss.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from crossbow_mpi.comm import Communicator, MpiCommunicator, device_kinds, start_nccl
from crossbow_mpi.comm.base import POLL_MAX_S, POLL_MIN_S, wait_sleeping
from crossbow_mpi.comm.nccl import NcclCommunicator
from crossbow_mpi.config import ConfigError
from crossbow_mpi.parallel.partition import param_cut, split_model
from crossbow_mpi.replicas.engines import LossFn, SequentialEngine
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.learners import Learners
from crossbow_mpi.tensor_bytes import dtype_name, from_bytes, named_dtype, to_bytes

ACTIVATION, GRADIENT = 1, 2
"""Message tags: activations flow to the next stage, their gradients to the previous one."""


class StageError(RuntimeError):
    """Another stage of the pipeline failed on the same input; carries its message."""


class Transfer(NamedTuple):
    """One message of a communication step: this stage sends ("send") or receives ("recv") micro-batch `micro`'s
    activation (tag ACTIVATION: to the next stage, from the previous one) or its gradient (GRADIENT: to the
    previous stage, from the next one)."""

    op: str
    tag: int
    micro: int

    @property
    def direction(self) -> int:
        """The neighbour this transfer talks to: +1 the next stage, -1 the previous one."""
        return 1 if (self.tag == ACTIVATION) == (self.op == "send") else -1


class StageLink:
    """Point-to-point messages between the stages of one pipeline, over MPI on a private duplicate of the stage
    scope; subclasses move the training's tensors by another transport (`NcclLink`).

    A tensor travels as bytes (a JSON header with dtype and shape, then the raw data), so any dtype and device
    does; an exception travels as its message, so that every stage raises together instead of waiting. Sends
    are non-blocking and complete at `flush`; receives poll, sleeping, so that a waiting rank leaves its core
    to the ranks still computing. On GPUs tensors are staged through host memory."""

    def __init__(self, comm: MpiCommunicator):
        self.comm = comm
        self.index, self.stages = self.comm.rank, self.comm.size
        self.pending: list = []

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    def exchange(
        self,
        sends: dict[Transfer, torch.Tensor],
        receives: list[Transfer],
        keys: Sequence[Hashable],
        device: torch.device,
    ) -> dict[Transfer, torch.Tensor]:
        """Run one communication step as a group (with the neighbours' matching steps): send each tensor of
        `sends`, receive each of `receives`; return the received tensors. keys[i] is what sets micro-batch i's
        activations' shapes and dtypes (its input's shape), for a transport that moves only the data. Over MPI
        the sends are posted first and complete at `flush`."""
        for transfer, tensor in sends.items():
            self.send(tensor, self.index + transfer.direction, transfer.tag)
        return {transfer: self.recv(self.index + transfer.direction, transfer.tag, device) for transfer in receives}

    def send(self, value: torch.Tensor | Exception, dest: int, tag: int, data: bool = True) -> None:
        """Post the value (only its dtype and shape unless `data`) to `dest`; the send completes at `flush`."""
        buffer = torch.frombuffer(bytearray(_encode(value, data)), dtype=torch.uint8).numpy()
        self.pending.append((buffer, self.comm.mpi_comm.Isend(buffer, dest=dest, tag=tag)))

    def recv(self, source: int, tag: int, device: torch.device) -> torch.Tensor:
        """Return the next tensor from `source` (uninitialised when only its dtype and shape were sent); raise
        StageError when it sent an exception."""
        mpi = Communicator.mpi()
        status, poll = mpi.Status(), POLL_MIN_S
        while not self.comm.mpi_comm.Iprobe(source=source, tag=tag, status=status):
            time.sleep(poll)
            poll = min(2 * poll, POLL_MAX_S)
        buffer = bytearray(status.Get_count(mpi.BYTE))
        self.comm.mpi_comm.Recv([buffer, mpi.BYTE], source=source, tag=tag)
        return _decode(bytes(buffer), device)

    def share_from_last(self, value: torch.Tensor | Exception, device: torch.device) -> torch.Tensor:
        """Return the last stage's value on every stage (collective); raise StageError when it is an exception."""
        return _decode(self.comm.bcast_bytes(_encode(value) if self.last else None, root=self.stages - 1), device)

    def flush(self) -> None:
        """Complete the sends in flight."""
        wait_sleeping([request for _, request in self.pending])
        self.pending = []

    def close(self) -> None:
        """Release what the link holds beside MPI."""

    def run_through(self, body: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Run a forward pass of the whole pipeline without autograd bookkeeping (collective over the stages):
        stage 0 takes `inputs`, each stage passes its output on; return the last stage's output on every stage."""
        try:
            x = inputs if self.first else self.recv(self.index - 1, ACTIVATION, inputs.device)
            y = body(x)
        except (RuntimeError, ValueError, IndexError) as err:
            y = err
        if not self.last:
            self.send(y, self.index + 1, ACTIVATION)
        self.flush()
        return self.share_from_last(y, inputs.device)


class NcclLink(StageLink):
    """The training's activations and gradients by NCCL send/recv between CUDA ranks, by pointer on the current
    stream, each communication step one NCCL group; the rest (evaluation's forward pass, exceptions, the losses)
    over MPI as in `StageLink`.

    NCCL moves only the data. The first time a stage sends an activation for a key (the micro-batch's input
    shape), the activation's dtype and shape go ahead over MPI, and both sides keep them for the key's later
    micro-batches; a gradient has the dtype and shape of the activation it is the gradient of."""

    def __init__(self, comm: MpiCommunicator, nccl: NcclCommunicator):
        super().__init__(comm)
        self.nccl = nccl
        self.outputs: dict[Hashable, torch.Tensor] = {}
        """Key → a meta tensor of the dtype and shape of the activations this stage sends."""
        self.inputs: dict[Hashable, torch.Tensor] = {}
        """Key → a meta tensor of the dtype and shape of the activations this stage receives."""

    def close(self) -> None:
        self.nccl.close()

    def exchange(
        self,
        sends: dict[Transfer, torch.Tensor],
        receives: list[Transfer],
        keys: Sequence[Hashable],
        device: torch.device,
    ) -> dict[Transfer, torch.Tensor]:
        for transfer, tensor in sends.items():
            if transfer.tag == ACTIVATION:
                self._announce(tensor, keys[transfer.micro])
        received = {}
        for transfer in receives:
            key = keys[transfer.micro]
            if transfer.tag == ACTIVATION and key not in self.inputs:
                self.inputs[key] = self.recv(self.index + transfer.direction, ACTIVATION, torch.device("meta"))
            kind = self.inputs[key] if transfer.tag == ACTIVATION else self.outputs[key]
            received[transfer] = torch.empty_like(kind, device=device)
        self.nccl.send_recv(
            [(tensor.contiguous(), self.index + t.direction) for t, tensor in sends.items()],
            [(tensor, self.index + t.direction) for t, tensor in received.items()],
        )
        return received

    def _announce(self, activation: torch.Tensor, key: Hashable) -> None:
        """Send the activation's dtype and shape to the next stage the first time for `key`; ValueError when they
        differ from that time's."""
        if key not in self.outputs:
            self.outputs[key] = activation.to("meta")
            self.send(activation, self.index + 1, ACTIVATION, data=False)
        kind = self.outputs[key]
        if (kind.shape, kind.dtype) != (activation.shape, activation.dtype):
            raise ValueError(
                f"stage {self.index} sends a {activation.dtype} {list(activation.shape)} activation where it sent a "
                f"{kind.dtype} {list(kind.shape)} one for the same input shape: NCCL needs a stage's output to "
                "follow from its input's shape (use --comm mpi)"
            )


class PipelineStage(nn.Module):
    """This rank's stage of a model: in training mode its own modules; in evaluation mode the whole pipeline's
    forward pass (collective over the stage scope), returning the model's output on every stage, so that
    evaluation and the dataset checks run unchanged."""

    def __init__(self, modules: list[nn.Module], link: StageLink | None):
        super().__init__()
        self.body = nn.Sequential(*modules)
        self.link = link

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.body(x)
        assert self.link is not None, "a stage evaluates through its pipeline's link"
        return self.link.run_through(self.body, x)


def schedule_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Return stage's order of forward ("F", i) and backward ("B", i) passes over the micro-batches: `gpipe`
    runs every forward pass, then every backward pass; `1f1b` runs stages - stage - 1 forward passes, then
    alternates one forward and one backward pass, so that a stage holds at most stages - stage activations."""
    n = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]
    assert schedule == "1f1b", schedule
    warmup = min(stages - stage - 1, n)
    ops = [("F", i) for i in range(warmup)]
    for i in range(n - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(n - warmup, n)]


def schedule_steps(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple]:
    """Return stage's steps: its passes ("F", i) and ("B", i) in `schedule_ops`'s order, and between them its
    communication steps, each a tuple of Transfers that run as one group. A pass receives its input (an activation,
    or its output's gradient) just before it and sends its output just after; a send and the next receive form one
    group when they talk to the same neighbour (as Megatron's send_forward_recv_backward and
    send_backward_recv_forward), else the send goes first. So the stages progress even where every send completes
    only when its receive is posted (NCCL)."""
    first, last = stage == 0, stage == stages - 1
    steps: list[tuple] = []
    send: Transfer | None = None
    for op, i in schedule_ops(schedule, stage, stages, micro_batches):
        tag = ACTIVATION if op == "F" else GRADIENT
        receive = None if (first if op == "F" else last) else Transfer("recv", tag, i)
        if send and receive and send.direction == receive.direction:
            steps.append((send, receive))
        else:
            steps += [(transfer,) for transfer in (send, receive) if transfer]
        steps.append((op, i))
        send = None if (last if op == "F" else first) else Transfer("send", tag, i)
    return steps + ([(send,)] if send else [])


class PipelineEngine(SequentialEngine):
    """Run each learner's pipeline in turn: its batch in micro-batches through the stages by the schedule.

    Each micro-batch's loss is scaled by its share of the batch, so that the gradients summed over the
    micro-batches are those of the whole batch's mean loss. The losses are the last stage's, given to every stage.
    """

    name = "pipeline"

    def __init__(
        self,
        loss_fn: LossFn,
        threads: int,
        link: StageLink,
        cut: list[int],
        micro_batches: int,
        schedule: str,
        precision,
    ):
        super().__init__(loss_fn, threads, precision)
        self.link = link
        self.cut = cut
        """Where the model was cut into the stages (see `stages`); checkpoints keep it for resume and export."""
        self.micro_batches = micro_batches
        self.steps = schedule_steps(schedule, link.index, link.stages, micro_batches)

    def close(self) -> None:
        super().close()
        self.link.close()

    def compute_gradients(self, learners: Learners, batches) -> torch.Tensor:
        losses = super().compute_gradients(learners, batches)
        return self.link.share_from_last(losses, losses.device)

    def forward_backward(self, module: PipelineStage, batch) -> torch.Tensor:  # type: ignore[override]  # stages only
        inputs, targets = batch
        micro = list(
            zip(
                torch.tensor_split(inputs, self.micro_batches),
                torch.tensor_split(targets, self.micro_batches),
                strict=True,
            )
        )
        keys = [tuple(x.shape) for x, _ in micro]
        held: dict[int, tuple] = {}
        mail: dict[Transfer, torch.Tensor] = {}
        losses = []
        for step in self.steps:
            if isinstance(step[0], Transfer):
                sends = {transfer: mail.pop(transfer) for transfer in step if transfer.op == "send"}
                receives = [transfer for transfer in step if transfer.op == "recv"]
                mail.update(self.link.exchange(sends, receives, keys, inputs.device))
                continue
            op, i = step
            if op == "F":
                x, y = micro[i]
                held[i] = self._forward(module.body, mail, i, x, y, share=len(y) / len(targets))
                losses.append(held[i][1].detach())
            else:
                self._backward(mail, i, *held.pop(i))
        self.link.flush()
        return torch.stack(losses).sum() if self.link.last else torch.zeros((), device=inputs.device)

    def _forward(self, body: nn.Module, mail: dict, i: int, inputs: torch.Tensor, targets: torch.Tensor, share: float):
        link = self.link
        x = inputs if link.first else mail.pop(Transfer("recv", ACTIVATION, i)).requires_grad_()
        with self.autocast(inputs.device.type):
            y = body(x)
            if link.last:
                return x, self.loss_fn(y, targets) * share
        mail[Transfer("send", ACTIVATION, i)] = y.detach()
        return x, y

    def _backward(self, mail: dict, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        link = self.link
        y.backward(None if link.last else mail.pop(Transfer("recv", GRADIENT, i)))
        if not link.first:
            mail[Transfer("send", GRADIENT, i)] = x.grad

    def after_sync(self, compute: Callable[[], torch.Tensor]) -> Callable[[], float]:
        """Sum the value over the stages, so that a non-finite value on any stage is seen by every stage."""
        value = self.link.comm.allreduce_sum_numbers([float(compute())])[0]
        return lambda: value


def build_pipeline(
    model_fn: Callable[[], object],
    stage: Communicator,
    config,
    loss_fn: LossFn,
    threads: int,
    device: torch.device,
    cut: list[int] | None = None,
) -> tuple[Callable[[], PipelineStage], PipelineEngine]:
    """Return this rank's stage builder and the pipeline engine (collective over the stage scope), the model cut
    at `cut` (default: balanced by parameter count); ValueError when the model cannot be split so."""
    if config.engine not in ("auto", "sequential"):
        raise ConfigError("--pipeline-stages runs the learners' pipelines one after another: use --engine auto")
    link, model = build_link(stage, config.comm, device), model_fn()
    cut = param_cut(model, link.stages) if cut is None else cut
    split_model(model, link.stages, cut)

    def stage_fn() -> PipelineStage:
        return PipelineStage(split_model(model_fn(), link.stages, cut)[link.index], link)

    engine = PipelineEngine(loss_fn, threads, link, cut, config.micro_batches, config.schedule, config.precision)
    return stage_fn, engine


def build_link(stage: Communicator, kind: str, device: torch.device) -> StageLink:
    """Return the link between the stages of this rank's pipeline (collective over the stage scope): NCCL on
    CUDA ranks where `--comm` (`kind`) picks it, as for the data scope, else MPI."""
    comm = MpiCommunicator(stage.mpi_comm.Dup())
    nccl = start_nccl(comm.mpi_comm, kind, device, comm, "the stages' activations", device_kinds(comm, device))
    return StageLink(comm) if nccl is None else NcclLink(comm, nccl)


def stage_modules(model: nn.Module, stages: int, cut: list[int] | None = None) -> list[nn.Module]:
    """Return the model's stages as a pipeline's ranks hold them (cut at `cut`, default by parameter count),
    sharing the model's modules ([model] for one stage), so that loading a stage's state loads that part of the
    model."""
    if stages == 1:
        return [model]
    return [PipelineStage(modules, link=None) for modules in split_model(model, stages, cut)]


def load_stages(model: nn.Module, shards: list[tuple[torch.Tensor, bytes]], cut: list[int] | None = None) -> nn.Module:
    """Load each stage's state vector and extra state into the model cut at `cut`; return the model."""
    for stage, (z, extra) in zip(stage_modules(model, len(shards), cut), shards, strict=True):
        FlatLayout(stage).load(stage, z, extra)
    return model


def _encode(value: torch.Tensor | Exception, data: bool = True) -> bytes:
    header: dict[str, object]
    if isinstance(value, Exception):
        header, raw = {"error": str(value).strip() or type(value).__name__}, b""
    else:
        header = {"dtype": dtype_name(value.dtype), "shape": list(value.shape)}
        raw = to_bytes(value) if data else b""
    text = json.dumps(header).encode()
    return len(text).to_bytes(4, "little") + text + raw


def _decode(data: bytes, device: torch.device) -> torch.Tensor:
    size = int.from_bytes(data[:4], "little")
    header = json.loads(data[4 : 4 + size])
    if "error" in header:
        raise StageError(header["error"])
    dtype, raw = named_dtype(header["dtype"]), data[4 + size :]
    if not raw:  # only its dtype and shape were sent
        return torch.empty(header["shape"], dtype=dtype, device=device)
    return from_bytes(raw, dtype, header["shape"]).to(device)
