"""The training loop's state and its run-time hyper-parameters, with explicit serialisation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar


class _Serialised:
    """Dataclasses that are written to checkpoints field by field and read back refusing unknown fields."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    RENAMED: ClassVar[dict[str, str]] = {}
    """Old field name → new, for checkpoints written before a rename."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict):
        values = {cls.RENAMED.get(name, name): value for name, value in values.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
        return cls(**values)


@dataclass
class TrainState(_Serialised):
    """Where a run is: its data position, counters, timers and the evaluation window."""

    RENAMED: ClassVar[dict[str, str]] = {"time_to_accuracy_s": "time_to_target_s"}

    epoch: int = 0
    """Epochs completed."""
    offset: int = 0
    """Samples of the current epoch's permutation already trained on (by every rank together)."""
    iteration: int = 0
    """Global steps taken."""
    samples: int = 0
    """Samples trained on since the start, by every rank together."""
    drops: int = 0
    """Learning-rate drops passed."""
    next_eval: int = 0
    """Sample count at which the next evaluation is due (with `eval_every` > 0)."""
    elapsed_s: float = 0.0
    """Training seconds before the current session (a resumed run adds its own)."""
    optimizer_s: float = 0.0
    """Training seconds spent in the optimizer's searches (`--groups auto`, `--algorithm auto`)."""
    loss_sum: float = 0.0
    """This rank's training losses summed since the last evaluation (a checkpoint holds every rank's on rank 0)."""
    loss_count: int = 0
    """How many losses `loss_sum` adds up."""
    time_to_target_s: float | None = None
    """Training seconds until a target (accuracy or loss) was first reached."""
    last_eval: int | None = None
    """Iteration of the last evaluation."""
    first_train_loss: float | None = None
    """The first positive training loss of an evaluation: a reference of the divergence check."""
    start_loss: float | None = None
    """This rank's mean positive loss at the run's first step, before any update: the divergence check's other
    reference, for a loss that explodes before the first evaluation."""

    def epoch_progress(self, num_samples: int) -> float:
        """Return the fractional epoch."""
        return self.epoch + self.offset / num_samples

    def next_epoch(self) -> None:
        self.epoch, self.offset = self.epoch + 1, 0

    def advance(self, samples: int) -> None:
        """Count one global step of `samples` samples."""
        self.offset += samples
        self.samples += samples
        self.iteration += 1


@dataclass
class HyperParams(_Serialised):
    """The hyper-parameters an algorithm reads at every step; a controller may change them during a run."""

    lr: float
    """Base learning rate η (the schedule's warm-up and drops scale it)."""
    momentum: float
    """Momentum μ of each learner (SMA) or of the central model (S-SGD, eager)."""
    weight_decay: float
    """L2 coefficient λ."""
    alpha: float
    """SMA: fraction of each learner's difference to z moved per sync."""
    central_momentum: float
    """SMA: momentum μ_z of the central model's updates (see `central_momentum_always`)."""
    merge_momentum: float
    """elastic with `local_momentum`: momentum μ_z of the central model's step to each round's merged model."""
    batch_size: int | tuple[int, ...]
    """Samples per learner per step: one for every rank of the data scope, or one per rank."""
    central_momentum_always: bool = False
    """SMA: apply μ_z also when the learners' μ is 0 (CROSSBOW applies it only with learner momentum)."""
    sync_every: int = 1
    """SMA: local steps H between syncs."""
    sync_every_node: int = 0
    """SMA with `hierarchy` node: local steps between averagings within the node (0: none)."""
    outer_optimizer: str = "central"
    """SMA: what a sync does to z: `central` (SMA's step), `nesterov` or `sgd` (on the pseudo-gradient)."""
    outer_lr: float = 0.7
    """SMA: the outer optimizer's step size."""
    outer_momentum: float = 0.9
    """SMA: the outer optimizer's momentum."""
    fragments: int = 1
    """SMA with an outer optimizer: runs of parameter tensors synced in turn, each every `sync_every` steps."""
    sync_delay: int = 0
    """SMA with an outer optimizer: steps a sync's reduction overlaps the compute before it applies."""
    sync_dtype: str = "fp32"
    """SMA: the sync message's type on the wire (`fp32`, `bf16`, `fp16`); sums are taken in float32."""
    clip_grad_norm: float = 0.0
    """Largest L2 norm of a gradient an update takes (0: no clipping)."""
    local_momentum: bool = False
    """elastic: μ in the local steps and `merge_momentum` at the merge (default: μ at the merge, as HeteroGPU)."""
    batch_scaled_lr: bool = False
    """hogbatch: scale each rank's updates by b_i/B (HeteroGPU's step η·b_i/B)."""
    base_batch: float = 0.0
    """elastic, and hogbatch with `batch_scaled_lr`: base batch B of the step size η·b_i/B; 0: the mean of
    `batch_size` at the start."""
    merge_l2: bool = False
    """elastic: HeteroGPU's adaptive normalisation of the merge weights."""

    @classmethod
    def from_config(cls, config) -> HyperParams:
        hp = cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})
        if not hp.base_batch:
            sizes = hp.batch_size if isinstance(hp.batch_size, tuple) else (hp.batch_size,)
            hp.base_batch = sum(sizes) / len(sizes)
        return hp

    def update(self, **changes) -> dict:
        """Change some values; return {name: [old, new]} for those that changed."""
        changed = {}
        for name, value in changes.items():
            value = tuple(value) if isinstance(value, list) else value  # a per-rank value read back from JSON
            old = getattr(self, name)
            if old != value:
                changed[name] = [old, value]
                setattr(self, name, value)
        return changed
