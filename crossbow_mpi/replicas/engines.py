"""Learner engines: how the k learners of a rank compute their gradients and apply the algorithm's step.

An engine fills `learners.grads[j]` with the gradient of learner j's loss on its own batch and returns the
losses, then `local_step` applies the learners' own update and `sync` the algorithm's sync round. Algorithms
only see the filled matrices, so engines (sequential, threads, CUDA streams) can be swapped without touching them.

On a CPU every engine gives each learner the same number of intra-op threads, the rank's threads divided
by k, so that results (which depend on how kernels split their reductions) do not depend on the engine.

With `compile`, every learner runs one torch.compile'd forward pass and loss (its backward pass compiled with it);
the first step compiles, on the calling thread, and `warmup_s` keeps its seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import pairwise
from typing import Protocol

import torch

from crossbow_mpi.config import ConfigError
from crossbow_mpi.data.checks import batch_loss
from crossbow_mpi.data.prefetch import Batch
from crossbow_mpi.replicas.footprint import ActivationMeter
from crossbow_mpi.replicas.kernels import require_compiler
from crossbow_mpi.replicas.learners import Learners

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class AlgorithmSteps(Protocol):
    """What an engine runs of an algorithm (crossbow_mpi.algorithms.Algorithm)."""

    learners: Learners
    overlaps_sync: bool

    @property
    def steps_rows_apart(self) -> bool: ...

    def allocate_message(self) -> None: ...

    def local_step(self, rows: slice, lr: float) -> None: ...

    def sync(self, lr: float) -> None: ...


def use_threads(count: int) -> None:
    """Give the calling thread's intra-op work `count` threads (a thread's own setting, so set only on a change)."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


class LearnerEngine:
    """Compute every learner's gradient on its batch; subclasses choose how the learners share the device."""

    name = "base"
    runs_learners_at_once = False
    """Whether the learners' passes run at the same time (their activations are alive together)."""
    cut: list[int] | None = None
    """Where the model was cut into pipeline stages (a pipeline engine's); None for a whole model."""

    def __init__(self, loss_fn: LossFn, threads: int, precision: str = "fp32", compile: bool = False):
        self.loss_fn = loss_fn
        self.threads = threads
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        self.compiled = compile
        self.model_loss = torch.compile(self._model_loss) if compile else self._model_loss
        self.warmup_s: float | None = None
        """With `compile`: seconds of the first step, which compiles the learners' passes."""
        self.activations = ActivationMeter()
        """The bytes learner 0's first forward pass saves for backward (not measured through compiled code)."""

    def learner_threads(self, k: int) -> int:
        return max(1, self.threads // k)

    def compute_gradients(self, learners: Learners, batches: list[Batch]) -> torch.Tensor:
        """Fill learners.grads and return the k losses."""
        assert len(batches) == learners.k
        started, threads = time.perf_counter(), torch.get_num_threads()
        try:
            losses = torch.stack(self.run_learners(learners, batches))
        finally:
            use_threads(threads)
        if self.warming_up:
            self.warmup_s = time.perf_counter() - started
        return losses

    @property
    def warming_up(self) -> bool:
        """Whether the next step compiles the learners' passes."""
        return self.compiled and self.warmup_s is None

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        raise NotImplementedError

    @contextmanager
    def stepping(self, k: int) -> Iterator[None]:
        """Hold the calling thread's settings for its part of a step of k learners inside (the batches, the engine's
        calls)."""
        yield

    def run_in_turn(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        """Run the learners one after another on the calling thread."""
        return [self.learner_step(learners, j, batch) for j, batch in enumerate(batches)]

    def local_step(self, algorithm: AlgorithmSteps, lr: float) -> None:
        """Apply every learner's own update once its gradient is computed."""
        algorithm.allocate_message()
        algorithm.local_step(slice(None), lr)

    def sync(self, algorithm: AlgorithmSteps, lr: float) -> None:
        """Run the algorithm's sync round over the learners' staged updates."""
        algorithm.sync(lr)

    def after_sync(self, compute: Callable[[], torch.Tensor]) -> Callable[[], float]:
        """Queue `compute` (a one-element tensor) after the latest sync without the host waiting for it; return a
        function that waits for its value."""
        value = float(compute())
        return lambda: value

    def synchronize(self) -> None:
        """Order the current stream's next work after all queued learner and sync work (before the trainer reads
        or changes the central model or the learners)."""

    def learner_step(self, learners: Learners, j: int, batch: Batch) -> torch.Tensor:
        """Run learner j's forward and backward pass on its batch; return its loss."""
        use_threads(self.learner_threads(learners.k))
        if j == 0 and not self.compiled:
            with self.activations.watch(learners.modules[j], batch[0]):
                loss = self.forward_backward(learners.modules[j], batch)
        else:
            loss = self.forward_backward(learners.modules[j], batch)
        self.take_gradients(learners, j)
        return loss

    def take_gradients(self, learners: Learners, j: int) -> None:
        """Move the gradients of learner j's backward pass into its row of `learners.grads`."""
        learners.take_gradients(j)

    def forward_backward(self, module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Accumulate the gradient of the module's loss on the batch into its gradients; return the loss."""
        inputs, targets = batch
        with self.autocast(inputs.device.type):
            loss = batch_loss("training set", self.model_loss, module, inputs, targets)
        loss.backward()
        return loss.detach()

    def _model_loss(self, module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(module(inputs), targets)

    def autocast(self, device_type: str) -> torch.autocast:
        return torch.autocast(device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def close(self) -> None:
        """Release worker resources."""


class SequentialEngine(LearnerEngine):
    """Run the learners one after another."""

    name = "sequential"

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        return self.run_in_turn(learners, batches)


class ThreadEngine(LearnerEngine):
    """Run the k learners at the same time on min(k, threads) worker threads, each taking a contiguous group of
    learners in turn (torch releases the GIL inside its kernels). Each worker then runs `local_step` for the rows
    of its learners (all on the first worker where the rows cannot step apart: `steps_rows_apart`), and the first
    worker runs the `sync` and the check after it, all with the learners' threads.

    Each learner computes with threads // k intra-op threads, as in every engine, so at most `threads` kernels'
    threads are busy at once: with one worker per learner, k = 4 learners on 2 threads ran 4 busy threads on 2
    cores, and the operating system's time slicing then decided the step's time. A thread that ran an op on more
    threads leaves the rest of its OpenMP team spinning for its next one (libgomp's default, a few milliseconds),
    so the calling thread computes its part of the step (the batches) on one thread, and the workers, whose
    teams are their learners', run the rest.
    """

    name = "threads"
    runs_learners_at_once = True

    def __init__(self, loss_fn: LossFn, threads: int, precision: str = "fp32", compile: bool = False):
        super().__init__(loss_fn, threads, precision, compile)
        self.workers: list[ThreadPoolExecutor] = []
        """One thread each, started as a step first needs it."""
        self.k = 1
        """The learners of the current step."""

    def concurrency(self, k: int) -> int:
        """The workers that run a step of k learners."""
        return min(k, self.threads)

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        self.k, workers = learners.k, self.concurrency(learners.k)
        if workers == 1 or self.warming_up:
            # One worker: nothing to overlap; measured on 2 cores (LeNet, b = 16, 2 threads), a lone learner in a
            # worker thread trained at 0.64x the samples/s of the same learner on the calling thread. Warming up:
            # compile once, on the calling thread, before the learners run the compiled code side by side
            return self.run_in_turn(learners, batches)
        while len(self.workers) < workers:
            self.workers.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"learner-{len(self.workers)}"))
        futures = [self.workers[i].submit(self.run_group, learners, group, batches) for i, group in self.groups()]
        return [loss for future in futures for loss in future.result()]

    def groups(self) -> Iterator[tuple[int, range]]:
        """Each worker of the current step and the contiguous group of learners it runs."""
        workers = self.concurrency(self.k)
        bounds = [self.k * i // workers for i in range(workers + 1)]
        return enumerate(range(start, end) for start, end in pairwise(bounds))

    def run_group(self, learners: Learners, group: range, batches: list[Batch]) -> list[torch.Tensor]:
        """Run the learners of `group` one after another on this worker thread."""
        return [self.learner_step(learners, j, batches[j]) for j in group]

    @contextmanager
    def stepping(self, k: int) -> Iterator[None]:
        if self.concurrency(k) == 1:
            yield
            return
        use_threads(1)
        try:
            yield
        finally:
            use_threads(self.threads)

    def local_step(self, algorithm: AlgorithmSteps, lr: float) -> None:
        """Each worker steps the rows of the learners it ran, where the algorithm lets rows step apart."""
        if not algorithm.steps_rows_apart or not self.on_workers():
            self.on_first_worker(super().local_step, algorithm, lr)
            return
        algorithm.allocate_message()
        futures = [
            self.workers[i].submit(self._with_learner_threads, algorithm.local_step, slice(group.start, group.stop), lr)
            for i, group in self.groups()
        ]
        for future in futures:
            future.result()

    def sync(self, algorithm: AlgorithmSteps, lr: float) -> None:
        self.on_first_worker(super().sync, algorithm, lr)

    def after_sync(self, compute: Callable[[], torch.Tensor]) -> Callable[[], float]:
        return self.on_first_worker(super().after_sync, compute)

    def on_first_worker(self, work: Callable, *args):
        """Return work(*args), run on the first worker with the learners' threads where the step ran on workers."""
        if not self.on_workers():
            return work(*args)
        return self.workers[0].submit(self._with_learner_threads, work, *args).result()

    def on_workers(self) -> bool:
        """Whether the current step's learners ran on the workers."""
        return 1 < self.concurrency(self.k) <= len(self.workers)

    def _with_learner_threads(self, work: Callable, *args):
        use_threads(self.learner_threads(self.k))
        return work(*args)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.workers = []


class StreamEngine(LearnerEngine):
    """Run each learner on its own CUDA stream and the algorithm's sync on a sync stream, ordered by events.

    Learner j's stream waits for the current stream (where the trainer resizes, resets and evaluates, and which
    waits for the prefetcher's copy of the batches); when the algorithm's learners read the central model in their
    forward pass (S-SGD, eager) it also waits for the last sync. Then forward and backward; then it waits for
    the last sync and runs the learner's own part of the step (`local_step`). The sync stream waits for every
    learner's `local_step` and for the current stream, then syncs. So with SMA a learner starts its next forward
    pass as soon as its own correction is applied, and the sync overlaps it. A learner's gradient row may be a
    staged row that the sync reads (`stages_in_gradients`), so its stream waits for the last sync before it takes
    its gradients into it. The current stream waits for the learners' losses each step and for everything at
    `synchronize`.
    """

    name = "streams"
    runs_learners_at_once = True

    def __init__(self, loss_fn: LossFn, threads: int, precision: str = "fp32", compile: bool = False):
        super().__init__(loss_fn, threads, precision, compile)
        self.streams: list[torch.cuda.Stream] = []
        self.sync_stream = torch.cuda.Stream()
        self.last_sync: torch.cuda.Event | None = None
        self.overlaps_sync = False

    def run_learners(self, learners: Learners, batches: list[Batch]) -> list[torch.Tensor]:
        current = torch.cuda.current_stream()
        while len(self.streams) < learners.k:
            self.streams.append(torch.cuda.Stream())
        losses = []
        for j, (stream, batch) in enumerate(zip(self.streams, batches, strict=False)):
            stream.wait_stream(current)
            for tensor in batch:
                tensor.record_stream(stream)
            if not self.overlaps_sync:
                self._wait_for_sync(stream)
            with torch.cuda.stream(stream):
                losses.append(self.learner_step(learners, j, batch))
        for stream, loss in zip(self.streams, losses, strict=False):
            current.wait_stream(stream)
            loss.record_stream(current)
        return losses

    def take_gradients(self, learners: Learners, j: int) -> None:
        self._wait_for_sync(torch.cuda.current_stream())
        learners.take_gradients(j)

    def local_step(self, algorithm: AlgorithmSteps, lr: float) -> None:
        self.overlaps_sync = algorithm.overlaps_sync
        current = torch.cuda.current_stream()
        algorithm.allocate_message()
        for j, stream in enumerate(self.streams[: algorithm.learners.k]):
            stream.wait_stream(current)
            self._wait_for_sync(stream)
            with torch.cuda.stream(stream):
                algorithm.local_step(slice(j, j + 1), lr)

    def sync(self, algorithm: AlgorithmSteps, lr: float) -> None:
        for stream in self.streams[: algorithm.learners.k]:
            self.sync_stream.wait_stream(stream)
        self.sync_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.sync_stream):
            algorithm.sync(lr)
            self.last_sync = self.sync_stream.record_event()

    def after_sync(self, compute: Callable[[], torch.Tensor]) -> Callable[[], float]:
        with torch.cuda.stream(self.sync_stream):
            host = compute().to("cpu", non_blocking=True)
            done = self.sync_stream.record_event()
        return lambda: (done.synchronize(), float(host))[1]

    def synchronize(self) -> None:
        current = torch.cuda.current_stream()
        for stream in [*self.streams, self.sync_stream]:
            current.wait_stream(stream)

    def _wait_for_sync(self, stream: torch.cuda.Stream) -> None:
        if self.last_sync is not None:
            stream.wait_event(self.last_sync)


ENGINES = {engine.name: engine for engine in (SequentialEngine, ThreadEngine, StreamEngine)}


def check_engine(name: str, device: torch.device, compile: bool = False) -> None:
    """Refuse an engine that cannot run on the device, and `compile` without a C++ compiler."""
    if name == "streams" and device.type != "cuda":
        raise ConfigError("--engine streams needs CUDA devices (--device cuda)")
    if compile:
        require_compiler("--compile")


def build_engine(
    name: str, loss_fn: LossFn, threads: int, device: torch.device, precision: str = "fp32", compile: bool = False
) -> LearnerEngine:
    """Return the named engine; `auto`: CUDA streams on a GPU, threads on a CPU rank with several threads."""
    if name == "auto":
        name = "streams" if device.type == "cuda" else "threads" if threads > 1 else "sequential"
    return ENGINES[name](loss_fn, threads, precision, compile)
