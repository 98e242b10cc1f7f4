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
EAGER_MODES = ("solo", "majority")
SCHEDULES = ("gpipe", "1f1b")
CUTS = ("params", "time")
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
    "eval_every",
    "threads",
    "checkpoint_every",
    "seed",
    "autotune_threshold",
    "max_memory",
    "collective_timeout",
    "round_samples",
    "optimizer_epoch",
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
    probes pick among `sma`, `ssgd`, `eager` (majority) and `omnivore` with their momentum, learning rate and
    groups before training, and again every `optimizer_epoch` (crossbow_mpi.control.omnivore_search). `auto` needs
    a fixed number of `--learners` (the sma probes use it) and no `--pipeline-stages`."""
    model: str = "lenet"
    """Model name from the registry (`lenet`, `mlp`, `resnet32`)."""
    dataset: str = "mnist"
    """Dataset name (`mnist`, `cifar10`, `synthetic-mnist`, `synthetic-cifar`)."""
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
    adapt_every: int = 20
    """With `adaptive_batch`: iterations per measurement window (steps; rounds for `hogbatch`, `elastic`)."""
    batch_min: int = 1
    """With `adaptive_batch`: smallest batch size per learner."""
    batch_max: int = 1024
    """With `adaptive_batch`: largest batch size per learner."""
    batch_step: int = 1
    """With `adaptive_batch`: change of a rank's batch size per window."""
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
    """L2 coefficient λ added to every gradient."""
    alpha: float = 0.1
    """SMA: fraction α of each learner's difference to the central model moved per sync."""
    central_momentum: float = 0.9
    """SMA: momentum μ_z of the central model's updates; applied only while the learners' `momentum` is above 0,
    as CROSSBOW's released code does (`synch/sma.c`), unless `central_momentum_always`."""
    central_momentum_always: bool = False
    """SMA: apply `central_momentum` also when the learners' `momentum` is 0 (CROSSBOW applies it only with learner
    momentum)."""
    merge_momentum: float = 0.0
    """elastic: momentum μ_z of the central model's step to each round's merged model (SMA's central momentum
    step, applied to a whole round's move: SMA's 0.9 overshoots it; 0: z becomes the merged model)."""
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
    lr_steps: tuple[float, ...] = ()
    """Epochs at which the learning rate is multiplied by `lr_gamma` (SMA resets learners to z there)."""
    lr_gamma: float = 0.1
    """Factor applied to the learning rate at each of `lr_steps`."""
    warmup_epochs: float = 0.0
    """Epochs of linear learning-rate warm-up from lr/10 to lr."""
    epochs: float = 10.0
    """Upper bound on training epochs."""
    target_accuracy: float = 0.99
    """Stop at the first evaluation of z that reaches this test accuracy (0 or less: never stop early)."""
    eval_every: int = 15000
    """Evaluate z every this many training samples (all ranks together); 0: once per epoch."""
    time_limit: float = 0.0
    """Stop at the first evaluation after this many seconds of training, as rank 0's clock reads (0: no limit); the
    run ends as at its epoch limit, with a checkpoint and a summary that says `time_limited`."""
    inject_imbalance: str = ""
    """Injected stragglers for tests and benchmarks: `random:MS[:N]` or `slow-rank:R:FACTOR` (empty: none)."""
    collective_timeout: float = 300.0
    """Abort the job, naming the ranks that did not arrive, when training makes no progress for this many
    seconds because a rank stopped taking part (0: never)."""
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
    precision: str = "fp32"
    """Learners' compute precision: `fp32`, or `bf16` autocast (z, u and corrections stay float32)."""
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
    """Continue from the newest valid checkpoint in `run_dir`."""
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

    def _validate_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _has_type(value, str(f.type)):
                raise ConfigError(f"--{_flag(f.name)}: invalid value {value!r} (expected {f.type})")
            if f.type == "float" and not math.isfinite(value):
                raise ConfigError(f"--{_flag(f.name)} must be a finite number, got {value}")
            if f.type == "float" and abs(value) > FLOAT32_MAX:
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
            "model": tuple(model_names()),
            "dataset": tuple(dataset_names()),
            "eager_mode": EAGER_MODES,
            "schedule": SCHEDULES,
            "cut": CUTS,
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
        if self.fused_step and self.algorithm not in FUSED_ALGORITHMS:
            raise ConfigError(f"--fused-step applies to --algorithm sma, ssgd or auto, not {self.algorithm}")
        if self.compile and self.pipeline_stages > 1:
            raise ConfigError("--compile does not apply to --pipeline-stages: compile the stages' modules yourself")
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(
                f"--target-accuracy must be a fraction in [0, 1] (0.99 for 99 %), got {self.target_accuracy}"
            )
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"--alpha must be in (0, 1], got {self.alpha}")
        if not max(self.momentum, self.central_momentum, self.merge_momentum) < 1:
            raise ConfigError("--momentum, --central-momentum and --merge-momentum must be below 1")
        if self.seed >= SEED_LIMIT:
            raise ConfigError(f"--seed must be below 2**32, got {self.seed}")
        if list(self.lr_steps) != sorted(self.lr_steps) or any(s <= 0 for s in self.lr_steps):
            raise ConfigError(f"--lr-steps must be increasing positive epochs, got {','.join(map(str, self.lr_steps))}")

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
        if kind == "float":
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
