"""Training configuration: one dataclass, filled from defaults, an optional TOML file and flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEVICES = ("auto", "cpu", "cuda", "mixed")
ENGINES = ("auto", "sequential", "threads", "streams")
COMMS = ("auto", "mpi", "nccl")
HIERARCHIES = ("auto", "flat", "node")
PRECISIONS = ("fp32", "bf16")
MEMORY_FORMATS = ("contiguous", "channels_last", "auto")
EAGER_MODES = ("solo", "majority")
SCHEDULES = ("gpipe", "1f1b")
CUTS = ("params", "time")
OUTER_OPTIMIZERS = ("central", "nesterov", "sgd")
SYNC_DTYPES = ("fp32", "bf16", "fp16", "int8")
OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "step", "cosine")
RANK_LOSS = ("abort", "continue")
RANK_LOSS_LR = ("keep", "linear")
SURVIVING_ALGORITHMS = ("sma", "ssgd", "eager", "elastic", "omnivore", "hogbatch")
"""The algorithms that `--on-rank-loss continue` applies to: the same z on every rank after every step (an allreduce,
eager-SGD's rounds), or rounds of the model server's that end where every rank meets."""
FUSED_ALGORITHMS = ("sma", "ssgd", "auto")
"""The algorithms `--fused-step` applies to (auto: when it trains with sma or ssgd)."""
SEED_LIMIT = 2**32
FLOAT32_MAX = 3.4028234663852886e38
"""The hyper-parameters compute in float32: a larger value overflows to infinity at the first step."""
POSITIVE = (
    "batch_size",
    "epochs",
    "keep_checkpoints",
    "autotune_interval",
    "max_learners",
    "eager_sync_every",
    "pipeline_stages",
    "micro_batches",
    "probe_seconds",
    "adapt_every",
    "batch_min",
    "batch_max",
    "batch_step",
    "sync_every",
    "fragments",
    "seq_len",
    "min_ranks",
    "rollback_every",
)
"""Fields that must be positive (every per-rank value)."""
NON_NEGATIVE = (
    "lr",
    "momentum",
    "weight_decay",
    "alpha",
    "central_momentum",
    "merge_momentum",
    "lr_gamma",
    "warmup_epochs",
    "lr_decay",
    "base_batch",
    "eval_every",
    "threads",
    "checkpoint_every",
    "seed",
    "autotune_threshold",
    "max_memory",
    "collective_timeout",
    "round_samples",
    "optimizer_epoch",
    "outer_lr",
    "outer_momentum",
    "sync_every_node",
    "sync_delay",
    "clip_grad_norm",
    "warmup_steps",
)
"""Fields that must not be negative (every per-rank value)."""


class ConfigError(ValueError):
    """A user mistake in the configuration or its inputs; reported as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str):
        raise ConfigError(message)


@dataclass
class Config:
    """Everything that defines a run. Same config and seed give the same bits."""

    algorithm: str = "sma"
    """Training algorithm: `sma` (synchronous model averaging), `ssgd` (synchronous SGD), `eager` (eager-SGD),
    `omnivore` (compute groups, asynchronous across groups), `hogbatch` (every rank asynchronous, with its own
    batch size), `elastic` (local steps at each rank's pace, merged every round by update share) or `auto`: timed
    probes pick among `sma`, `ssgd`, `eager` (majority) and `omnivore` (successive halving) with their momentum,
    learning rate and groups before training, and again every `optimizer_epoch`
    (crossbow_mpi.control.omnivore_search). `auto` needs a fixed number of `--learners` (the sma probes use it)
    and no `--pipeline-stages`."""
    model: str = "lenet"
    """Model name from the registry (`lenet`, `mlp`, `resnet32`; `attention` for `synthetic-sequences`; `tinygpt`: a
    small GPT for `--dataset text`)."""
    model_args: str = ""
    """The model's size as `key=value` pairs (`layers=4,heads=4,width=128,dropout=0.1` for `tinygpt`;
    `width=32,heads=4` for `attention`); empty: its defaults."""
    dataset: str = "mnist"
    """Dataset name (`mnist`, `cifar10`, `synthetic-mnist`, `synthetic-cifar`, `synthetic-sequences`, `text`: byte
    windows of a corpus made by `python -m crossbow_mpi.data.prepare text DIR`)."""
    seq_len: int = 64
    """`--dataset text`: bytes per window (a sample is a window and its next-byte labels)."""
    data_dir: str = "datasets/mnist"
    """Directory with the dataset files (ignored by synthetic datasets)."""
    learners: int | str = 2
    """Model replicas (learners) per rank, each with its own batches and momentum; `auto`: tune by throughput."""
    batch_size: int | tuple[int, ...] = 16
    """Samples per learner per iteration: one value for every rank, or one per rank (`64,64,8,8`)."""
    adaptive_batch: bool = False
    """Adapt each rank's batch size to its speed every `adapt_every` steps, by `batch_step` within [`batch_min`,
    `batch_max`]: so that the ranks' steps take equal time, or with `hogbatch` and `elastic`, that they make equal
    numbers of updates."""
    adapt_every: int = 1
    """With `adaptive_batch`: iterations per measurement window (steps; rounds for `hogbatch`, `elastic`); 1, as
    HeteroGPU adapts at every merge."""
    batch_min: int = 1
    """With `adaptive_batch`: smallest batch size per learner."""
    batch_max: int = 1024
    """With `adaptive_batch`: largest batch size per learner."""
    batch_step: int = 32
    """With `adaptive_batch`: change of a rank's batch size per window (32, HeteroGPU's)."""
    adapt_hold: bool = False
    """With `adaptive_batch`: of the moves by `batch_step`, its half, quarter, … 1, make the one predicted to balance
    the ranks best (from each rank's measured rate), and none if none improves on the measured balance; HeteroGPU
    moves by `batch_step` at every window, which swings when it is large against the batch."""
    engine: str = "auto"
    """How a rank's learners share its device: `sequential`, `threads` (concurrently on CPU cores), `streams`
    (one CUDA stream each), `auto` (streams on a GPU, threads on a CPU rank with several threads)."""
    autotune_threshold: float = 0.1
    """With `--learners auto`: relative throughput gain that justifies one more learner per rank."""
    autotune_interval: int = 50
    """With `--learners auto`: iterations per throughput measurement."""
    max_learners: int = 8
    """With `--learners auto`: most learners per rank."""
    max_memory: float = 0.0
    """With `--learners auto` on CPU: memory cap in GiB per node (0: 80 % of RAM); on GPU free memory is the cap."""
    autotune_on_lr_drop: bool = False
    """With `--learners auto`: tune again, from one learner, after every learning-rate drop."""
    lr: float = 0.01
    """Learning rate η; not scaled with the number of learners."""
    momentum: float = 0.9
    """Momentum μ of each learner (SMA) or of the central model (S-SGD). `omnivore` and `hogbatch`: the total
    momentum; asynchrony over G groups adds about 1 − 1/G of its own, so the explicit momentum applied is
    max(0, μ − (1 − 1/G)) (Omnivore, arXiv 1606.04487), unless `explicit_momentum`."""
    explicit_momentum: bool = False
    """`omnivore` and `hogbatch`: apply `momentum` as given, on top of the asynchrony's implicit momentum."""
    weight_decay: float = 0.0005
    """With `sgd`: L2 coefficient λ added to every gradient; with `adamw`: AdamW's decoupled weight decay."""
    optimizer: str = "sgd"
    """What steps the weights (crossbow_mpi.replicas.optimizers): `sgd` (each algorithm's momentum SGD equations) or
    `adamw` (torch.optim.AdamW: z's for S-SGD and eager, each learner's local step for SMA and elastic, the
    server's step of z for Omnivore and hogbatch)."""
    beta1: float = 0.9
    """With `adamw`: decay of the gradient's running mean, in [0, 1)."""
    beta2: float = 0.999
    """With `adamw`: decay of the squared gradient's running mean, in [0, 1)."""
    eps: float = 1e-8
    """With `adamw`: term added to the denominator, positive."""
    clip_grad_norm: float = 0.0
    """Scale a gradient whose L2 norm exceeds this down to it (0: no clipping): S-SGD and eager the averaged
    gradient of every rank (after the allreduce), SMA and elastic each learner's own, Omnivore and hogbatch each
    group's averaged gradient before the server applies it."""
    alpha: float = 0.1
    """SMA: fraction α of each learner's difference to the central model moved per sync."""
    central_momentum: float = 0.9
    """SMA: momentum μ_z of the central model's updates; applied only while the learners' `momentum` is above 0,
    as CROSSBOW's released code does (`synch/sma.c`), unless `central_momentum_always`."""
    central_momentum_always: bool = False
    """SMA: apply `central_momentum` also when the learners' `momentum` is 0 (CROSSBOW applies it only with learner
    momentum)."""
    sync_every: int = 1
    """SMA: local steps H between syncs (1: every step, CROSSBOW's SMA). Between syncs every learner takes plain
    momentum-SGD steps and nothing crosses the network."""
    sync_every_node: int = 0
    """SMA with `--hierarchy node`: between the syncs, the learners of each node average their parameters every
    this many steps over the node's fast links (0: never); the syncs across nodes stay every `sync_every` steps."""
    outer_optimizer: str = "central"
    """SMA (and `elastic`'s merge): what a sync does to z. `central`: SMA's correction and central momentum step,
    applied at the sync steps only (EASGD's communication period; elastic: its merge step); `nesterov` or `sgd`:
    torch.optim.SGD's step (with Nesterov momentum or without) of z on the pseudo-gradient z − mean(w) over every
    learner, then every learner restarts from z (DiLoCo, as torchft's local_sgd.py)."""
    outer_lr: float = 0.7
    """SMA and elastic with `outer_optimizer` nesterov or sgd: the outer step size (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """SMA and elastic with `outer_optimizer` nesterov or sgd: the outer momentum (DiLoCo's 0.9; 0: none)."""
    fragments: int = 1
    """SMA with `outer_optimizer` nesterov or sgd: cut the parameters into this many runs of whole tensors and sync
    one run at a time, round-robin, every `sync_every` / `fragments` steps, so that each run syncs every
    `sync_every` steps and a sync sends about 1/`fragments` of the model (Streaming DiLoCo)."""
    sync_delay: int = 0
    """SMA with `outer_optimizer` nesterov or sgd, over a flat MPI transport: each sync's reduction runs
    non-blocking, overlapped with this many steps of compute, and applies after them (below `sync_every` /
    `fragments`; 0: blocking). The learners' progress on the synced columns in those steps is replaced by z's."""
    sync_dtype: str = "fp32"
    """SMA and `elastic`: the sync message's type on the wire, `fp32`, `bf16` or `fp16` (MPI transports): each
    rank's payload is cast for the wire and the sums are taken in float32. SMA also `int8` (flat MPI, no
    fragments): the parameters' part in blocks of 256 int8 values with a float32 scale each, every rank adding the
    residual of its previous cast to its next payload (error feedback; crossbow_mpi.comm.int8)."""
    merge_momentum: float = 0.0
    """elastic with `local_momentum`: momentum μ_z of the central model's step to each round's merged model (0: z
    becomes the merged model). Without `local_momentum` the merge takes `momentum`."""
    local_momentum: bool = False
    """elastic: take `momentum` in the local steps and `merge_momentum` at the merge; default: plain local SGD
    steps and `momentum` at the merge, as HeteroGPU."""
    batch_scaled_lr: bool = False
    """hogbatch: scale each rank's updates by b_i/B, its batch size over `base_batch` (HeteroGPU's step η·b_i/B,
    which it pairs with the adaptive batch sizes); default: one step size for every rank, as CPU+GPU Hogbatch."""
    base_batch: float = 0.0
    """elastic, and hogbatch with `batch_scaled_lr`: base batch B of the step size η·b_i/B (HeteroGPU's linear
    scaling); 0: the mean of `batch_size` at the start."""
    merge_l2: bool = False
    """elastic: HeteroGPU's adaptive normalisation: the merge weight of the rank with the most updates times 1.1,
    of the one with the fewest times 0.9 (not renormalised, as the artifact)."""
    eager_mode: str = "solo"
    """eager-SGD: `solo` (any rank's arrival fires a round) or `majority` (a seeded initiator's arrival does)."""
    eager_sync_every: int = 32
    """eager-SGD: run a fully synchronous round at least every this many rounds (bounds staleness)."""
    groups: int | str = 1
    """Omnivore: compute groups of P/G consecutive ranks each (G must divide the ranks P); a group steps
    synchronously, the groups update the central model asynchronously; an int `batch_size` is a group step's
    batch, split over the group's ranks. 1: S-SGD; P: fully asynchronous. `auto`:
    Omnivore's optimizer picks the groups, momentum and learning rate from timed probes before training."""
    probe_seconds: float = 30.0
    """With `--groups auto` or `--algorithm auto`: seconds of training per optimizer probe."""
    optimizer_epoch: float = 1500.0
    """With `--groups auto` or `--algorithm auto`: seconds of training between the optimizer's searches around the
    current groups, momentum and learning rate, and among the algorithms (0: search only before training). The
    default keeps a re-tune (5 probes of 30 s) at about 10 % of the training, as the artifact's 5 × 200 s per
    10,000 s do."""
    round_samples: int = 0
    """`omnivore`, `hogbatch`, `elastic` (its merge interval): samples per round. Within a round every rank steps
    at its own pace on the batches handed out to it; the ranks meet between rounds, where stop signals,
    evaluations and checkpoints take effect (an iteration is one round). 0: 32 global steps' samples."""
    lr_schedule: str = "step"
    """Learning-rate schedule after warm-up: `step` (drops by `lr_gamma` at `lr_steps`; none: constant), `constant`,
    or `cosine` (from `lr` to 0 over `epochs`)."""
    warmup_steps: int = 0
    """Iterations of linear learning-rate warm-up from lr/warmup_steps to lr (an iteration is a round for the
    asynchronous algorithms); not with `warmup_epochs`."""
    lr_steps: tuple[float, ...] = ()
    """With `lr_schedule` step: epochs at which the learning rate is multiplied by `lr_gamma` (SMA resets learners to
    z there)."""
    lr_gamma: float = 0.1
    """Factor applied to the learning rate at each of `lr_steps`."""
    warmup_epochs: float = 0.0
    """Epochs of linear learning-rate warm-up from `warmup_start`·lr to lr; adaptive batch sizes stay fixed
    during it, as in HeteroGPU."""
    warmup_start: float = 0.1
    """Fraction of lr at the start of the warm-up (HeteroGPU: 0.01)."""
    lr_decay: float = 0.0
    """Time-based decay after the warm-up: lr·1/(1 + lr_decay·(epoch − warmup_epochs)) (HeteroGPU's)."""
    epochs: float = 10.0
    """Upper bound on training epochs."""
    target_accuracy: float = 0.99
    """Stop at the first evaluation of z that reaches this test accuracy (0 or less: never stop early)."""
    target_loss: float | None = None
    """Stop at the first evaluation of z whose test loss is at or below this (unset: no loss target); with
    `target_accuracy` too, whichever is reached first."""
    eval_every: int = 15000
    """Evaluate z every this many training samples (all ranks together); 0: once per epoch."""
    time_limit: float = 0.0
    """Stop at the first evaluation after this many seconds of training, as rank 0's clock reads (0: no limit); the
    run ends as at its epoch limit, with a checkpoint and a summary that says `time_limited`."""
    divergence_factor: float = 1000.0
    """Stop as diverged (exit 3, the last checkpoint kept) at the first evaluation whose training or test loss is
    finite and above this many times the first training loss: the lower of the first step's (before any update) and
    the first evaluation's; 0: only a NaN or infinite central model or training loss counts."""
    inject_imbalance: str = ""
    """Injected stragglers for tests and benchmarks: `random:MS[:N]` or `slow-rank:R:FACTOR` (empty: none)."""
    collective_timeout: float = 300.0
    """Abort the job, naming the ranks that did not arrive, when training makes no progress for this many
    seconds because a rank stopped taking part (0: never); noticed up to a twentieth of it (at most 5 s) later."""
    on_rank_loss: str = "abort"
    """When a rank dies (a killed process): `abort` the job, or `continue` on the survivors (every `--algorithm`
    but `auto`; launch with `mpirun --with-ft ulfm`, see docs/failures.md): the survivors go
    back to the newest copy of the state that all of them hold (`rollback_every`), drop the steps taken since (an
    asynchronous algorithm's round in flight) and train them again, and a checkpoint is written."""
    rollback_every: int = 8
    """With `on_rank_loss continue`: copy the state before every this many steps (and before the first step after
    a start, a recovery, an evaluation or a checkpoint), keeping the last two copies. A loss rolls the survivors
    back to the newest copy all of them hold: they drop up to this many steps and train them again. 1: a copy
    before every step, only the step in flight dropped. An asynchronous algorithm keeps one every round."""
    min_ranks: int = 1
    """With `on_rank_loss continue`: when fewer ranks survive, write a checkpoint and exit 75 (resume reshards)."""
    rank_loss_lr: str = "keep"
    """With `on_rank_loss continue`: the learning rate after going from P to P' ranks, whose aggregate batch is
    P'/P of the old one: `keep` it, or scale it by P'/P (`linear`, Goyal et al. 2017's linear scaling rule)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda`, or one of these per rank (`cuda,cpu,cpu`); `mixed`:
    the node's first ranks on its GPUs, one each, the rest on CPU cores. A rank's GPU is chosen by its local rank."""
    comm: str = "auto"
    """Transport of the allreduce: `nccl` (CuPy, one GPU per rank), `mpi` (mpi4py, host staging for GPUs), or
    `auto` (NCCL when every rank has its own GPU and CuPy is present, else MPI)."""
    hierarchy: str = "auto"
    """How the sync's sum spans nodes: `node` (sum within each node, then among one leader per node, then copy
    back within the node; over MPI), `flat` (one allreduce over all ranks), `auto` (`node` when the ranks span
    several nodes and MPI is the transport)."""
    memory_format: str = "contiguous"
    """Layout of 4-D tensors (convolution weights, image batches) in the flat buffers: `contiguous` (NCHW),
    `channels_last`, or `auto` (channels-last where one learner's pass measures faster at start; the summary
    records the choice). Checkpoints and exports hold contiguous tensors, so a run resumes under either."""
    precision: str = "fp32"
    """Learners' compute precision: `fp32`, or `bf16` autocast on the rank's device, CPU or GPU (z, u, corrections
    and optimizer state stay float32)."""
    compile: bool = False
    """torch.compile each learner's forward and backward pass (needs a C++ compiler); the first step compiles,
    and its seconds are the summary's `compile_s`."""
    fused_step: bool = False
    """SMA and S-SGD (and auto, when it trains with one of them): run the learners' and the central updates each as
    one fused pass over memory (torch.compile's code on a CPU with a C++ compiler, CuPy kernels on CUDA), with the
    default step's bits; the first step compiles them."""
    threads: int | tuple[int, ...] = 0
    """Intra-op threads per rank, one value or one per rank; 0: the CPUs the rank is bound to, shared with the
    node's ranks bound to them."""
    pipeline_stages: int = 1
    """Split each learner's model into this many stages on consecutive ranks (pipeline parallelism); the ranks
    divided by the stages are the pipelines, which run data-parallel."""
    micro_batches: int = 1
    """With `pipeline_stages`: micro-batches each learner's batch is cut into."""
    schedule: str = "gpipe"
    """With `pipeline_stages`: `gpipe` (every forward pass, then every backward pass) or `1f1b` (one forward, one
    backward: fewer activations held)."""
    cut: str = "params"
    """With `pipeline_stages`: balance the stages by trainable parameter count (`params`: the same cut every run)
    or by forward+backward time measured on rank 0 at the start (`time`); a resume takes its checkpoint's cut."""
    seed: int = 1
    """Seed of every random generator (combined with the rank where ranks must differ), below 2**32."""
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, config.json and checkpoints."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many iterations (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep in the run directory."""
    resume: bool = False
    """Continue from the newest valid checkpoint in `run_dir`, with the run's hyper-parameters (a resume that sets
    one otherwise is refused)."""
    tensorboard: bool = False
    """Also write the evaluation records as TensorBoard scalars to `run_dir`/tensorboard (needs the `tensorboard`
    package); metrics.jsonl stays the complete record."""

    def validate(self, algorithms) -> None:
        """Raise ConfigError naming the first invalid field; `algorithms` are the known algorithm names.
        (`inject_imbalance` is parsed where the job's size is known.)"""
        self._validate_types()
        self._validate_choices(algorithms)
        self._validate_learners()
        self._validate_groups()
        self._validate_signs()
        self._validate_batches()
        self._validate_training()
        self._validate_sync()
        self._validate_recipe()

    def _validate_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _has_type(value, str(f.type)):
                raise ConfigError(f"--{_flag(f.name)}: invalid value {value!r} (expected {f.type})")
            if f.type not in ("float", "float | None") or value is None:
                continue
            if not math.isfinite(value):
                raise ConfigError(f"--{_flag(f.name)} must be a finite number, got {value}")
            if abs(value) > FLOAT32_MAX:
                raise ConfigError(
                    f"--{_flag(f.name)} must be at most {FLOAT32_MAX:.4g} (float32's largest), got {value}"
                )

    def _validate_choices(self, algorithms) -> None:
        from crossbow_mpi.data import dataset_names
        from crossbow_mpi.models import model_names

        choices = {
            "algorithm": (*algorithms, "auto"),
            "engine": ENGINES,
            "comm": COMMS,
            "hierarchy": HIERARCHIES,
            "precision": PRECISIONS,
            "outer_optimizer": OUTER_OPTIMIZERS,
            "sync_dtype": SYNC_DTYPES,
            "memory_format": MEMORY_FORMATS,
            "model": tuple(model_names()),
            "dataset": tuple(dataset_names()),
            "eager_mode": EAGER_MODES,
            "schedule": SCHEDULES,
            "cut": CUTS,
            "optimizer": OPTIMIZERS,
            "lr_schedule": LR_SCHEDULES,
            "on_rank_loss": RANK_LOSS,
            "rank_loss_lr": RANK_LOSS_LR,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"--{_flag(name)}: unknown value {getattr(self, name)!r} (choose from {', '.join(allowed)})"
                )
        for device in self.device.split(","):
            if device not in DEVICES or (device == "mixed" and "," in self.device):
                raise ConfigError(
                    f"--device: unknown value {device!r} (choose from {', '.join(DEVICES)}, or one of "
                    f"{', '.join(DEVICES[:3])} per rank)"
                )

    def _validate_learners(self) -> None:
        if self.learners != "auto" and not (isinstance(self.learners, int) and self.learners > 0):
            raise ConfigError(f"--learners must be a positive number or auto, got {self.learners!r}")
        if self.algorithm in ("eager", "auto") and self.learners == "auto":
            raise ConfigError(f"--algorithm {self.algorithm} needs a fixed number of --learners, not auto")
        if self.algorithm == "auto" and self.pipeline_stages > 1:
            raise ConfigError("--algorithm auto and --pipeline-stages cannot be combined: choose an algorithm")
        if self.algorithm in ("omnivore", "hogbatch", "elastic") and self.pipeline_stages > 1:
            raise ConfigError(
                f"--pipeline-stages applies to --algorithm sma, ssgd and eager, not {self.algorithm}: its ranks step "
                "at their own pace, and a pipeline's stages must step together"
            )

    def _validate_signs(self) -> None:
        for name in POSITIVE:
            if not min(values(getattr(self, name))) > 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in NON_NEGATIVE:
            if not min(values(getattr(self, name))) >= 0:
                raise ConfigError(f"--{_flag(name)} must not be negative, got {getattr(self, name)}")

    def _validate_batches(self) -> None:
        if self.batch_min > self.batch_max:
            raise ConfigError(f"--batch-min {self.batch_min} exceeds --batch-max {self.batch_max}")
        if self.pipeline_stages > 1 and (isinstance(self.batch_size, tuple) or self.adaptive_batch):
            raise ConfigError(
                "--pipeline-stages needs one --batch-size for every rank: no per-rank or adaptive batch sizes"
            )
        if self.micro_batches > min(values(self.batch_size)):
            raise ConfigError(f"--micro-batches {self.micro_batches} exceeds the --batch-size {self.batch_size}")
        if self.pipeline_stages > 1 and self.learners == "auto":
            raise ConfigError("--pipeline-stages needs a fixed number of --learners (pipelines per rank), not auto")

    def _validate_training(self) -> None:
        if self.time_limit < 0:
            raise ConfigError(f"--time-limit must be 0 (no limit) or positive seconds, got {self.time_limit}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.batch_scaled_lr and self.algorithm != "hogbatch":
            raise ConfigError(
                f"--batch-scaled-lr applies to --algorithm hogbatch, not {self.algorithm} (elastic always scales its "
                "step by b_i/B)"
            )
        if self.fused_step and self.algorithm not in FUSED_ALGORITHMS:
            raise ConfigError(f"--fused-step applies to --algorithm sma, ssgd or auto, not {self.algorithm}")
        if self.on_rank_loss == "continue" and self.algorithm not in SURVIVING_ALGORITHMS:
            raise ConfigError(
                f"--on-rank-loss continue applies to --algorithm {', '.join(SURVIVING_ALGORITHMS)}, not "
                f"{self.algorithm}: its search switches among them"
            )
        if self.on_rank_loss == "continue" and self.groups == "auto":
            raise ConfigError("--on-rank-loss continue needs a fixed --groups, not auto: the survivors regroup")
        if self.compile and self.pipeline_stages > 1:
            raise ConfigError("--compile does not apply to --pipeline-stages: compile the stages' modules yourself")
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(
                f"--target-accuracy must be a fraction in [0, 1] (0.99 for 99 %), got {self.target_accuracy}"
            )
        if self.target_loss is not None and not self.target_loss > 0:
            raise ConfigError(f"--target-loss must be positive, got {self.target_loss}")
        if not (self.divergence_factor == 0 or self.divergence_factor > 1):
            raise ConfigError(f"--divergence-factor must be 0 (off) or above 1, got {self.divergence_factor}")
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"--alpha must be in (0, 1], got {self.alpha}")
        if not max(self.momentum, self.central_momentum, self.merge_momentum) < 1:
            raise ConfigError("--momentum, --central-momentum and --merge-momentum must be below 1")
        if not 0 < self.warmup_start <= 1:
            raise ConfigError(f"--warmup-start must be in (0, 1], got {self.warmup_start}")
        if self.seed >= SEED_LIMIT:
            raise ConfigError(f"--seed must be below 2**32, got {self.seed}")
        if list(self.lr_steps) != sorted(self.lr_steps) or any(s <= 0 for s in self.lr_steps):
            raise ConfigError(f"--lr-steps must be increasing positive epochs, got {','.join(map(str, self.lr_steps))}")

    def _validate_sync(self) -> None:
        changed = [
            f"--{_flag(name)}"
            for name in ("sync_every", "sync_every_node", "outer_optimizer", "fragments", "sync_delay", "sync_dtype")
            if getattr(self, name) != getattr(Config, name)
        ]
        if changed and self.algorithm == "ssgd":
            raise ConfigError(
                f"{changed[0]} applies to --algorithm sma, not ssgd: S-SGD syncs gradients every step; use --algorithm "
                "sma --outer-optimizer nesterov (at --sync-every 1, --outer-lr 1, --outer-momentum 0 it is S-SGD)"
            )
        if self.algorithm == "elastic":
            changed = [flag for flag in changed if flag not in ("--outer-optimizer", "--sync-dtype")]
            if changed:
                raise ConfigError(
                    f"{changed[0]} applies to --algorithm sma; elastic syncs every --round-samples samples"
                )
        if changed and self.algorithm not in ("sma", "elastic"):
            raise ConfigError(f"{changed[0]} applies to --algorithm sma, not {self.algorithm}")
        if self.sync_dtype == "int8" and (self.algorithm != "sma" or self.fragments > 1):
            raise ConfigError("--sync-dtype int8 applies to --algorithm sma without --fragments (use bf16 there)")
        if self.fragments > 1 and self.outer_optimizer == "central":
            raise ConfigError("--fragments needs --outer-optimizer nesterov or sgd: `central` moves every parameter")
        if self.sync_every % self.fragments:
            raise ConfigError(
                f"--fragments {self.fragments} must divide --sync-every {self.sync_every}: one fragment syncs every "
                "H/F steps"
            )
        if self.sync_delay and self.sync_delay >= self.sync_every // self.fragments:
            raise ConfigError(
                f"--sync-delay {self.sync_delay} must be below --sync-every / --fragments "
                f"({self.sync_every // self.fragments}): a sync must land before the next one starts"
            )
        if self.sync_delay and self.on_rank_loss == "continue":
            raise ConfigError(
                "--sync-delay and --on-rank-loss continue cannot be combined: a lost rank needs blocking syncs"
            )
        if self.sync_delay and (self.outer_optimizer == "central" or self.sync_dtype != "fp32"):
            raise ConfigError("--sync-delay needs --outer-optimizer nesterov or sgd and --sync-dtype fp32")
        if self.sync_every_node and self.sync_every_node >= self.sync_every:
            raise ConfigError(
                f"--sync-every-node {self.sync_every_node} must be below --sync-every {self.sync_every}: the node "
                "averages between the syncs across nodes"
            )
        if self.sync_every_node and self.hierarchy == "flat":
            raise ConfigError("--sync-every-node needs --hierarchy node (or auto over several nodes)")
        if not self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be below 1, got {self.outer_momentum}")
        if not self.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be positive, got {self.outer_lr}")

    def _validate_recipe(self) -> None:
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"--beta1 and --beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")
        if not self.eps > 0:
            raise ConfigError(f"--eps must be positive, got {self.eps}")
        if self.lr_steps and self.lr_schedule != "step":
            raise ConfigError(f"--lr-steps applies to --lr-schedule step, not {self.lr_schedule}")
        if self.warmup_steps and self.warmup_epochs:
            raise ConfigError("--warmup-steps and --warmup-epochs cannot be combined: choose one")
        recipe = [f for f in ("optimizer", "clip_grad_norm") if getattr(self, f) not in ("sgd", 0.0)]
        if recipe:
            refuse_recipe(self, f"--{_flag(recipe[0])} {getattr(self, recipe[0])}")

    def _validate_groups(self) -> None:
        if self.groups == "auto" and self.learners == "auto":
            raise ConfigError("--groups auto and --learners auto cannot be combined: fix one of them")
        if self.groups != "auto" and not (isinstance(self.groups, int) and self.groups > 0):
            raise ConfigError(f"--groups must be a positive number, got {self.groups}")
        if self.groups != 1 and self.algorithm != "omnivore":
            raise ConfigError(f"--groups applies to --algorithm omnivore only, not {self.algorithm}")
        if self.algorithm in ("hogbatch", "elastic") and self.learners == "auto":
            raise ConfigError(
                f"--algorithm {self.algorithm} needs a fixed number of --learners: its ranks' speeds are balanced "
                "by --adaptive-batch, not by the learner tuner"
            )

    def to_json(self) -> str:
        """Return the configuration as JSON, with `resume` false: replayed in a new directory, it runs the same
        run from the start."""
        return json.dumps({**dataclasses.asdict(self), "resume": False}, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """Build a config from a mapping of field names (dashes or underscores); unknown keys are errors."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"unknown config key {key!r}")
            kwargs[name] = coerce(known[name], value)
        return cls(**kwargs)


def refuse_recipe(config: Config, what: str) -> None:
    """Raise ConfigError where `what` (an optimizer other than momentum SGD, or clipping) is not supported."""
    if "auto" in (config.algorithm, config.groups):
        raise ConfigError(f"{what} does not apply to --algorithm auto or --groups auto: their search tunes momentum")
    if config.learners == "auto":
        raise ConfigError(f"{what} needs a fixed number of --learners, not auto")
    if config.pipeline_stages > 1:
        raise ConfigError(f"{what} does not apply to --pipeline-stages")


def values(value) -> tuple:
    """Return a field's value as a tuple: its per-rank values, or the one value."""
    return value if isinstance(value, tuple) else (value,)


def per_rank(config: Config, name: str, size: int) -> tuple:
    """Return the field's value for each of `size` ranks: one value repeated, or its per-rank list; ConfigError
    when the list's length is not `size`."""
    value = getattr(config, name)
    listed = tuple(value.split(",")) if name == "device" else values(value)
    if len(listed) == 1:
        return listed * size
    if len(listed) != size:
        raise ConfigError(f"--{_flag(name)} lists {len(listed)} values, one per rank, but there are {size} ranks")
    return listed


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_type(value, kind: str) -> bool:
    """Tell whether a field's value has the field's declared type (a bool is not a number; an int is a float)."""
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "int | str":
        return _has_type(value, "int") or isinstance(value, str)
    if kind == "int | tuple[int, ...]":
        return all(_has_type(v, "int") for v in values(value)) and values(value) != ()
    if kind == "float":
        return _is_number(value)
    if kind == "float | None":
        return value is None or _has_type(value, "float")
    if kind == "str":
        return isinstance(value, str)
    assert kind.startswith("tuple[float"), f"unhandled field type {kind}"
    return isinstance(value, tuple) and all(_is_number(v) and math.isfinite(v) for v in value)


def coerce(f: dataclasses.Field, value):
    """Convert a TOML or command-line value to the field's type; ConfigError when it does not fit."""
    kind = f.type
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if not isinstance(value, str) or value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if kind == "int | tuple[int, ...]":
            items = value.split(",") if isinstance(value, str) else list(values(_tuple(value)))
            listed = tuple(coerce_int(v) for v in items)
            return listed[0] if len(listed) == 1 else listed
        if kind == "int | str" and value == "auto":
            return value
        if kind in ("int", "int | str"):
            return coerce_int(value)
        if kind == "float | None" and value in (None, "", "none"):
            return None
        if kind in ("float", "float | None"):
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if kind == "str":
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                return ",".join(value)  # a TOML array of per-rank values, as the flag's comma list
            if not isinstance(value, str):
                raise ValueError(value)
            return value
        if kind.startswith("tuple"):
            items = value.split(",") if isinstance(value, str) else list(value)
            if any(isinstance(v, bool) for v in items):
                raise ValueError(value)
            return tuple(float(v) for v in items if str(v).strip() != "")
    except (TypeError, ValueError):
        raise ConfigError(f"--{_flag(f.name)}: invalid value {value!r} (expected {kind})") from None
    raise AssertionError(f"unhandled field type {kind}")


def _tuple(value):
    """A TOML array as a tuple (per-rank values); any other value as it is."""
    return tuple(value) if isinstance(value, list) else value


def coerce_int(value) -> int:
    """Convert a value to an int; ValueError for a bool or a fractional number."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)
    return int(value)


def load_toml(path: str) -> dict:
    """Read a TOML config file into a flat mapping."""
    try:
        with Path(path).open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {path}: invalid TOML ({err})") from None
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read ({err.strerror})") from None
