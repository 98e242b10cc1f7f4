"""The planner's performance model: step times and speedups of data parallelism (DP) against hybrid pipelines.

Pure functions of measured or given quantities (Pal et al., IEEE Micro 2019):
- an allreduce of n bytes on P ranks costs, by the α-β model (α latency, β seconds per byte) of Thakur,
  Rabenseifner and Gropp, "Optimization of collective communication operations in MPICH" (IJHPCA 2005):
  ring (reduce-scatter, then allgather) 2(P−1)·α + 2(P−1)/P·n·β; binomial tree (reduce to a root, then
  broadcast, unpipelined) 2·⌈log2 P⌉·(α + n·β). `auto` takes the faster of the two for each message and P, as MPI
  libraries and NCCL choose by size: the tree wins at latency-bound sizes and large P, the ring when bandwidth
  dominates. NCCL's pipelined double binary tree (≈ 2·log2 P·α + 2·n·β: the tree's latency at nearly the ring's
  bandwidth) is not modelled; it would move the crossover to larger messages.
- a pipeline of M stages with μ micro-batches runs μ + M − 1 slots, each as long as the slowest stage's compute
  of one micro-batch plus its activation and gradient messages, so (M−1)/(μ+M−1) of a step is bubble;
- E(B), the epochs to the target at aggregate batch B, follows E_min·(1 + B/B_noise);
- the speedup over one device in time to the target of W workers, each taking `batch` samples per step, is
  E(batch)/E(W·batch) · T_step(1)/T_step · W. DP is W = N workers of one device; hybrid W = N/M workers of M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALLREDUCES = ("ring", "tree", "auto")


@dataclass(frozen=True)
class Network:
    """An α-β network model."""

    latency_s: float
    """α: the fixed cost of one message, seconds."""
    seconds_per_byte: float
    """β: the inverse bandwidth."""
    allreduce: str = "ring"
    """The allreduce algorithm: `ring`, `tree` or `auto` (the faster of the two per message size and P)."""

    @classmethod
    def from_link(cls, gbit_per_s: float, latency_us: float) -> Network:
        """Describe a link by its bandwidth in Gb/s and its latency in µs."""
        if not gbit_per_s > 0 or not latency_us >= 0 or math.isinf(gbit_per_s) or math.isinf(latency_us):
            raise ValueError(f"--bandwidth must be > 0 and --latency >= 0, got {gbit_per_s} Gb/s, {latency_us} µs")
        return cls(latency_us * 1e-6, 8 / (gbit_per_s * 1e9))

    def send_s(self, nbytes: float) -> float:
        """One point-to-point message."""
        return self.latency_s + nbytes * self.seconds_per_byte if nbytes else 0.0

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        """An allreduce of `nbytes` over `ranks` by this network's algorithm."""
        if ranks <= 1:
            return 0.0
        ring, tree = self.ring_allreduce_s(nbytes, ranks), self.tree_allreduce_s(nbytes, ranks)
        return {"ring": ring, "tree": tree, "auto": min(ring, tree)}[self.allreduce]

    def ring_allreduce_s(self, nbytes: float, ranks: int) -> float:
        """Reduce-scatter, then allgather, around a ring: 2(P−1)·α + 2(P−1)/P·n·β."""
        steps = 2 * (ranks - 1)
        return steps * self.latency_s + steps / ranks * nbytes * self.seconds_per_byte

    def tree_allreduce_s(self, nbytes: float, ranks: int) -> float:
        """Reduce up a binomial tree, then broadcast down it: 2·⌈log2 P⌉·(α + n·β)."""
        return 2 * math.ceil(math.log2(ranks)) * (self.latency_s + nbytes * self.seconds_per_byte)


def fit_ring_allreduce(sizes_bytes: list[float], seconds: list[float], ranks: int) -> Network:
    """Fit α and β of a ring allreduce to times measured on `ranks` ranks (least squares of T = a + b·n)."""
    if ranks < 2 or len(sizes_bytes) != len(seconds) or len(set(sizes_bytes)) < 2:
        raise ValueError("the allreduce fit needs times of at least two message sizes on two or more ranks")
    a, b = _line(sizes_bytes, seconds)
    steps = 2 * (ranks - 1)
    return Network(max(a, 0.0) / steps, max(b, 0.0) * ranks / steps)


@dataclass(frozen=True)
class EpochCurve:
    """E(B) = E_min·(1 + B/B_noise): the epochs to the target grow with the aggregate batch B."""

    min_epochs: float
    noise_batch: float
    """B_noise: the aggregate batch at which a run needs twice the epochs of a small-batch run."""

    def epochs(self, batch: float) -> float:
        return self.min_epochs * (1 + batch / self.noise_batch)


DEFAULT_EPOCHS = EpochCurve(min_epochs=1.0, noise_batch=256.0)
"""Without a stat-efficiency results file: E doubles at an aggregate batch of 256 (the order of this
repository's LeNet/MNIST S-SGD runs; only the ratio E(b)/E(B) enters a speedup, so E_min is immaterial)."""


def fit_epochs(batches: list[float], epochs: list[float]) -> EpochCurve:
    """Fit E(B) = E_min + (E_min/B_noise)·B to measured (aggregate batch, epochs to the target) pairs."""
    if len(set(batches)) < 2 or len(batches) != len(epochs):
        raise ValueError("E(B) needs runs that reached the target at two or more aggregate batches")
    intercept, slope = _line(batches, epochs)
    if intercept <= 0 or slope <= 0:
        raise ValueError(
            f"E(B) does not grow with the batch in these results (E = {intercept:.3g} + {slope:.3g}·B); "
            "give other results or none"
        )
    return EpochCurve(intercept, intercept / slope)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The share of a gpipe or 1f1b step that a stage idles: (M−1)/(μ+M−1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_step_s(
    stage_sample_s: list[float], boundary_bytes: list[float], batch: int, micro_batches: int, network: Network
) -> float:
    """One pipeline step's compute and messages (no allreduce): μ + M − 1 slots of the slowest stage's
    forward+backward of one micro-batch plus the largest activation and gradient messages between stages.
    `stage_sample_s` is each stage's forward+backward per sample, `boundary_bytes` each cut's activation bytes
    per sample."""
    assert len(boundary_bytes) == len(stage_sample_s) - 1
    micro = batch / micro_batches
    compute = max(stage_sample_s) * micro
    messages = 2 * network.send_s(max(boundary_bytes) * micro) if boundary_bytes else 0.0
    return (micro_batches + len(stage_sample_s) - 1) * (compute + messages)


def speedup(workers: int, batch: int, step_s: float, single_step_s: float, curve: EpochCurve) -> float:
    """Speedup in time to the target over one device taking `batch` samples per step in `single_step_s`."""
    return curve.epochs(batch) / curve.epochs(workers * batch) * single_step_s / step_s * workers


@dataclass(frozen=True)
class Workload:
    """What one worker computes, measured on one device."""

    batch: int
    """Samples per worker per step (one device in DP, one pipeline in hybrid)."""
    sample_s: float
    """Forward+backward of the whole model per sample."""
    param_bytes: int
    stages: dict[int, tuple[list[float], list[float], list[int]]]
    """For M stages: each stage's forward+backward per sample, each cut's activation bytes per sample, each
    stage's parameter bytes."""
    micro_batches: int
    update_s_per_byte: float = 0.0
    """The optimizer's element-wise update of a step, per byte of parameters."""


def dp_step_s(work: Workload, devices: int, network: Network) -> float:
    update = work.param_bytes * work.update_s_per_byte
    return work.batch * work.sample_s + update + network.allreduce_s(work.param_bytes, devices)


def hybrid_step_s(work: Workload, devices: int, stages: int, network: Network) -> float:
    """A step of N/M pipelines of M stages: the pipeline, then the allreduce of the largest stage's shard over
    the N/M ranks that hold that stage. With M = 1 it is the DP step."""
    if stages == 1:
        return dp_step_s(work, devices, network)
    stage_s, cut_bytes, stage_bytes = work.stages[stages]
    pipeline = pipeline_step_s(stage_s, cut_bytes, work.batch, work.micro_batches, network)
    update = max(stage_bytes) * work.update_s_per_byte
    return pipeline + update + network.allreduce_s(max(stage_bytes), devices // stages)


@dataclass(frozen=True)
class Projection:
    """One (N, M) cell of the projection."""

    devices: int
    stages: int
    step_s: float
    speedup: float
    """SU_hybrid(N, M); SU_DP(N) when M = 1."""
    mp_speedup: float
    """SU_MP(M): the per-step speedup of one worker split over M devices."""
    pal_criterion: bool | None
    """SU_MP(M) > SU_DP(N)/SU_DP(N/M) (Pal et al.'s condition for hybrid to beat DP); None for M = 1."""


def project(
    work: Workload, network: Network, curve: EpochCurve, devices: list[int], stages: list[int]
) -> list[Projection]:
    """Project SU_DP(N) and SU_hybrid(N, M) for every N in `devices` and every M in `stages` that divides N and
    that the workload was measured for."""
    single = dp_step_s(work, 1, network)

    def su_dp(n: int) -> float:
        return speedup(n, work.batch, dp_step_s(work, n, network), single, curve)

    cells = []
    for n in devices:
        for m in stages:
            if n % m or (m > 1 and m not in work.stages):
                continue
            step = hybrid_step_s(work, n, m, network)
            mp = 1.0 if m == 1 else single / hybrid_step_s(work, m, m, network)
            criterion = None if m == 1 else mp > su_dp(n) / su_dp(n // m)
            cells.append(Projection(n, m, step, speedup(n // m, work.batch, step, single, curve), mp, criterion))
    return cells


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b·x."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope
