"""One training run on this rank: the models, the algorithm and its engine, the data position and the
hyper-parameters; `train_step` is the data path, `state_dict` a snapshot of all of it."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from crossbow_mpi.algorithms import ALGORITHMS, Algorithm
from crossbow_mpi.algorithms.omnivore import Omnivore, explicit_momentum
from crossbow_mpi.algorithms.rounds import RoundsAlgorithm
from crossbow_mpi.comm.topology import Topology
from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.data.prefetch import BatchPrefetcher
from crossbow_mpi.data.sampler import GlobalSampler
from crossbow_mpi.replicas.engines import LearnerEngine
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.footprint import bytes_per_learner, footprint
from crossbow_mpi.replicas.kernels import fuse
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.optimizers import OptimizerFn
from crossbow_mpi.replicas.state import HyperParams, TrainState
from crossbow_mpi.runtime import process, ulfm
from crossbow_mpi.runtime.imbalance import Imbalance
from crossbow_mpi.transports import build_transport
from crossbow_mpi.transports.model_server import ModelServer
from crossbow_mpi.transports.partial_allreduce import PartialAllreduce


@dataclass
class Step:
    """What one global step did on this rank."""

    samples: int
    """Samples the step took over every rank of the data scope."""
    losses: torch.Tensor
    """This rank's learners' losses (on the device)."""
    seconds: float
    """Host time of the step on this rank."""
    compute_s: float
    """Host time of the step on this rank before its sync (batches, gradients, injected delay)."""
    updates: int = 1
    """Local steps this rank took (in a round of an asynchronous algorithm, as many as it had time for)."""


ROUND_STEPS = 32
"""Global steps' samples per round of an asynchronous algorithm, unless `round_samples` says."""
AUTO_FIRST = "ssgd"
"""The algorithm an `--algorithm auto` run is built with, until the optimizer switches it."""


def build_model(
    model_fn: Callable[[], nn.Module], device: torch.device, topology: Topology, channels_last: bool = False
):
    """Return this rank's model on `device` and its flat layout (collective). ConfigError on every rank when any
    rank's model_fn gave no trainable torch module, or when the ranks that average one model built different
    architectures (their parameters would be averaged position by position into nonsense)."""
    module, layout, problem = None, None, None
    try:
        module = model_fn()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"model_fn returned {type(module).__name__}, not a torch.nn.Module")
        module = module.to(device)
        layout = FlatLayout(module, channels_last)
    except ValueError as err:  # ConfigError, or FlatLayout's "no trainable parameters"
        problem = f"rank {topology.world.rank}: {err}"
    problems = [p for p in topology.world.allgather_json(problem) if p]
    if problems:
        raise ConfigError(problems[0])
    assert module is not None and layout is not None
    shapes = topology.data.allgather_json([layout.signature, layout.num_state])
    for rank, (signature, size) in enumerate(shapes):
        if [signature, size] != shapes[0]:
            raise ConfigError(
                f"rank {rank} of the data scope built another model than rank 0 (layout {signature} of {size} "
                f"values against {shapes[0][0]} of {shapes[0][1]}): model_fn must build the same architecture "
                "on every rank"
            )
    return module, layout


class Run:
    """Everything one `fit` trains on this rank."""

    def __init__(
        self,
        config: Config,
        topology: Topology,
        engine: LearnerEngine,
        device: torch.device,
        model_fn: Callable[[], nn.Module],
        train_set,
        learners: int,
        imbalance: Imbalance | None = None,
        optimizer_fn: OptimizerFn | None = None,
        channels_last: bool = False,
    ):
        self.topology = topology
        self.optimizer_fn = optimizer_fn
        """What steps the weights where not the algorithms' momentum SGD (crossbow_mpi.replicas.optimizers)."""
        self.engine = engine
        self.imbalance = imbalance
        torch.manual_seed(config.seed)
        module, self.layout = build_model(model_fn, device, topology, channels_last)
        self.central = CentralModel(module, self.layout)
        topology.data.broadcast_(self.central.z)
        self.central.broadcast_extra_state(topology.data)
        self.learners = Learners(model_fn, self.layout, self.central, learners)
        self.hp = HyperParams.from_config(config)
        auto = config.algorithm == "auto"
        self.config = dataclasses.replace(config, eager_mode="majority") if auto else config
        """What the transports are built from (`--algorithm auto` probes eager-SGD in its majority mode)."""
        self.algorithm = self._build_algorithm(AUTO_FIRST if auto else config.algorithm)
        self.set_explicit_momentum()
        if isinstance(self.algorithm, RoundsAlgorithm):
            self.algorithm.batch_sizes(self.hp.batch_size)  # refuses a group batch below the group's ranks
        self.num_samples = len(train_set)
        self.sampler = GlobalSampler(self.num_samples, config.seed, topology.data.rank, topology.data.size)
        self.prefetcher = BatchPrefetcher(train_set, self.sampler, device, self.layout.dtype, channels_last)
        group_sampler = GlobalSampler(self.num_samples, config.seed, 0, 1)
        self.group_prefetcher = BatchPrefetcher(train_set, group_sampler, device, self.layout.dtype, channels_last)
        """Batches of this rank's slices of its group's steps (asynchronous algorithms' rounds)."""
        self.round_samples = config.round_samples
        """Samples per round of an asynchronous algorithm (0: `ROUND_STEPS` global steps')."""
        self.local_steps = 0
        """Local steps this rank took in the run's session."""
        self.state = TrainState(next_eval=config.eval_every)
        self.losses = torch.zeros((), dtype=torch.float64, device=device)
        """Training losses summed on the device since the last `settle`, so that no step waits to read one."""
        process.seed_everything(config.seed, topology.world.rank)

    def _build_algorithm(self, name: str) -> Algorithm:
        algorithm = ALGORITHMS[name]
        transport = build_transport(algorithm.transport_kind, self.topology.data, self.config, self.topology.group)
        built = algorithm(self.hp, transport, self.central, self.learners)
        if self.optimizer_fn is not None:
            owner = self.central if built.learners_share_z else self.learners  # z's optimizer, or each learner's
            owner.use_optimizer(self.optimizer_fn)
        elif self.config.fused_step and not self.config.clip_grad_norm:
            fuse(built, self.central.z.device)
        return built

    def set_explicit_momentum(self) -> None:
        """Give Omnivore the explicit momentum of its compute groups (unless `--explicit-momentum` or the search
        sets it)."""
        config = self.config
        if isinstance(self.algorithm, Omnivore) and config.groups != "auto" and not config.explicit_momentum:
            self.hp.momentum = explicit_momentum(config.momentum, self.algorithm.transport.groups)

    @property
    def choice(self) -> dict:
        """The algorithm this run trains with, and its compute groups (1 but with Omnivore)."""
        return {"algorithm": self.algorithm.name, "groups": getattr(self.algorithm.transport, "groups", 1)}

    def switch_algorithm(self, name: str, groups: int = 1) -> None:
        """Train with algorithm `name` (Omnivore with `groups` compute groups) from now on, on the same central model
        and learners (collective; settle and drain first). The old algorithm's transport stops its threads and frees
        the communicators it made; the new one's is built. Load a snapshot next: one of another algorithm starts
        the momenta at zero (see `load_state_dict`)."""
        assert groups == 1 or name == "omnivore", (name, groups)
        if name != self.algorithm.name:
            self.engine.synchronize()
            self.algorithm.transport.close()
            self.algorithm = self._build_algorithm(name)
        if name == "omnivore":
            assert isinstance(self.algorithm.transport, ModelServer)
            self.algorithm.transport.regroup(groups)

    @property
    def epoch_progress(self) -> float:
        return self.state.epoch_progress(self.num_samples)

    def step_fits(self) -> bool:
        """Tell whether the next global step fits in the current epoch."""
        sizes = self.hp.batch_size
        if isinstance(self.algorithm, RoundsAlgorithm):
            sizes = self.algorithm.batch_sizes(sizes)  # Omnivore's group batch, split over the group's ranks
        return self.sampler.fits(self.state.offset, self.learners.k, sizes)

    def train_step(self, lr: float) -> Step:
        """Take one global step: batches → gradients → each learner's local update → sync. An asynchronous
        algorithm takes a round instead: steps at this rank's own pace on the positions its transport hands out,
        until the round's samples are taken."""
        if self.algorithm.rounds:
            return self._train_round(lr)
        started = time.perf_counter()
        state, k, batch_sizes = self.state, self.learners.k, self.sampler.batch_sizes(self.hp.batch_size)
        samples = self.sampler.step_size(k, batch_sizes)
        losses, compute_s = self._local_step(self.prefetcher, state.offset, batch_sizes, lr, ahead=samples)
        state.advance(samples)
        self.losses += losses.sum()
        state.loss_count += k
        return Step(samples, losses, time.perf_counter() - started, compute_s)

    def _train_round(self, lr: float) -> Step:
        started, algorithm = time.perf_counter(), self.algorithm
        assert isinstance(algorithm, RoundsAlgorithm)
        state, k, batch_sizes = self.state, self.learners.k, algorithm.batch_sizes(self.hp.batch_size)
        size = self.round_samples or ROUND_STEPS * self.sampler.step_size(k, batch_sizes)
        left = math.ceil((self.config.epochs - self.epoch_progress) * self.num_samples)  # --epochs bounds a round too
        end = state.offset + max(1, min(size, left))
        position = algorithm.begin_round(state.offset, end, self.num_samples, k, batch_sizes)
        group_sizes = algorithm.group_batch_sizes(batch_sizes)
        group, sampler = algorithm.transport.group, self.group_prefetcher.sampler
        sampler.rank, sampler.world_size = group.rank, group.size  # the groups may have changed since the last round
        losses, updates, compute_s = torch.zeros_like(self.losses).expand(k).clone(), 0, 0.0
        while position is not None:
            step_losses, step_compute_s = self._local_step(self.group_prefetcher, position, group_sizes, lr)
            losses += step_losses
            compute_s += step_compute_s
            updates += 1
            ulfm.inject_kill(state.iteration, updates)
            position = algorithm.next_position
        samples = algorithm.end_round() - state.offset
        state.advance(samples)
        self.losses += losses.sum()
        state.loss_count += k * updates
        return Step(samples, losses / max(updates, 1), time.perf_counter() - started, compute_s, updates)

    def _local_step(
        self, prefetcher: BatchPrefetcher, position: int, batch_sizes: tuple[int, ...], lr: float, ahead: int = 0
    ) -> tuple[torch.Tensor, float]:
        """Train this rank's learners on the step at `position` of the epoch, in the scope whose batch sizes these
        are; prefetch the step `ahead` samples on. Return the learners' losses and the seconds before the sync."""
        started, epoch, k = time.perf_counter(), self.state.epoch, self.learners.k
        with self.engine.stepping(k):
            losses = self.engine.compute_gradients(self.learners, prefetcher.batches(epoch, position, k, batch_sizes))
            if ahead:
                prefetcher.prefetch(epoch, position + ahead, k, batch_sizes)
            if self.imbalance is not None:
                world = self.topology.world
                index = self.local_steps if self.algorithm.rounds else self.state.iteration
                time.sleep(self.imbalance.delay(index, world.rank, world.size, time.perf_counter() - started))
            computed = time.perf_counter()
            self.algorithm.weigh(batch_sizes, prefetcher.sampler.rank)
            self.engine.local_step(self.algorithm, lr)
            self.engine.sync(self.algorithm, lr)
            self.learners.share_extra_state()
        self.local_steps += 1
        return losses, computed - started

    def settle(self) -> None:
        """Order what follows after the queued device work, collect the summed losses into the state and bring every
        rank to one central model (collective: the loop settles where the whole world meets)."""
        self.engine.synchronize()
        self.algorithm.meet()
        self.state.loss_sum += float(self.losses)
        self.losses.zero_()

    def resize(self, k: int) -> None:
        """Change the number of learners on this rank (new ones start from z with zero momentum)."""
        self.engine.synchronize()
        self.learners.resize(k, self.central.z)

    def memory_bytes(self) -> dict:
        """Return this rank's bytes by part (crossbow_mpi.replicas.footprint)."""
        concurrent = self.learners.k if self.engine.runs_learners_at_once else 1
        held = max(p.held_bytes for p in (self.prefetcher, self.group_prefetcher))
        return footprint(self.central, self.learners, self.algorithm, self.engine.activations.bytes, concurrent, held)

    def learner_bytes(self) -> int:
        """Return what one more learner costs this rank, measured (its activations once a step has run)."""
        return bytes_per_learner(self.learners, self.engine.activations.bytes)

    def state_dict(self, physical: bool = False) -> dict:
        """Return a snapshot of this rank's whole training state (settle and drain first); `physical`: the flat
        vectors themselves, as they are stored (`CentralModel.state_dict`, `Learners.state_dict`), for a copy to
        restore in this process (`detached_snapshot`)."""
        state = {
            "train": self.state.to_dict(),
            "hyperparams": self.hp.to_dict(),
            "central": self.central.state_dict(physical),
            "learners": self.learners.state_dict(physical),
            "algorithm": self.algorithm.state_dict(),
            "wire": self.algorithm.feedback.state_dict(),
            "choice": self.choice,
            "rng": process.rng_state(),
        }
        return {**state, "physical": self.layout.order} if physical else state

    def snapshot(self, physical: bool = False) -> dict:
        """Return `state_dict(physical)`, the same z on every rank: an asynchronous algorithm's ranks settle first
        (collective for them; the others' z is the same after every step); with eager-SGD's partial allreduce also
        this rank's gradients that no round carried yet (`unlanded`)."""
        if self.algorithm.rounds:
            self.settle()
        state = self.state_dict(physical)
        if isinstance(self.algorithm.transport, PartialAllreduce):
            state["unlanded"] = self.algorithm.transport.unlanded()
        return state

    def detached_snapshot(self, into: dict | None = None) -> dict:
        """Return a copy of `snapshot(physical=True)` sharing no tensor or list with the live run (what a rollback
        keeps), its tensors copied into those of `into` (a snapshot no longer needed) where they fit."""
        return ulfm.copy_state(self.snapshot(physical=True), into)

    def load_state_dict(self, snapshot: dict, learners: int | None = None) -> None:
        """Restore a snapshot, resharding the learners to `learners` per rank (default: the snapshot's).

        A snapshot without learners (a rank the checkpoint did not hold) starts every learner from z with zero
        momentum and keeps the RNGs seeded from the seed and this rank. A snapshot of another algorithm (its
        `choice`) gives z only: every learner starts from z, the momenta at zero, the algorithm's own state afresh."""
        self.engine.synchronize()
        self.state = TrainState.from_dict(snapshot["train"])
        hyperparams = dict(snapshot["hyperparams"])
        sizes = hyperparams["batch_size"]
        if isinstance(sizes, (list, tuple)) and len(sizes) != self.topology.data.size:
            del hyperparams["batch_size"]  # one per rank of another number of ranks: keep this run's
        self.hp.update(**hyperparams)
        physical = bool(snapshot.get("physical"))
        if physical and snapshot["physical"] != self.layout.order:
            raise ValueError(f"a copy of {snapshot['physical']} flat buffers restores only into the same layout")
        self.central.load_state_dict(snapshot["central"], physical)
        same = (snapshot.get("choice") or self.choice)["algorithm"] == self.algorithm.name
        if not same:
            self.central.u.zero_()
        self.algorithm.load_state_dict(snapshot["algorithm"] if same else {})
        self.algorithm.feedback.load_state_dict(snapshot.get("wire") or {} if same else {})
        rows = snapshot["learners"] if same else None
        self.learners.resize(learners or snapshot.get("k") or len(snapshot["learners"]["weights"]), self.central.z)
        self.learners.load_state_dict(rows, self.central.z, physical)
        if snapshot["rng"] is not None:
            process.load_rng_state(snapshot["rng"])
        if "unlanded" in snapshot:
            assert isinstance(self.algorithm.transport, PartialAllreduce)
            self.algorithm.transport.restore(snapshot["unlanded"])
