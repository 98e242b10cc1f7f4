"""The training harness shared by every algorithm: `Trainer(config).fit(model_fn, train_set, test_set)`.

`fit` builds a `Run` (the models, the algorithm and its engine, the data position) and the components the loop
calls at named points, then runs the loop below: one `train_step` per global step, then divergence, stop votes,
progress, auto-tuning and hyper-parameter controllers, and, when due, evaluation and checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.algorithms.base import WireOverflow
from crossbow_mpi.comm import Communicator, MpiCommunicator, build_communicator
from crossbow_mpi.comm.base import wait_sleeping
from crossbow_mpi.comm.topology import Topology
from crossbow_mpi.config import Config, ConfigError, per_rank, refuse_recipe, values
from crossbow_mpi.control.adaptive_batch import AdaptiveBatch, BatchPolicy
from crossbow_mpi.control.omnivore_search import optimizes
from crossbow_mpi.data.checks import check_samples
from crossbow_mpi.parallel.partition import time_cut
from crossbow_mpi.parallel.pipeline import build_pipeline, load_stages
from crossbow_mpi.replicas.engines import build_engine, check_engine
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.formats import choose_channels_last
from crossbow_mpi.replicas.optimizers import OptimizerFn, check_optimizer_fn, config_optimizer_fn
from crossbow_mpi.runtime import process, ulfm
from crossbow_mpi.runtime.imbalance import parse_imbalance
from crossbow_mpi.tensor_bytes import from_bytes, to_bytes
from crossbow_mpi.training import checkpoint
from crossbow_mpi.training.hooks import Clock, Components, Controller, DivergenceError, MetricFn, OutputFn
from crossbow_mpi.training.rank_run import Run
from crossbow_mpi.training.records import summary_writer_class
from crossbow_mpi.training.resuming import refuse_changed_hyperparams
from crossbow_mpi.training.undo import RunDirUndo

__all__ = ["DivergenceError", "FitResult", "Trainer", "agree"]


@dataclass
class FitResult:
    """What a finished run reached."""

    reached: bool
    """Whether a target (accuracy or loss) was reached."""
    time_to_target_s: float | None
    """Seconds of training until a target was first reached, None if never."""
    test_accuracy: float | None
    """Accuracy of z at the last evaluation (None where the model's output and labels give none)."""
    iterations: int
    """Global iterations run."""
    epochs: float
    """Epochs run (fractional)."""
    central: torch.Tensor
    """A copy of the final central model's state vector z (of the whole model, with pipeline stages too)."""
    learners: int
    """Learners per rank at the end."""
    preempted: bool = False
    """Whether the run stopped early on a stop signal, after writing a checkpoint to resume from."""
    test_loss: float = math.nan
    """Loss of z at the last evaluation."""
    test_perplexity: float | None = None
    """exp(test_loss) for a language model (per-token accuracy), else None."""
    _model_fn: Callable[[], nn.Module] | None = dataclasses.field(default=None, repr=False, compare=False)
    _extra: bytes = dataclasses.field(default=b"", repr=False, compare=False)

    @property
    def time_to_accuracy_s(self) -> float | None:
        """`time_to_target_s`, by its name from before loss targets."""
        return self.time_to_target_s

    def model(self) -> nn.Module:
        """Return a new `model_fn()` module holding the final z and its frozen parameters and non-float buffers."""
        assert self._model_fn is not None, "fit sets it"
        module = self._model_fn()
        return FlatLayout(module).load(module, self.central, self._extra)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return the final model's named parameters and buffers, as `model().state_dict()`."""
        return self.model().state_dict()


def agree(comm: Communicator, check: Callable[[], object]):
    """Run a check on every rank; if any rank raised ValueError (a user mistake), raise the first as
    ConfigError on every rank, so that all ranks stop together."""
    result, message = None, None
    try:
        result = check()
    except ValueError as err:
        message = str(err)
    messages = [m for m in comm.allgather_json(message) if m]
    if messages:
        raise ConfigError(messages[0])
    return result


def rendezvous(world: Communicator, timeout: float, where: str) -> None:
    """Wait until every rank has reached `where` (collective). When one has not within `timeout` seconds (0, or
    not a positive number: wait for ever), say so in one line and abort the job instead of hanging."""
    limited = isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0
    if not wait_sleeping([world.mpi_comm.Ibarrier()], timeout if limited else None):
        sys.stderr.write(
            f"crossbow_mpi: error: rank {world.rank} waited {timeout:g} s (--collective-timeout) in {where} for "
            "ranks that never came: call it on every rank of the job\n"
        )
        sys.stderr.flush()
        world.mpi().COMM_WORLD.Abort(2)


class Trainer:
    """Train a model with one of the algorithms over all MPI ranks of the job."""

    def __init__(self, config: Config, comm: MpiCommunicator | None = None):
        self.config = config
        process.install_abort_on_failure()
        world = comm or MpiCommunicator(process.mpi().COMM_WORLD)
        rendezvous(world, config.collective_timeout, "Trainer(config)")
        agree(world, process.check_launch)
        agree(world, lambda: config.validate(ALGORITHMS))
        if config.min_ranks > world.size:
            raise ConfigError(f"--min-ranks {config.min_ranks} exceeds the job's {world.size} ranks")
        if config.tensorboard:
            agree(world, summary_writer_class)
        configs = world.allgather_json(dataclasses.asdict(config))
        differing = sorted(key for key in configs[0] if any(c[key] != configs[0][key] for c in configs))
        if differing:
            raise ConfigError(f"the ranks' configurations differ in: {', '.join(differing)}")
        local_rank, local_size, cpu_share = process.node_placement(world.mpi_comm)
        device, threads = agree(
            world, lambda: [per_rank(config, n, world.size)[world.rank] for n in ("device", "threads")]
        )
        self.device = agree(world, lambda: process.select_device(device, local_rank))
        agree(world, lambda: check_engine(config.engine, self.device, config.compile))
        self.threads = process.set_threads(threads, cpu_share, announce=world.rank == 0)
        self.imbalance = agree(world, lambda: parse_imbalance(config.inject_imbalance, config.seed, world.size))
        self.channels_last: bool | None = None
        """Whether this Trainer's runs keep channels-last flat buffers, once its first run resolved
        `--memory-format` (a run rebuilt on the survivors of a rank loss keeps its layout, to restore its copy)."""
        if config.pipeline_stages > 1:
            data_comm = (
                MpiCommunicator if comm else lambda c: build_communicator(c, config.comm, self.device, config.hierarchy)
            )
            self.topology = agree(
                world, lambda: Topology.pipeline(world, config.pipeline_stages, data_comm, local_rank, local_size)
            )
            return
        data = comm or agree(
            world, lambda: build_communicator(world.mpi_comm, config.comm, self.device, config.hierarchy)
        )
        self.topology = _data_topology(config, world, data, local_rank, local_size)

    @property
    def comm(self) -> Communicator:
        """The control scope: every rank of the job."""
        return self.topology.world

    def _channels_last(self, model_fn, train_set, loss_fn) -> bool | None:
        """Resolve `memory_format` on rank 0 (`auto` times a pass of the whole model there); None on other ranks."""
        cfg = self.config
        if self.channels_last is not None:
            return self.channels_last
        if cfg.memory_format != "auto":
            return cfg.memory_format == "channels_last"  # without touching the data (a sampler's dataset records)
        if self.topology.world.rank != 0:
            return None
        sizes = cfg.batch_size if isinstance(cfg.batch_size, tuple) else (cfg.batch_size,)
        batch = train_set.get_batch(torch.arange(min(sizes[0], len(train_set))))
        return choose_channels_last(cfg.memory_format, model_fn, batch, loss_fn, self.device)

    def start(
        self,
        model_fn: Callable[[], nn.Module],
        train_set,
        loss_fn=F.cross_entropy,
        test_set=None,
        output_fn: OutputFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
    ) -> Run:
        """Build the run on every rank (collective): z broadcast, learners, algorithm, engine, data position; check
        a few samples of each dataset against the model first. `optimizer_fn(params)` (a torch.optim optimizer)
        steps what the algorithm steps instead of `--optimizer` (crossbow_mpi.replicas.optimizers)."""
        cfg, world = self.config, self.topology.world
        if optimizer_fn is not None:
            refuse_recipe(cfg, "optimizer_fn")
            agree(world, functools.partial(check_optimizer_fn, optimizer_fn))
        learners = cfg.learners if isinstance(cfg.learners, int) else 1
        agree(world, lambda: _check_train_set(train_set, cfg, learners, self.topology.data.size))
        _check_same_datasets(world, train_set, test_set)
        channels_last = world.bcast_json(agree(world, lambda: self._channels_last(model_fn, train_set, loss_fn)))
        self.channels_last = channels_last
        if cfg.pipeline_stages > 1:
            stage, device = self.topology.stage, self.device
            cut = agree(world, lambda: _pipeline_cut(cfg, model_fn, train_set, device) if world.rank == 0 else None)
            cut = world.bcast_json(cut)
            model_fn, engine = agree(
                world, lambda: build_pipeline(model_fn, stage, cfg, loss_fn, self.threads, device, cut)
            )
        else:
            engine = build_engine(cfg.engine, loss_fn, self.threads, self.device, cfg.precision, cfg.compile)
        optimizer_fn = optimizer_fn or config_optimizer_fn(cfg)
        run = Run(
            cfg,
            self.topology,
            engine,
            self.device,
            model_fn,
            train_set,
            learners,
            self.imbalance,
            optimizer_fn,
            channels_last,
        )
        for dataset, role in ((train_set, "training set"), (test_set, "test set")):
            if dataset is not None:
                module, dtype = run.central.module, run.layout.dtype
                agree(world, functools.partial(check_samples, module, dtype, dataset, role, output_fn, loss_fn))
        return run

    def fit(
        self,
        model_fn: Callable[[], nn.Module],
        train_set,
        test_set,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
        output_fn: OutputFn | None = None,
        controllers: Sequence[Controller] = (),
        optimizer_fn: OptimizerFn | None = None,
        metric_fn: MetricFn | None = None,
    ) -> FitResult:
        """Train `model_fn()` replicas on train_set until a target (accuracy or loss) on test_set or the epoch limit.

        `output_fn` picks the class scores from the model's output for evaluation (default: the output itself).
        With the user's own `loss_fn`, labels may have any shape; `metric_fn(output, labels)` says which predictions
        are right (default: the arg-max class per sample, or per token for [B, T, V] scores against [B, T] labels).
        Each controller may change the run's hyper-parameters after any step (see hooks.Controller). A Trainer
        trains once: a fit that ends releases its NCCL communicators."""
        cfg, world = self.config, self.topology.world
        rendezvous(world, cfg.collective_timeout, "Trainer.fit")
        agree(world, lambda: _check_test_set(test_set))
        inputs = _Inputs(model_fn, train_set, test_set, loss_fn, output_fn, controllers, optimizer_fn, metric_fn)
        run = self.start(*inputs.start_args())
        agree(world, lambda: _check_run_dir(cfg, world.rank == 0, self.topology.data.size))
        parts = self._components(cfg, run, inputs)
        undo = _wire_undo(cfg, run, world)
        agree(world, lambda: _write_config(cfg, world.rank == 0))  # only once a --resume has restored the run
        for stale in checkpoint.remove_temporaries(cfg.run_dir) if world.rank == 0 else []:
            parts.progress.note(f"removed {stale.name}, left by a run killed while writing it")
        every = 1 if run.algorithm.rounds else cfg.rollback_every
        rollback, clock = ulfm.Rollback(cfg.on_rank_loss == "continue", every), Clock()
        try:
            stop = parts.stopping.now() or parts.retuning.choose(run)  # the same outcome on every rank
            while True:
                try:
                    result = self._loop(run, parts, stop, clock, rollback)
                    break
                except Exception as err:
                    if not rollback.enabled or not ulfm.is_rank_loss(err):
                        raise
                    run, parts = self._recover(run, parts, clock, rollback, inputs)
                    stop = False
            if cfg.pipeline_stages > 1:
                result = _whole_model(result, self.topology.stage, model_fn, run.engine.cut)
        except BaseException as err:
            parts.close(failed=True)
            if undo is not None and isinstance(err, WireOverflow):
                undo.restore()
            raise
        finally:
            if undo is not None:
                undo.close()
        parts.close()
        self.topology.close()
        return result

    def _components(self, cfg: Config, run: Run, inputs: _Inputs) -> Components:
        """Build the loop's components for `run` (collective; with `cfg.resume`, restore the run)."""
        controllers = inputs.controllers
        if cfg.adaptive_batch:
            policy = BatchPolicy(
                cfg.adapt_every, cfg.batch_min, cfg.batch_max, cfg.batch_step, cfg.warmup_epochs, cfg.adapt_hold
            )
            controllers = [*controllers, AdaptiveBatch(policy, self.topology.data)]
        args = (inputs.test_set, inputs.loss_fn, inputs.output_fn, inputs.metric_fn, controllers, self.device)
        return Components.build(cfg, self.topology, run, *args)

    def _recover(
        self, run: Run, parts: Components, clock: Clock, rollback: ulfm.Rollback, inputs: _Inputs
    ) -> tuple[Run, Components]:
        """Go on without the ranks that died (`_survive`), again on fewer ranks when more die meanwhile."""
        live, size = [run, parts], self.topology.world.size
        lost: list[int] = []
        while True:
            try:
                return self._survive(live, lost, clock, rollback, inputs, size)
            except Exception as err:
                if not ulfm.is_rank_loss(err):
                    raise

    def _survive(
        self, live: list, lost: list[int], clock: Clock, rollback: ulfm.Rollback, inputs: _Inputs, size: int
    ) -> tuple[Run, Components]:
        """Go on without the ranks that died (ULFM): revoke every scope, shrink the world to the survivors,
        rebuild the scopes, the run and its components on them, restore the newest copy of the state that every
        survivor holds (the steps since, the one in flight among them, are dropped on all of them), check that
        they hold the same z, record the loss and write a checkpoint. `live` holds the run and its components,
        `lost` the ranks lost so far, `size` the world's before the loss. RankLost when the run cannot go on here
        (exit 75)."""
        started, cfg, old, (run, parts) = time.perf_counter(), self.config, self.topology, live
        scopes = (old.world, old.data, old.group, old.stage, run.algorithm.transport)
        ulfm.revoke([comm for scope in scopes for comm in scope.mpi_comms()] + parts.channels())
        for scope in scopes:
            scope.abandon()
        parts.close(failed=True)
        run.engine.close()
        survivors, dead = ulfm.shrink(old.world.mpi_comm)
        lost[:] = sorted(lost + dead)
        world = MpiCommunicator(survivors)
        if cfg.pipeline_stages > 1:
            raise ulfm.RankLost(f"rank(s) {_names(lost)} died and a pipeline cannot lose a stage")
        iteration = rollback.common(world)
        if iteration < 0:
            raise ulfm.RankLost(f"rank(s) {_names(lost)} died before the first step")
        local_rank, local_size, _ = process.node_placement(survivors, shrunk=True)
        data = build_communicator(survivors, cfg.comm, self.device, cfg.hierarchy)
        self.topology = _data_topology(cfg, world, data, local_rank, local_size, shrunk=True)
        run = self.start(*inputs.start_args())
        parts = self._components(dataclasses.replace(cfg, resume=False), run, inputs)
        live[:] = run, parts
        run.load_state_dict(rollback.at(iteration))
        run.set_explicit_momentum()  # of the survivors' groups
        if cfg.rank_loss_lr == "linear":
            run.hp.lr *= world.size / size
        if len(set(world.allgather_json(ulfm.digest(run.central.z)))) > 1:
            raise ulfm.RankLost("the survivors hold different central models after the rollback")
        record = {"event": "rank_lost", "ranks": lost, "world_size": world.size, "iteration": iteration}
        parts.metrics.write({**record, "lr": run.hp.lr, "recovery_s": time.perf_counter() - started})
        parts.checkpoints.save(run, clock.elapsed(run.state))
        if world.size < cfg.min_ranks:
            raise ulfm.RankLost(f"rank(s) {_names(lost)} died and {world.size} < --min-ranks {cfg.min_ranks} remain")
        parts.progress.note(f"rank(s) {_names(lost)} died; going on with {world.size} ranks from iteration {iteration}")
        return run, parts

    def _loop(self, run: Run, c: Components, stop: bool, clock: Clock, rollback: ulfm.Rollback) -> FitResult:
        """Train until the epoch limit, the target accuracy or a stop signal (`stop`: before the first step);
        evaluate and checkpoint at the end. `rollback` keeps the state before each step."""
        cfg, state = self.config, run.state
        lr, record, time_limited = c.schedule.current_lr(run), None, False
        if stop:
            run.settle()
            c.checkpoints.save(run, clock.elapsed(state))
        while not stop and run.epoch_progress < cfg.epochs and state.time_to_target_s is None and not time_limited:
            if not run.step_fits():
                state.next_epoch()
                continue
            lr, dropped = c.schedule.step_lr(run)
            if dropped:
                c.tuning.on_lr_drop(run)
            rollback.before_step(state.iteration, run.detached_snapshot, state.samples)
            step = run.train_step(lr)
            c.divergence.after_step(run, step)
            stop = c.stopping.poll()
            c.evaluation.observe(step)
            c.progress.advance(step.samples)
            c.watchdog.progress(state.iteration)
            c.tuning.after_step(run, step, clock.elapsed(state))
            c.controllers.after_step(run, step, clock.elapsed(state))
            stop = c.retuning.after_step(run, clock) or stop
            evaluate, save = c.evaluation.due(run), c.checkpoints.due(state) or stop
            if evaluate or save:
                rollback.keep_next()
                run.settle()
                c.divergence.check()
            if evaluate:
                record = c.evaluation(run, lr, clock.elapsed(state))
                c.divergence.check_losses(state, record)
                if cfg.time_limit:
                    time_limited = self.topology.world.bcast_json(clock.elapsed(state) >= cfg.time_limit)
            if save:
                c.checkpoints.save(run, clock.elapsed(state))
            if stop:
                break
        run.settle()
        c.divergence.check()
        run.algorithm.drain()
        c.finish(run)
        if stop:
            c.metrics.write({"event": "preempted", "iteration": state.iteration, "time_s": clock.elapsed(state)})
            c.progress.note(f"stopped by a signal at iteration {state.iteration}; resume with --resume")
            return _result(run, {"test_accuracy": math.nan, "test_loss": math.nan}, preempted=True)
        if state.last_eval != state.iteration or record is None:
            record = c.evaluation(run, lr, clock.elapsed(state))
            c.divergence.check_losses(state, record)
        c.checkpoints.save(run, clock.elapsed(state))
        summary = {**self._summary(run, record, clock.elapsed(state)), "time_limited": time_limited}
        c.metrics.write(summary)
        if time_limited:
            c.progress.note(f"stopped at the time limit ({cfg.time_limit:g}s) at iteration {state.iteration}")
        if optimizes(cfg):
            c.progress.note(
                f"optimizer: {summary['optimizer_s']:.1f}s of {summary['time_s']:.1f}s "
                f"({summary['optimizer_share']:.0%}); trained with {summary['algorithm']}"
            )
        return _result(run, record)

    def _summary(self, run: Run, record: dict, elapsed_s: float) -> dict:
        """Return the run's last metrics record."""
        state = run.state
        return {
            "event": "summary",
            "reached": state.time_to_target_s is not None,
            "time_to_target_s": state.time_to_target_s,
            "target_accuracy": self.config.target_accuracy,
            "target_loss": self.config.target_loss,
            "final_test_accuracy": record["test_accuracy"],
            "final_test_loss": record["test_loss"],
            **({"final_test_perplexity": record["test_perplexity"]} if "test_perplexity" in record else {}),
            "time_s": elapsed_s,
            "iterations": state.iteration,
            "epochs": run.epoch_progress,
            "samples": state.samples,
            "learners": run.learners.k,
            "world_size": self.topology.world.size,
            "hierarchy": run.algorithm.transport.hierarchy,
            "algorithm": run.algorithm.name,
            "explicit_momentum": run.hp.momentum,
            "threads_per_rank": self.threads,
            "device": str(self.device),
            "memory_format": run.layout.order,
            "memory_bytes": self.topology.world.allgather_json(run.memory_bytes()),
            **({"compile_s": run.engine.warmup_s} if self.config.compile else {}),
            **({"comm_bytes": record["comm_bytes"]} if "comm_bytes" in record else {}),
            **(
                {"optimizer_s": state.optimizer_s, "optimizer_share": state.optimizer_s / max(elapsed_s, 1e-9)}
                if optimizes(self.config)
                else {}
            ),
        }


@dataclass
class _Inputs:
    """What `fit` was given, to rebuild the run from on the survivors of a rank loss."""

    model_fn: Callable[[], nn.Module]
    train_set: object
    test_set: object
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    output_fn: OutputFn | None
    controllers: Sequence[Controller]
    optimizer_fn: OptimizerFn | None
    metric_fn: MetricFn | None

    def start_args(self) -> tuple:
        """The arguments of `Trainer.start`."""
        return self.model_fn, self.train_set, self.loss_fn, self.test_set, self.output_fn, self.optimizer_fn


def _data_topology(
    config: Config, world: MpiCommunicator, data: Communicator, local_rank: int, local_size: int, shrunk: bool = False
) -> Topology:
    """Return the scopes of a run whose ranks each hold a whole model (collective): Omnivore's compute groups (on
    the survivors of a rank loss, `shrunk`, the most groups up to its --groups that split them evenly), one group
    per rank (hogbatch, elastic), else one data-parallel group."""
    if config.algorithm not in ("omnivore", "hogbatch", "elastic"):
        return Topology.data_parallel(world, data, local_rank, local_size)
    if config.algorithm != "omnivore":
        return Topology.grouped(world, data, world.size, local_rank, local_size)  # one group per rank
    groups = config.groups if isinstance(config.groups, int) else 1  # the optimizer starts from one group
    if shrunk:
        groups = max(g for g in range(1, min(groups, world.size) + 1) if world.size % g == 0)
    return Topology.grouped(world, data, groups, local_rank, local_size)


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _result(run: Run, record: dict, preempted: bool = False) -> FitResult:
    return FitResult(
        reached=run.state.time_to_target_s is not None and not preempted,
        time_to_target_s=run.state.time_to_target_s,
        test_accuracy=record["test_accuracy"],
        test_loss=record["test_loss"],
        test_perplexity=record.get("test_perplexity"),
        iterations=run.state.iteration,
        epochs=run.epoch_progress,
        central=run.central.layout.to_logical(run.central.z.detach()).cpu(),
        learners=run.learners.k,
        preempted=preempted,
        _model_fn=run.learners.model_fn,
        _extra=run.central.layout.extra_state_bytes(run.central.module),
    )


def _whole_model(
    result: FitResult, stage: Communicator, model_fn: Callable[[], nn.Module], cut: list[int] | None
) -> FitResult:
    """Return the result of a pipeline run with the whole `model_fn()` model, joined from the stages' z and extra
    state, the model cut at `cut` (collective over the stage scope)."""
    states = stage.allgather_bytes(to_bytes(result.central))
    extras = stage.allgather_bytes(result._extra)
    dtype = result.central.dtype
    shards = [
        (from_bytes(z, dtype, [len(z) // dtype.itemsize]), extra) for z, extra in zip(states, extras, strict=True)
    ]
    model = load_stages(model_fn(), shards, cut)
    layout = FlatLayout(model)
    return dataclasses.replace(
        result, central=layout.flatten(model), _model_fn=model_fn, _extra=layout.extra_state_bytes(model)
    )


def _pipeline_cut(cfg: Config, model_fn: Callable[[], nn.Module], train_set, device: torch.device) -> list[int] | None:
    """Return where to cut the model into the pipeline's stages (see `stages`): on resume the newest valid
    checkpoint's cut, so that its shards load into the same stages; with `--cut time` the cut that balances
    forward+backward time, measured on a micro-batch of the training set; else None (by parameter count)."""
    if cfg.resume:
        path, _ = checkpoint.newest_valid(cfg.run_dir)
        stored = checkpoint.read_cut(path) if path else None
        if stored is not None and len(stored) == cfg.pipeline_stages - 1:
            return stored
    if cfg.cut == "params":
        return None
    micro = max(1, min(values(cfg.batch_size)) // cfg.micro_batches)
    with torch.random.fork_rng(devices=[]):  # the measurement leaves the run's random streams as they were
        model = model_fn().to(device)
        dtype = next(model.parameters()).dtype
        inputs = torch.stack([train_set[i][0] for i in range(min(micro, len(train_set)))]).to(device, dtype)
        return time_cut(model, cfg.pipeline_stages, inputs)


def _check_test_set(test_set) -> None:
    if test_set is None:
        raise ConfigError("fit needs a test set to evaluate on (test_set is None)")
    if len(test_set) == 0:
        raise ConfigError("the test set is empty")


def _check_train_set(train_set, cfg: Config, learners: int, world_size: int) -> None:
    step = learners * sum(per_rank(cfg, "batch_size", world_size))
    if step > len(train_set):
        raise ConfigError(
            f"one global step needs {step} samples (learners × ranks × batch size) "
            f"but the training set has {len(train_set)}"
        )


def _check_same_datasets(world: Communicator, train_set, test_set) -> None:
    """ConfigError on every rank when the ranks were given datasets of different lengths (collective)."""
    lengths = world.allgather_json([len(train_set), None if test_set is None else len(test_set)])
    for rank, theirs in enumerate(lengths):
        for role, first, other in zip(("training set", "test set"), lengths[0], theirs, strict=True):
            if other != first:
                raise ConfigError(
                    f"rank {rank}'s {role} has {other} samples and rank 0's {first}: "
                    "pass the same datasets on every rank"
                )


def _check_run_dir(cfg: Config, rank0: bool, data_ranks: int) -> None:
    """Refuse a run directory whose checkpoints or records a new run would overwrite, and a resume that sets the
    run's hyper-parameters otherwise (`data_ranks`: the resume's ranks of the data scope)."""
    if not rank0:
        return
    if cfg.resume:
        refuse_changed_hyperparams(cfg, data_ranks)
        return  # other problems stop checkpoint.load, naming why, and leave no trace
    run_dir = Path(cfg.run_dir)
    try:
        if checkpoint.list_checkpoints(cfg.run_dir):
            raise ConfigError(
                f"--run-dir {cfg.run_dir} holds checkpoints of an earlier run: "
                "pass --resume to continue it, or choose another --run-dir"
            )
        records = run_dir / "metrics.jsonl"
        if records.exists() and records.stat().st_size:
            raise ConfigError(
                f"--run-dir {cfg.run_dir} holds the records of an earlier run that wrote no checkpoint "
                "(metrics.jsonl): choose another --run-dir, or remove that file to start over"
            )
    except OSError as err:
        raise ConfigError(f"--run-dir {cfg.run_dir}: {err.strerror or err}") from None


def _wire_undo(cfg: Config, run: Run, world: Communicator) -> RunDirUndo | None:
    """With a float16 wire: refuse a model whose buffers (elastic: also parameters) are already beyond float16's
    range, before anything is written (collective); return, on rank 0, the run directory's state to restore if the
    first sync's message is (None elsewhere, and with another wire)."""
    if run.hp.sync_dtype != "fp16" or world.size == 1:
        return None
    algorithm = run.algorithm
    algorithm.refuse_overflow(algorithm.dry_message(), world, "at start-up")
    return RunDirUndo(cfg.run_dir) if world.rank == 0 else None


def _write_config(cfg: Config, rank0: bool) -> None:
    """Make the run directory where missing and write config.json into it (a new file renamed over the old)."""
    if rank0:
        try:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            path = Path(cfg.run_dir) / "config.json"
            path.with_name(path.name + ".tmp").write_text(cfg.to_json() + "\n")
            os.replace(path.with_name(path.name + ".tmp"), path)
        except OSError as err:
            raise ConfigError(f"--run-dir {cfg.run_dir}: {err.strerror or err}") from None
