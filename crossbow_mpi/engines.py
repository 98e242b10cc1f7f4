"""Learner engines: how the k learners of a rank compute their gradients.

An engine fills `learners.grads[j]` with the gradient of learner j's loss on its own batch and returns the
losses. Algorithms only see the filled matrices, so engines (sequential, threads, CUDA streams) can be
swapped without touching them.

On a CPU every engine gives each learner the same number of intra-op threads, the rank's threads divided
by k, so that results (which depend on how kernels split their reductions) do not depend on the engine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from crossbow_mpi.config import ConfigError
from crossbow_mpi.learners import Learners

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LearnerEngine:
    """Compute every learner's gradient on its batch; subclasses choose how the learners share the device."""

    name = "base"

    def __init__(self, loss_fn: LossFn, threads: int, precision: str = "fp32"):
        self.loss_fn = loss_fn
        self.threads = threads
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None

    def learner_threads(self, k: int) -> int:
        return max(1, self.threads // k)

    def compute_gradients(self, learners: Learners, batches: list[Batch]) -> torch.Tensor:
        """Fill learners.grads and return the k losses."""
        assert len(batches) == learners.k
        try:
            return torch.stack(self.run_learners(learners, batches))
        finally:
            torch.set_num_threads(self.threads)

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        raise NotImplementedError

    def learner_step(self, learners: Learners, j: int, batch: Batch) -> torch.Tensor:
        """Run learner j's forward and backward pass on its batch; return its loss."""
        torch.set_num_threads(self.learner_threads(learners.k))
        module = learners.modules[j]
        module.train()
        learners.grads[j].zero_()
        inputs, targets = batch
        with torch.autocast(inputs.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            loss = self.loss_fn(module(inputs), targets)
        loss.backward()
        if j not in learners.checked:
            assert learners.layout.grads_are_bound(module, learners.grads[j]), "autograd replaced a flat gradient view"
            learners.checked.add(j)
        return loss.detach()

    def close(self) -> None:
        """Release worker resources."""


class SequentialEngine(LearnerEngine):
    """Run the learners one after another."""

    name = "sequential"

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        return [self.learner_step(learners, j, batch) for j, batch in enumerate(batches)]


class ThreadEngine(LearnerEngine):
    """Run the k learners at the same time, one thread each (torch releases the GIL inside its kernels)."""

    name = "threads"

    def __init__(self, loss_fn: LossFn, threads: int, precision: str = "fp32"):
        super().__init__(loss_fn, threads, precision)
        self.pool: ThreadPoolExecutor | None = None
        self.workers = 0

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        if self.workers < learners.k:
            self.close()
            self.pool = ThreadPoolExecutor(max_workers=learners.k, thread_name_prefix="learner")
            self.workers = learners.k
        futures = [self.pool.submit(self.learner_step, learners, j, batch) for j, batch in enumerate(batches)]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool, self.workers = None, 0


class StreamEngine(LearnerEngine):
    """Run each learner on its own CUDA stream, so that the learners' kernels overlap on the GPU.

    Each stream first waits for the work already queued on the current stream (the last sync, the batch
    copies); the current stream then waits for every learner before the algorithm's update.
    """

    name = "streams"

    def __init__(self, loss_fn: LossFn, threads: int, precision: str = "fp32"):
        super().__init__(loss_fn, threads, precision)
        self.streams: list[torch.cuda.Stream] = []

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        current = torch.cuda.current_stream()
        while len(self.streams) < learners.k:
            self.streams.append(torch.cuda.Stream())
        losses = []
        for j, (stream, batch) in enumerate(zip(self.streams, batches)):
            stream.wait_stream(current)
            for tensor in batch:
                tensor.record_stream(stream)
            with torch.cuda.stream(stream):
                losses.append(self.learner_step(learners, j, batch))
        for stream in self.streams[:learners.k]:
            current.wait_stream(stream)
        return losses


ENGINES = {engine.name: engine for engine in (SequentialEngine, ThreadEngine, StreamEngine)}


def check_engine(name: str, device: torch.device) -> None:
    """Refuse an engine that cannot run on the device."""
    if name == "streams" and device.type != "cuda":
        raise ConfigError("--engine streams needs CUDA devices (--device cuda)")


def build_engine(name: str, loss_fn: LossFn, threads: int, device: torch.device,
                 precision: str = "fp32") -> LearnerEngine:
    """Return the named engine; `auto`: CUDA streams on a GPU, threads on a CPU rank with several threads."""
    if name == "auto":
        name = "streams" if device.type == "cuda" else "threads" if threads > 1 else "sequential"
    return ENGINES[name](loss_fn, threads, precision)
