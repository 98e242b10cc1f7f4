"""The training harness shared by every algorithm: `Trainer(config).fit(model_fn, train_set, test_set)`."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from crossbow_mpi import checkpoint, runtime
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.comm import Communicator, MpiCommunicator, build_communicator
from crossbow_mpi.comm.base import StopAgreement
from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.data.prefetch import BatchPrefetcher, to_device
from crossbow_mpi.data.sampler import GlobalSampler, fetch_batch
from crossbow_mpi.engines import build_engine, check_engine
from crossbow_mpi.flat import FlatLayout
from crossbow_mpi.imbalance import parse_imbalance
from crossbow_mpi.learners import CentralModel, Learners
from crossbow_mpi.metrics import MetricsLog, Progress
from crossbow_mpi.schedule import learning_rate
from crossbow_mpi.tuner import AutoTuner, Policy
from crossbow_mpi.watchdog import Watchdog

EVAL_BATCH = 1000
STOP_LAG = 16
"""Steps between a stop vote and its outcome: ranks may run this far apart, and stop this many steps after a
signal."""


@dataclass
class FitResult:
    """What a finished run reached."""

    reached: bool
    """Whether the target accuracy was reached."""
    time_to_accuracy_s: float | None
    """Seconds of training until the target was first reached, None if never."""
    test_accuracy: float
    """Accuracy of z at the last evaluation."""
    iterations: int
    """Global iterations run."""
    epochs: float
    """Epochs run (fractional)."""
    central: torch.Tensor
    """A copy of the final central model's state vector z."""
    learners: int
    """Learners per rank at the end."""
    preempted: bool = False
    """Whether the run stopped early on a stop signal, after writing a checkpoint to resume from."""


class DivergenceError(RuntimeError):
    """The loss or the central model became NaN or infinite."""


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


class Trainer:
    """Train a model with one of the algorithms over all MPI ranks of the job."""

    def __init__(self, config: Config, comm: Communicator | None = None):
        self.config = config
        control = comm or MpiCommunicator(runtime.mpi().COMM_WORLD)
        agree(control, runtime.check_launch)
        agree(control, lambda: config.validate(ALGORITHMS))
        configs = control.allgather_json(dataclasses.asdict(config))
        differing = sorted(key for key in configs[0] if any(c[key] != configs[0][key] for c in configs))
        if differing:
            raise ConfigError(f"the ranks' configurations differ in: {', '.join(differing)}")
        local_rank, self.local_size, cpu_share = runtime.node_placement(control.mpi_comm)
        self.device = agree(control, lambda: runtime.select_device(config.device, local_rank))
        agree(control, lambda: check_engine(config.engine, self.device))
        self.threads = runtime.set_threads(config.threads, cpu_share, announce=control.rank == 0)
        self.imbalance = agree(control, lambda: parse_imbalance(config.inject_imbalance, config.seed, control.size))
        self.comm = comm or agree(control, lambda: build_communicator(control.mpi_comm, config.comm, self.device))

    def fit(self, model_fn: Callable[[], nn.Module], train_set, test_set,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy) -> FitResult:
        """Train `model_fn()` replicas on train_set until the target accuracy on test_set or the epoch limit."""
        cfg, comm = self.config, self.comm
        rank0 = comm.rank == 0
        autotune = cfg.learners == "auto"
        initial_learners = 1 if autotune else cfg.learners
        agree(comm, lambda: _check_datasets(train_set, test_set, cfg, initial_learners, comm.size))
        agree(comm, lambda: _prepare_run_dir(cfg, rank0))

        torch.manual_seed(cfg.seed)
        module = model_fn().to(self.device)
        layout = FlatLayout(module)
        central = CentralModel(module, layout)
        comm.broadcast_(central.z)
        learners = Learners(model_fn, layout, central, initial_learners)
        algorithm = ALGORITHMS[cfg.algorithm](cfg, comm, central, learners)
        engine = build_engine(cfg.engine, loss_fn, self.threads, self.device, cfg.precision)
        sampler = GlobalSampler(len(train_set), cfg.seed, comm.rank, comm.size)
        prefetcher = BatchPrefetcher(train_set, sampler, self.device, layout.dtype)
        tuner = None
        if autotune:
            max_learners = min(cfg.max_learners, len(train_set) // (comm.size * cfg.batch_size))
            bytes_per_learner = (layout.num_state + 2 * layout.num_params) * central.z.element_size()
            tuner = AutoTuner(Policy(cfg.autotune_threshold, max_learners), cfg.autotune_interval, comm,
                              self.device, cfg.max_memory, self.local_size, bytes_per_learner)
        runtime.seed_everything(cfg.seed, comm.rank)

        state = {"epoch": 0, "offset": 0, "iteration": 0, "samples": 0, "drops": 0, "next_eval": cfg.eval_every,
                 "elapsed_s": 0.0, "loss_sum": 0.0, "loss_count": 0, "time_to_accuracy_s": None, "last_eval": None}
        metrics = MetricsLog(cfg.run_dir, rank0)
        if cfg.resume:
            state, notes = checkpoint.load(comm, cfg.run_dir, central, learners)
            if tuner is not None and "autotune" in state:
                tuner.load_state(state["autotune"])
        else:
            notes = []
        total = int(cfg.epochs * len(train_set))
        progress = Progress(total, rank0, initial=state["samples"])
        for line in notes:
            progress.note(line)

        def settle() -> None:
            """Order what follows after the queued device work, check the last step's z, and collect the losses."""
            engine.synchronize()
            divergence.check()
            state["loss_sum"] += float(loss_total)
            loss_total.zero_()

        def evaluate() -> dict:
            settle()
            accuracy, loss = evaluate_model(central.module, test_set, comm, loss_fn)
            train_loss = comm.allreduce_sum_numbers([state["loss_sum"], state["loss_count"]])
            record = {"time_s": elapsed(), "epoch": epoch_progress(), "iteration": state["iteration"],
                      "samples": state["samples"], "test_accuracy": accuracy, "test_loss": loss,
                      "train_loss": train_loss[0] / max(train_loss[1], 1), "learners": learners.k,
                      "samples_per_s": window_samples / max(window_time, 1e-9), "lr": lr}
            record.update(algorithm.statistics())
            state["loss_sum"], state["loss_count"] = 0.0, 0
            state["last_eval"] = state["iteration"]
            if accuracy >= cfg.target_accuracy > 0 and state["time_to_accuracy_s"] is None:
                state["time_to_accuracy_s"] = record["time_s"]
            metrics.write(record)
            progress.report(record)
            return record

        def epoch_progress() -> float:
            return state["epoch"] + state["offset"] / len(train_set)

        def elapsed() -> float:
            return state["elapsed_s"] + time.perf_counter() - started

        def save() -> None:
            settle()
            algorithm.drain()
            state["elapsed_s"] = elapsed()
            if tuner is not None:
                state["autotune"] = tuner.state()
            checkpoint.save(comm, cfg.run_dir, central, learners, state, cfg.to_json(), cfg.keep_checkpoints)

        watchdog = Watchdog(comm.mpi_comm, cfg.collective_timeout) if cfg.collective_timeout else None
        stopping = StopAgreement(comm.mpi_comm, STOP_LAG, runtime.stop_requested)
        divergence = DivergenceCheck(comm)
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        """Training losses summed on the device since the last evaluation, so that no step waits to read one."""
        try:
            started = time.perf_counter()
            window_samples, window_time = 0, 0.0
            lr, _ = learning_rate(cfg, epoch_progress())
            record, stop = None, False
            while epoch_progress() < cfg.epochs and state["time_to_accuracy_s"] is None:
                if not sampler.fits(state["offset"], learners.k, cfg.batch_size):
                    state["epoch"], state["offset"] = state["epoch"] + 1, 0
                    continue
                lr, drops = learning_rate(cfg, epoch_progress())
                if drops != state["drops"]:
                    engine.synchronize()
                    algorithm.on_lr_drop()
                    state["drops"] = drops
                    if tuner is not None and cfg.autotune_on_lr_drop:
                        tuner.restart()
                        learners.resize(1, central.z)
                step_started = time.perf_counter()
                batches = prefetcher.batches(state["epoch"], state["offset"], learners.k, cfg.batch_size)
                losses = engine.compute_gradients(learners, batches)
                step_samples = sampler.step_size(learners.k, cfg.batch_size)
                prefetcher.prefetch(state["epoch"], state["offset"] + step_samples, learners.k, cfg.batch_size)
                if self.imbalance is not None:
                    time.sleep(self.imbalance.delay(state["iteration"], comm.rank, comm.size,
                                                    time.perf_counter() - step_started))
                engine.update(algorithm, lr)
                divergence.queue(state["iteration"] + 1, engine.after_sync(central.z.sum), losses)
                stop = stopping.poll()
                state["offset"] += step_samples
                state["samples"] += step_samples
                state["iteration"] += 1
                loss_total += losses.sum()
                state["loss_count"] += learners.k
                step_time = time.perf_counter() - step_started
                window_samples += step_samples
                window_time += step_time
                progress.advance(step_samples)
                if watchdog is not None:
                    watchdog.progress(state["iteration"])
                decision = tuner.observe(step_samples // comm.size, step_time, learners.k) if tuner else None
                if decision is not None:
                    engine.synchronize()
                    learners.resize(decision["learners"], central.z)
                    metrics.write({**decision, "iteration": state["iteration"], "time_s": elapsed()})
                    progress.note(f"autotune: {decision['decision']} -> {decision['learners']} learners/rank "
                                  f"({decision['samples_per_s'] or 0:.0f} samples/s with {decision['measured_learners']})")
                if _eval_due(cfg, state, sampler, learners.k):
                    record = evaluate()
                    window_samples, window_time = 0, 0.0
                    state["next_eval"] += cfg.eval_every
                if cfg.checkpoint_every and state["iteration"] % cfg.checkpoint_every == 0 or stop:
                    save()
                if stop:
                    break
            settle()
            algorithm.drain()
            stopping.close()
            progress.close()
            engine.close()
            if stop:
                metrics.write({"event": "preempted", "iteration": state["iteration"], "time_s": state["elapsed_s"]})
                progress.note(f"stopped by a signal at iteration {state['iteration']}; resume with --resume")
                return FitResult(reached=False, time_to_accuracy_s=None, test_accuracy=float("nan"),
                                 iterations=state["iteration"], epochs=epoch_progress(),
                                 central=central.z.detach().cpu().clone(), learners=learners.k, preempted=True)
            if state["last_eval"] != state["iteration"] or record is None:
                record = evaluate()
            save()
            reached = state["time_to_accuracy_s"] is not None
            metrics.write({"event": "summary", "reached": reached, "time_to_accuracy_s": state["time_to_accuracy_s"],
                           "target_accuracy": cfg.target_accuracy, "final_test_accuracy": record["test_accuracy"],
                           "time_s": state["elapsed_s"], "iterations": state["iteration"], "epochs": epoch_progress(),
                           "samples": state["samples"], "learners": learners.k, "world_size": comm.size,
                           "algorithm": cfg.algorithm, "threads_per_rank": self.threads, "device": str(self.device)})
            return FitResult(reached=reached, time_to_accuracy_s=state["time_to_accuracy_s"],
                             test_accuracy=record["test_accuracy"], iterations=state["iteration"],
                             epochs=epoch_progress(), central=central.z.detach().cpu().clone(), learners=learners.k)
        finally:
            if watchdog is not None:
                watchdog.close()


class DivergenceCheck:
    """Check the central model for NaN and Inf one step late, so that the host never waits for the step it has
    just queued on a GPU (collective: z is the same on every rank, so every rank raises at the same check)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.pending: tuple[int, Callable[[], float], torch.Tensor] | None = None

    def queue(self, iteration: int, read_z_sum: Callable[[], float], losses: torch.Tensor) -> None:
        """Check the previous step, then hold this one's z sum (and losses, to name culprits)."""
        self.check()
        self.pending = (iteration, read_z_sum, losses)

    def check(self) -> None:
        """Raise DivergenceError if the held step's central model is not finite."""
        if self.pending is None:
            return
        (iteration, read_z_sum, losses), self.pending = self.pending, None
        if not math.isfinite(read_z_sum()):
            raise DivergenceError(_divergence_report(self.comm, losses, iteration))


def _divergence_report(comm: Communicator, losses: torch.Tensor, iteration: int) -> str:
    """Name the learners whose loss was not finite at this iteration (collective)."""
    bad = comm.allgather_json([j for j, loss in enumerate(losses.tolist()) if not math.isfinite(loss)])
    culprits = [f"learner {j} on rank {rank}" for rank, learners in enumerate(bad) for j in learners]
    where = f"non-finite loss of {', '.join(culprits)}" if culprits else "the central model became non-finite"
    return f"training diverged at iteration {iteration}: {where}; the last good checkpoint is kept"


def _eval_due(cfg: Config, state: dict, sampler: GlobalSampler, learners: int) -> bool:
    if cfg.eval_every:
        return state["samples"] >= state["next_eval"]
    return not sampler.fits(state["offset"], learners, cfg.batch_size)


@torch.no_grad()
def evaluate_model(module: nn.Module, dataset, comm: Communicator, loss_fn) -> tuple[float, float]:
    """Return (accuracy, mean loss) of the module on the dataset, each rank evaluating a shard."""
    module.eval()
    device = next(module.parameters()).device
    dtype = next(module.parameters()).dtype
    n = len(dataset)
    start, stop = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
    correct, loss_sum = 0.0, 0.0
    for first in range(start, stop, EVAL_BATCH):
        indices = torch.arange(first, min(first + EVAL_BATCH, stop))
        inputs, targets = to_device(fetch_batch(dataset, indices), device, dtype)
        outputs = module(inputs)
        loss_sum += float(loss_fn(outputs, targets)) * len(indices)
        correct += float((outputs.argmax(1) == targets).sum())
    correct, loss_sum = comm.allreduce_sum_numbers([correct, loss_sum])
    return correct / n, loss_sum / n


def _check_datasets(train_set, test_set, cfg: Config, learners: int, world_size: int) -> None:
    if len(test_set) == 0:
        raise ConfigError("the test set is empty")
    step = learners * world_size * cfg.batch_size
    if step > len(train_set):
        raise ConfigError(f"one global step needs {step} samples (learners × ranks × batch size) "
                          f"but the training set has {len(train_set)}")


def _prepare_run_dir(cfg: Config, rank0: bool) -> None:
    if not rank0:
        return
    run_dir = Path(cfg.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.resume and checkpoint.list_checkpoints(cfg.run_dir):
            raise ConfigError(f"--run-dir {cfg.run_dir} holds checkpoints of an earlier run: "
                              "pass --resume to continue it, or choose another --run-dir")
        if not cfg.resume:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        (run_dir / "config.json").write_text(cfg.to_json() + "\n")
    except OSError as err:
        raise ConfigError(f"--run-dir {cfg.run_dir}: {err.strerror or err}") from None
