"""What the training loop calls at its named points: evaluation, checkpoints, auto-tuning, hyper-parameter
controllers and the divergence check. Each receives the run and only the scope it needs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from crossbow_mpi.comm import Communicator
from crossbow_mpi.comm.base import LaggedVote
from crossbow_mpi.comm.topology import Topology
from crossbow_mpi.config import Config
from crossbow_mpi.control.learner_tuner import AutoTuner, Policy
from crossbow_mpi.control.lr_schedule import Schedule
from crossbow_mpi.control.omnivore_search import OmnivoreOptimizer, optimizes
from crossbow_mpi.data.checks import batch_loss
from crossbow_mpi.data.prefetch import to_device
from crossbow_mpi.data.sampler import fetch_batch
from crossbow_mpi.replicas.state import TrainState
from crossbow_mpi.runtime import process
from crossbow_mpi.runtime.watchdog import Watchdog
from crossbow_mpi.training import checkpoint
from crossbow_mpi.training.rank_run import Run, Step
from crossbow_mpi.training.records import MetricsLog, Progress

OutputFn = Callable[[object], torch.Tensor]
"""Picks the class scores from a model's output (for models whose forward returns a tuple or a dict)."""
MetricFn = Callable[[object, torch.Tensor], torch.Tensor | None]
"""(output, labels) → whether each prediction is right (a bool tensor: per sample, or [B, T] per token), whose
mean over the test set is `test_accuracy`; None: no accuracy."""
EVAL_BATCH = 1000
STOP_LAG = 16
"""Steps between a stop vote and its outcome: ranks may run this far apart, and stop this many steps after a
signal (asynchronous algorithms' rounds end where every rank meets: they stop at the round's end)."""


class DivergenceError(RuntimeError):
    """The loss or the central model became NaN or infinite, or the loss grew past `--divergence-factor`."""


class Clock:
    """Training seconds: those of earlier sessions (from the state) plus this session's."""

    def __init__(self):
        self.started = time.perf_counter()

    def elapsed(self, state: TrainState) -> float:
        return state.elapsed_s + time.perf_counter() - self.started


ASYNCHRONOUS = ("omnivore", "hogbatch")
"""The algorithms whose groups update z asynchronously (Omnivore's implicit momentum)."""


class DivergenceCheck:
    """Check the central model for NaN and Inf one step late, so that the host never waits for the step it has
    just queued on a GPU (collective: every rank raises at the same check). Where z is the same on every rank,
    each rank decides alone; after a round of an algorithm whose ranks pull z from a server at their own pace
    (Omnivore, Hogbatch), one rank's copy may be non-finite while another's is not yet, so the ranks vote."""

    def __init__(self, world: Communicator, run_dir: str, factor: float = 0.0):
        self.world = world
        self.run_dir = run_dir
        self.factor = factor
        self.pending: tuple[int, Callable[[], float], torch.Tensor, bool] | None = None
        self.algorithm = ""
        self.unscaled_sizes: tuple[int, ...] = ()
        """Hogbatch's batch sizes when each rank's update is applied at the full learning rate, whatever its batch."""

    def after_step(self, run: Run, step: Step) -> None:
        """Check the previous step, then hold this one's z sum (and losses, to name culprits)."""
        self.check()
        if self.factor and run.state.iteration == 1:
            run.state.start_loss = _mean_positive(step.losses.tolist())
        read_z_sum = run.engine.after_sync(run.central.z.sum)
        self.pending = (run.state.iteration, read_z_sum, step.losses, run.algorithm.rounds)
        self.algorithm = run.algorithm.name
        sizes = run.hp.batch_size
        unscaled = self.algorithm == "hogbatch" and not run.hp.batch_scaled_lr
        self.unscaled_sizes = sizes if unscaled and isinstance(sizes, tuple) else ()

    def check(self) -> None:
        """Raise DivergenceError if the held step's central model is not finite."""
        if self.pending is None:
            return
        (iteration, read_z_sum, losses, vote), self.pending = self.pending, None
        finite = math.isfinite(read_z_sum())
        if vote:
            finite = all(self.world.allgather_json(finite))
        if not finite:
            bad = self.world.allgather_json([j for j, loss in enumerate(losses.tolist()) if not math.isfinite(loss)])
            culprits = [f"learner {j} on rank {rank}" for rank, learners in enumerate(bad) for j in learners]
            where = f"non-finite loss of {', '.join(culprits)}" if culprits else "the central model became non-finite"
            raise DivergenceError(f"training diverged at iteration {iteration}: {where}; {self._advice()}")

    def check_losses(self, state: TrainState, record: dict) -> None:
        """Raise DivergenceError when the evaluation's training or test loss is finite and above `factor` times the
        lower of the first step's loss and the first positive training loss of an evaluation (collective: rank 0
        decides, so that rounding cannot split the ranks). A non-finite test loss with a finite z comes from the
        test data, which the record flags."""
        if state.first_train_loss is None and record["train_loss"] > 0:
            state.first_train_loss = record["train_loss"]
        reference = min((loss for loss in (state.start_loss, state.first_train_loss) if loss is not None), default=None)
        if not self.factor or reference is None:
            return
        losses = {"training": record["train_loss"], "test": record["test_loss"]}
        over = [f"{name} loss {loss:.3g}" for name, loss in losses.items() if self.factor * reference < loss < math.inf]
        if self.world.bcast_json(over):
            raise DivergenceError(
                f"training diverged at iteration {state.iteration}: the {' and the '.join(over)} "
                f"{'are' if len(over) > 1 else 'is'} above --divergence-factor {self.factor:g} times the first "
                f"training loss, {reference:.3g}; {self._advice()}"
            )

    def _advice(self) -> str:
        """The likely cause and fix, and what was kept."""
        fix = "the step was too large: lower --lr (or --momentum)"
        if self.algorithm in ASYNCHRONOUS:
            fix += (
                f"; {self.algorithm} updates z asynchronously, which adds momentum of its own (about 1 - 1/G for G "
                "asynchronous groups): with --explicit-momentum it comes on top of --momentum, so drop that flag "
                "or lower --momentum"
            )
        if self.unscaled_sizes and min(self.unscaled_sizes) < max(self.unscaled_sizes) / 4:
            rank = self.unscaled_sizes.index(min(self.unscaled_sizes))
            fix += (
                f"; rank {rank} stepped on batches of {min(self.unscaled_sizes)}, each update applied at the full "
                "--lr: add --batch-scaled-lr (HeteroGPU's step lr * b_i / B), or with --adaptive-batch raise "
                "--batch-min"
            )
        kept = checkpoint.list_checkpoints(self.run_dir)
        return fix + (f"; the last checkpoint, {kept[-1].name}, is kept" if kept else "; no checkpoint was written")


def _mean_positive(losses: list[float]) -> float | None:
    """The mean of the positive finite losses (None if there are none: a pipeline stage without the loss)."""
    kept = [loss for loss in losses if 0 < loss < math.inf]
    return sum(kept) / len(kept) if kept else None


class Evaluation:
    """Evaluate z on the test set when due, and write the record with the training window's loss and speed."""

    def __init__(
        self,
        config: Config,
        data: Communicator,
        test_set,
        loss_fn,
        output_fn: OutputFn | None,
        metric_fn: MetricFn | None,
        metrics: MetricsLog,
        progress: Progress,
    ):
        self.config = config
        self.data = data
        self.test_set = test_set
        self.loss_fn = loss_fn
        self.output_fn = output_fn
        self.metric_fn = metric_fn
        self.metrics = metrics
        self.progress = progress
        self.window_samples, self.window_seconds = 0, 0.0

    def observe(self, step: Step) -> None:
        self.window_samples += step.samples
        self.window_seconds += step.seconds

    def due(self, run: Run) -> bool:
        if self.config.eval_every:
            return run.state.samples >= run.state.next_eval
        return not run.step_fits()

    def __call__(self, run: Run, lr: float, elapsed_s: float) -> dict:
        """Evaluate (collective; the run is settled); return the record."""
        state, cfg = run.state, self.config
        run.central.check_extra_state(self.data)
        started = time.perf_counter()
        tested = evaluate_model(
            run.central.module, self.test_set, self.data, self.loss_fn, self.output_fn, self.metric_fn
        )
        eval_s = time.perf_counter() - started
        train_loss = self.data.allreduce_sum_numbers([state.loss_sum, state.loss_count])
        record = {
            "time_s": elapsed_s,
            "epoch": run.epoch_progress,
            "iteration": state.iteration,
            "samples": state.samples,
            **tested,
            **({"target_loss": cfg.target_loss} if cfg.target_loss is not None else {}),
            "train_loss": train_loss[0] / max(train_loss[1], 1),
            "learners": run.learners.k,
            "samples_per_s": self.window_samples / max(self.window_seconds, 1e-9),
            "eval_s": eval_s,
            "lr": lr,
            "explicit_momentum": run.hp.momentum,
        }
        record.update(run.algorithm.statistics())
        state.loss_sum, state.loss_count = 0.0, 0
        state.last_eval = state.iteration
        if cfg.eval_every:
            state.next_eval += cfg.eval_every
        if reached(record, cfg) and state.time_to_target_s is None:
            state.time_to_target_s = elapsed_s
        self.window_samples, self.window_seconds = 0, 0.0
        self.metrics.write(record)
        self.progress.report(record)
        return record


def reached(record: dict, config: Config) -> bool:
    """Tell whether an evaluation reached a target: the test accuracy or the test loss."""
    accuracy, loss = record["test_accuracy"], record["test_loss"]
    by_accuracy = accuracy is not None and accuracy >= config.target_accuracy > 0
    return by_accuracy or (config.target_loss is not None and loss <= config.target_loss)


@torch.no_grad()
def evaluate_model(
    module: nn.Module,
    dataset,
    comm: Communicator,
    loss_fn,
    output_fn: OutputFn | None = None,
    metric_fn: MetricFn | None = None,
) -> dict[str, float | None]:
    """Return z's `test_loss` (the mean of the batches' losses, by samples) and `test_accuracy` (None where it does
    not apply, see `hits`) on the dataset, each rank evaluating a shard; for a language model (per-token accuracy)
    also `test_perplexity`, exp of the mean token loss."""
    module.eval()
    device = next(module.parameters()).device
    dtype = next(module.parameters()).dtype
    n = len(dataset)
    start, stop = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
    correct, counted, loss_sum, tokens = 0.0, 0.0, 0.0, 0.0
    for first in range(start, stop, EVAL_BATCH):
        indices = torch.arange(first, min(first + EVAL_BATCH, stop))
        inputs, targets = to_device(fetch_batch(dataset, indices), device, dtype)
        outputs = module(inputs)
        loss_sum += float(batch_loss("test set", loss_fn, outputs, targets)) * len(indices)
        scores = outputs if output_fn is None else output_fn(outputs)
        hit = metric_fn(outputs, targets) if metric_fn is not None else hits(scores, targets)
        if hit is not None:
            correct, counted = correct + float(hit.sum()), counted + hit.numel()
            tokens += hit.numel() if hit.dim() == 2 else 0
    correct, counted, loss_sum, tokens = comm.allreduce_sum_numbers([correct, counted, loss_sum, tokens])
    record = {"test_loss": loss_sum / n, "test_accuracy": correct / counted if counted else None}
    if tokens:
        record["test_perplexity"] = torch.tensor(loss_sum / n, dtype=torch.float64).exp().item()  # inf past e^709
    return record


def hits(scores: object, targets: torch.Tensor) -> torch.Tensor | None:
    """Return whether each arg-max class is the label: per sample for scores [B, C] and labels [B], per token for
    scores [B, T, V] and labels [B, T]; None for other shapes or an output that is not a tensor (no accuracy)."""
    if not isinstance(scores, torch.Tensor) or scores.dim() not in (2, 3) or targets.is_floating_point():
        return None
    return scores.argmax(-1) == targets if scores.shape[:-1] == targets.shape else None


class Tuning:
    """With `--learners auto`: measure throughput over windows of steps and change the learners per rank."""

    def __init__(
        self,
        config: Config,
        world: Communicator,
        run: Run,
        device: torch.device,
        local_size: int,
        metrics: MetricsLog,
        progress: Progress,
    ):
        self.config = config
        self.world = world
        self.metrics = metrics
        self.progress = progress
        self.tuner = None
        if config.learners == "auto":
            max_learners = min(config.max_learners, run.num_samples // run.sampler.step_size(1, run.hp.batch_size))
            self.tuner = AutoTuner(
                Policy(config.autotune_threshold, max_learners),
                config.autotune_interval,
                world,
                device,
                config.max_memory,
                local_size,
                run.learner_bytes,
            )

    def after_step(self, run: Run, step: Step, elapsed_s: float) -> None:
        if self.tuner is None:
            return
        decision = self.tuner.observe(step.samples // self.world.size, step.seconds, run.learners.k)
        if decision is None:
            return
        run.resize(decision["learners"])
        self.metrics.write({**decision, "iteration": run.state.iteration, "time_s": elapsed_s})
        self.progress.note(
            f"autotune: {decision['decision']} -> {decision['learners']} learners/rank "
            f"({decision['samples_per_s'] or 0:.0f} samples/s with {decision['measured_learners']})"
        )

    def on_lr_drop(self, run: Run) -> None:
        if self.tuner is not None and self.config.autotune_on_lr_drop:
            self.tuner.restart()
            run.resize(1)

    def state_dict(self) -> dict | None:
        return None if self.tuner is None else self.tuner.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.tuner is not None and state is not None:
            self.tuner.load_state_dict(state)


class Retuning:
    """With `--groups auto` or `--algorithm auto`: the optimizer chooses before training, unless the run resumed
    from its choice, and searches again around the current setting every `optimizer_epoch` seconds of training.
    Rank 0's clock decides for every rank, through a vote `lag` steps behind, as the stop votes are: a blocking
    collective per step would hold eager-SGD's ranks in lockstep, undoing its tolerance of stragglers."""

    def __init__(
        self,
        config: Config,
        world: Communicator,
        run: Run,
        metrics: MetricsLog,
        progress: Progress,
        stop: Callable[[], bool],
        lag: int,
    ):
        self.world = world
        self.optimizer = OmnivoreOptimizer(config, run, metrics, progress, stop) if optimizes(config) else None
        self.every = config.optimizer_epoch if self.optimizer else 0.0
        self.last: float | None = None
        """Training seconds at the last search (until the first: this session's start)."""
        self.due_here = False
        """Whether rank 0's clock found a search due at this step (False on the other ranks)."""
        self.votes = LaggedVote(world, lag, lambda: self.due_here) if self.every else None

    def choose(self, run: Run) -> bool:
        """Search from cold before training, unless the run's state was already tuned (resumed); return whether a stop
        signal ended the search (the run is back at its state before it)."""
        return self.optimizer is not None and not run.state.optimizer_s and self.optimizer.choose() is None

    def after_step(self, run: Run, clock: Clock) -> bool:
        """Search again when due; return whether a stop signal ended the search (the run is back at this step)."""
        if self.votes is None:
            return False
        self.last = run.state.elapsed_s if self.last is None else self.last
        self.due_here = self.world.rank == 0 and clock.elapsed(run.state) - self.last >= self.every
        if not self.votes.poll():
            return False
        assert self.optimizer is not None, "`votes` are cast with an optimizer"
        self.votes.forget()  # the votes cast before this search would call for another
        if self.optimizer.retune() is None:
            return True
        self.last = clock.elapsed(run.state)
        return False

    def close(self) -> None:
        """Complete the votes in flight and free their channel (collective)."""
        if self.votes is not None:
            self.votes.close()


class Controller(Protocol):
    """Changes hyper-parameters during a run: called after every step, returns the changes to make (the same on
    every rank), or None. A `measured` entry is not a change: it is written into the change's record (what the
    controller decided on)."""

    def __call__(self, run: Run, step: Step) -> dict | None: ...


class Controllers:
    """Apply the controllers' hyper-parameter changes and record each one."""

    def __init__(self, controllers, metrics: MetricsLog):
        self.controllers = list(controllers)
        self.metrics = metrics

    def state_dict(self) -> list:
        """Return each controller's state (its `state_dict()`, None for one without), on this rank."""
        return [c.state_dict() if hasattr(c, "state_dict") else None for c in self.controllers]

    def load_state_dict(self, states: list) -> None:
        """Restore the controllers' states saved by the same list of controllers (others start afresh)."""
        if len(states) == len(self.controllers):
            for controller, state in zip(self.controllers, states, strict=True):
                if state is not None and hasattr(controller, "load_state_dict"):
                    controller.load_state_dict(state)

    def after_step(self, run: Run, step: Step, elapsed_s: float) -> None:
        for controller in self.controllers:
            changes = dict(controller(run, step) or {})
            measured = changes.pop("measured", None)
            changed = run.hp.update(**changes)
            if changed:
                record = {"event": "hyperparams", "iteration": run.state.iteration, "time_s": elapsed_s}
                self.metrics.write({**record, "changes": changed, **({"measured": measured} if measured else {})})


class Checkpoints:
    """Write the whole training state when due, and read it back on resume (both collective over the world)."""

    def __init__(self, config: Config, world: Communicator, tuning: Tuning, controllers: Controllers):
        self.config = config
        self.world = world
        self.tuning = tuning
        self.controllers = controllers

    def due(self, state: TrainState) -> bool:
        return bool(self.config.checkpoint_every) and state.iteration % self.config.checkpoint_every == 0

    def save(self, run: Run, elapsed_s: float) -> None:
        """Drain the algorithm and write a checkpoint (the run is settled)."""
        run.algorithm.drain()
        snapshot = run.state_dict()
        snapshot["train"]["elapsed_s"] = elapsed_s
        snapshot["tuner"] = self.tuning.state_dict()
        snapshot["controllers"] = self.controllers.state_dict()
        checkpoint.save(
            self.world,
            self.config.run_dir,
            snapshot,
            self.config.to_json(),
            self.signature(run),
            self.config.keep_checkpoints,
            self.config.pipeline_stages,
            run.engine.cut if self.config.pipeline_stages > 1 else None,
        )

    def signature(self, run: Run) -> str:
        """Return the model's layout signature; with pipeline stages, the stages' joined (collective)."""
        return "+".join(self.world.allgather_json(run.layout.signature)[: self.config.pipeline_stages])

    def restore(self, run: Run) -> list[str]:
        """Load the newest valid checkpoint into the run, resharding to this job; return notes for the user."""
        snapshot, notes = checkpoint.load(self.world, self.config.run_dir, self.signature(run))
        fixed = self.config.learners if isinstance(self.config.learners, int) else None
        choice = snapshot["choice"]
        if optimizes(self.config) and choice:  # the optimizer's choice, on as many groups as fit these ranks
            run.switch_algorithm(choice["algorithm"], math.gcd(choice["groups"], run.topology.data.size))
        run.load_state_dict(snapshot, learners=fixed)
        self.tuning.load_state_dict(snapshot["tuner"])
        self.controllers.load_state_dict(snapshot["controllers"])
        if self.world.rank != 0:
            run.state.loss_sum, run.state.loss_count = 0.0, 0
        return notes


class _NoWatchdog:
    def progress(self, iteration: int) -> None:
        pass

    def close(self) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass
class Components:
    """Everything the loop calls besides the run itself."""

    schedule: Schedule
    evaluation: Evaluation
    checkpoints: Checkpoints
    tuning: Tuning
    controllers: Controllers
    retuning: Retuning
    divergence: DivergenceCheck
    stopping: LaggedVote
    watchdog: Watchdog | _NoWatchdog
    metrics: MetricsLog
    progress: Progress

    @classmethod
    def build(
        cls,
        config: Config,
        topology: Topology,
        run: Run,
        test_set,
        loss_fn,
        output_fn: OutputFn | None,
        metric_fn: MetricFn | None,
        controllers: Sequence[Controller],
        device: torch.device,
    ) -> Components:
        """Build the components and, with `resume`, restore the run from the newest checkpoint (collective)."""
        world = topology.world
        metrics = MetricsLog(config.run_dir, world.rank == 0, config.tensorboard)
        progress = Progress(int(config.epochs * run.num_samples), world.rank == 0)
        tuning = Tuning(config, world, run, device, topology.local_size, metrics, progress)
        adjusting = Controllers(controllers, metrics)
        checkpoints = Checkpoints(config, world, tuning, adjusting)
        for note in checkpoints.restore(run) if config.resume else []:
            progress.note(note)
        progress.advance(run.state.samples)
        stopping = LaggedVote(world, 0 if run.algorithm.rounds else STOP_LAG, process.stop_requested)
        return cls(
            schedule=Schedule(config),
            evaluation=Evaluation(config, topology.data, test_set, loss_fn, output_fn, metric_fn, metrics, progress),
            checkpoints=checkpoints,
            tuning=tuning,
            controllers=adjusting,
            retuning=Retuning(config, world, run, metrics, progress, stopping.now, stopping.lag),
            divergence=DivergenceCheck(world, config.run_dir, config.divergence_factor),
            stopping=stopping,
            watchdog=Watchdog(world, config.collective_timeout) if config.collective_timeout else _NoWatchdog(),
            metrics=metrics,
            progress=progress,
        )

    def finish(self, run: Run) -> None:
        """Complete the stop and re-tune votes, close the progress display and release the engine's workers
        (collective)."""
        self.stopping.close()
        self.retuning.close()
        self.progress.close()
        run.engine.close()

    def channels(self) -> list:
        """Return the MPI communicators of the control channels (the stop and re-tune votes', the watchdog's)."""
        watchdog = [self.watchdog.channel.mpi_comm] if isinstance(self.watchdog, Watchdog) else []
        votes = [self.retuning.votes.channel.mpi_comm] if self.retuning.votes is not None else []
        return [self.stopping.channel.mpi_comm, *votes, *watchdog]

    def close(self, failed: bool = False) -> None:
        """Stop the watchdog and close the metrics (collective, unless the run failed on this rank)."""
        self.watchdog.stop() if failed else self.watchdog.close()
        self.metrics.close()
