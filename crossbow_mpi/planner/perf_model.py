"""The planner's performance model: step times and speedups of data parallelism (DP) against hybrid pipelines.

Pure functions of measured or given quantities (Pal et al., IEEE Micro 2019):
- an allreduce of n bytes on P ranks costs, by the α-β model (α latency, β seconds per byte) of Thakur,
  Rabenseifner and Gropp, "Optimization of collective communication operations in MPICH" (IJHPCA 2005):
  ring (reduce-scatter, then allgather) 2(P−1)·α + 2(P−1)/P·n·β; binomial tree (reduce to a root, then
  broadcast, unpipelined) 2·⌈log2 P⌉·(α + n·β). `auto` takes the faster of the two for each message and P, as MPI
  libraries and NCCL choose by size: the tree wins at latency-bound sizes and large P, the ring when bandwidth
  dominates. NCCL's pipelined double binary tree (≈ 2·log2 P·α + 2·n·β: the tree's latency at nearly the ring's
  bandwidth) is not modelled; it would move the crossover to larger messages.
- a pipeline of M stages with μ micro-batches (gpipe or 1f1b) takes (μ−1)·max_i c_i + Σ_i c_i + 2·Σ_j (t_j + d):
  the slowest stage's slot for every micro-batch but one, plus one micro-batch through every stage and back (the
  fill and the drain, so about (M−1)/(μ+M−1) of a step is bubble when the stages are balanced). A stage's slot
  c_i is its forward+backward of one micro-batch plus the host work of the messages it handles per micro-batch:
  for each cut j beside it, the activation and the gradient each cost h_j = h_0 + n_j·h_1 of encoding, posting,
  probing, receiving and decoding on the two stages' cores together (h_0, h_1 fitted to a ping-pong of
  pipeline.StageLink at the cuts' sizes). On the fill and drain path the first micro-batch's activation crosses
  each cut one way and its gradient the other, each after a transfer t_j = α + n_j·β and a poll delay d: a
  waiting stage probes for its message between sleeps that double up to POLL_MAX_S (comm.base), so after a wait
  of a slot it notices a message on average half a poll late, d = (POLL_MAX_S + the measured oversleep of
  sleep(POLL_MAX_S))/2. In the steady state the transfers overlap the compute (a slot is never shorter than one
  transfer) and a stage's next input is there before it asks;
- a step adds to its compute (DP: the batch's forward+backward; hybrid: the pipeline) the optimizer's update of the
  largest shard, the allreduce of that shard over the ranks that hold it, and the training loop's own host work
  per step (loading the batch, zeroing, bookkeeping: a step of S-SGD on one rank less its compute and update);
- E(B), the epochs to the target at aggregate batch B, follows E_min·(1 + B/B_noise);
- the speedup over one device in time to the target of W workers, each taking `batch` samples per step, is
  E(batch)/E(W·batch) · T_step(1)/T_step · W. DP is W = N workers of one device; hybrid W = N/M workers of M.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


@dataclass(frozen=True)
class LinkCost:
    """What a message between two pipeline stages costs on this machine beside its transfer."""

    host_s_fixed: float = 0.0
    """h_0: the host work of one message, both ends together (encode, post, probe, receive, decode), seconds."""
    host_s_per_byte: float = 0.0
    """h_1: its growth per byte of the message."""
    poll_delay_s: float = 0.0
    """d: how late, on average, a stage that has waited a slot notices its message (half a longest poll)."""

    def host_s(self, nbytes: float) -> float:
        return self.host_s_fixed + nbytes * self.host_s_per_byte


def fit_link(sizes_bytes: Sequence[float], seconds: Sequence[float], poll_delay_s: float) -> LinkCost:
    """Fit h_0 and h_1 to the host seconds per message measured at two or more sizes (least squares)."""
    if len(sizes_bytes) != len(seconds) or len(set(sizes_bytes)) < 2:
        raise ValueError("the stage link fit needs host times of at least two message sizes")
    fixed, per_byte = _line(sizes_bytes, seconds)
    return LinkCost(max(fixed, 0.0), max(per_byte, 0.0), poll_delay_s)


def pipeline_step_s(
    stage_sample_s: Sequence[float],
    boundary_bytes: Sequence[float],
    batch: int,
    micro_batches: int,
    network: Network,
    link: LinkCost = LinkCost(),
) -> float:
    """One pipeline step's compute and messages (no allreduce): every micro-batch but one in the slowest stage's
    slot, one through every stage, and the first activation's and last gradient's transfers and poll delays
    across every cut. `stage_sample_s` is each stage's forward+backward per sample, `boundary_bytes` each cut's
    activation bytes per sample."""
    assert len(boundary_bytes) == len(stage_sample_s) - 1
    micro = batch / micro_batches
    messages = [micro * n for n in boundary_bytes]
    handled = [link.host_s(n) for n in messages]
    slots = [seconds * micro + sum(handled[max(i - 1, 0) : i + 1]) for i, seconds in enumerate(stage_sample_s)]
    slot = max(slots + [network.send_s(n) for n in messages])
    crossings = sum(2 * (network.send_s(n) + link.poll_delay_s) for n in messages)
    return (micro_batches - 1) * slot + sum(slots) + crossings


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
    stages: dict[int, tuple[list[float], list[int], list[int]]]
    """For M stages: each stage's forward+backward per sample, each cut's activation bytes per sample, each
    stage's parameter bytes."""
    micro_batches: int
    update_s_per_byte: float = 0.0
    """The optimizer's element-wise update of a step, per byte of parameters."""
    step_overhead_s: float = 0.0
    """The training loop's host work per step beside forward+backward and the update (none in workloads saved
    before it was measured: measure again to charge it)."""
    link: LinkCost = LinkCost()
    """The stage link's host work per message and poll delay (workloads saved before they were measured load
    with none: measure again to charge them)."""


def dp_step_s(work: Workload, devices: int, network: Network) -> float:
    update = work.param_bytes * work.update_s_per_byte
    compute = work.batch * work.sample_s + work.step_overhead_s
    return compute + update + network.allreduce_s(work.param_bytes, devices)


def hybrid_step_s(work: Workload, devices: int, stages: int, network: Network) -> float:
    """A step of N/M pipelines of M stages: the pipeline, then the allreduce of the largest stage's shard over
    the N/M ranks that hold that stage. With M = 1 it is the DP step."""
    if stages == 1:
        return dp_step_s(work, devices, network)
    stage_s, cut_bytes, stage_bytes = work.stages[stages]
    pipeline = pipeline_step_s(stage_s, cut_bytes, work.batch, work.micro_batches, network, work.link)
    update = max(stage_bytes) * work.update_s_per_byte
    return pipeline + work.step_overhead_s + update + network.allreduce_s(max(stage_bytes), devices // stages)


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


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b·x."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope
