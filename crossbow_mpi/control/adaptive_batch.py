"""Adaptive batch sizes (HeteroGPU's rule: Ma, Rusu, Wu and Sim's adaptive elastic training, YMA33/HeteroGPU
`Scheduler/source/GPUGDScheduler.cu`, ±32 at every merge within [32, 1024]): every window of `every` iterations,
compare each rank's share of the updates p_i with 1/P and move its batch size by `step` within [`smallest`,
`largest`]:

    p_i = u_i / Σ_q u_q                  asynchronous rounds (hogbatch, elastic): u_i rank i's updates in the window
    p_i = (1 / t_i) / Σ_q (1 / t_q)      synchronous algorithms: t_i rank i's mean compute seconds per step, so
                                         p_i is the share of the updates it would make at its own pace
    p_i > 1/P and b_i < largest:  b_i += step;     p_i < 1/P and b_i > smallest:  b_i −= step

With `hold` (not in the artifact) a move is made only when it is predicted to bring the shares closer to 1/P:
rank i's rate scales as 1/b_i at its measured seconds per sample, so p'_i ∝ p_i·b_i/b'_i. The moves by `step`,
step/2, step/4, … 1 are predicted, and the one with the smallest max_i |p'_i − 1/P| (the larger step on a tie) is
made if that is below max_i |p_i − 1/P|; otherwise the sizes stay. Without it, a step that is large against the
batch never settles: at batch 64, step 32 and one rank half as fast, the sizes swing between (64, 64) and (96, 32)
at every window; with it they go (80, 48), (84, 44), (85, 43), next to the balance at (85⅓, 42⅔).

The sizes stay fixed during the learning-rate warm-up, as the artifact's do. A faster rank gets a larger batch:
update counts even out in hogbatch and elastic, step times (so no rank waits at the sync) in the synchronous
algorithms, where S-SGD still averages by samples. (Ma and Rusu's Adaptive Hogbatch, arXiv 2004.08771, balances
update counts too, but its rule is not in their released code, YMA33/CPU-GPU-SGD.) It is a controller: it returns
`batch_size`, one per rank, the same on every rank, with the shares p_i it measured (written into the change's
record).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossbow_mpi.comm import Communicator


@dataclass(frozen=True)
class BatchPolicy:
    """The bounds and the increment of the adaptive batch sizes."""

    every: int
    """Steps per measurement window."""
    smallest: int
    """Smallest batch size per learner."""
    largest: int
    """Largest batch size per learner."""
    step: int
    """Change of a rank's batch size per window."""
    fixed_until: float = 0.0
    """Epochs during which the sizes stay fixed (the learning-rate warm-up)."""
    hold: bool = False
    """Make the move by step, step/2, … 1 predicted to balance the shares best, or none (the module docstring)."""


def adapt(policy: BatchPolicy, shares: list[float], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Return the batch sizes after one window in which rank i's share of the updates was shares[i]."""
    if not policy.hold:
        return moved(policy, shares, sizes, policy.step)
    steps = [policy.step >> halving for halving in range(policy.step.bit_length())]
    outcomes = [
        (imbalance(predicted(shares, sizes, move)), move)
        for move in (moved(policy, shares, sizes, step) for step in steps)
    ]
    best_imbalance, best = min(outcomes, key=lambda outcome: outcome[0])
    return best if best_imbalance < imbalance(shares) else sizes


def moved(policy: BatchPolicy, shares: list[float], sizes: tuple[int, ...], step: int) -> tuple[int, ...]:
    """Return the sizes moved by `step`: up for a share above 1/P, down for one below, within the bounds."""
    fair = 1.0 / len(sizes)
    adapted = []
    for share, size in zip(shares, sizes, strict=True):
        if share > fair and size < policy.largest:
            size = min(size + step, policy.largest)
        elif share < fair and size > policy.smallest:
            size = max(size - step, policy.smallest)
        adapted.append(size)
    return tuple(adapted)


def predicted(shares: list[float], sizes: tuple[int, ...], adapted: tuple[int, ...]) -> list[float]:
    """Return the shares predicted after moving the batch sizes from `sizes` to `adapted`: each rank's rate
    scales as 1/b_i at its measured seconds per sample."""
    rates = [share * size / new for share, size, new in zip(shares, sizes, adapted, strict=True)]
    return [rate / max(sum(rates), 1e-12) for rate in rates]


def imbalance(shares: list[float]) -> float:
    """Return the largest distance of a share from 1/P."""
    return max(abs(share - 1.0 / len(shares)) for share in shares)


@dataclass
class AdaptiveBatch:
    """Balance the ranks' step times by their batch sizes (see the module docstring); `history` holds every
    window's iteration, shares and batch sizes."""

    policy: BatchPolicy
    scope: Communicator
    seconds: float = 0.0
    steps: int = 0
    updates: int = 0
    history: list[dict] = field(default_factory=list)

    def __call__(self, run, step) -> dict | None:
        if run.epoch_progress < self.policy.fixed_until:
            return None
        self.seconds += step.compute_s
        self.steps += 1
        self.updates += step.updates
        if self.steps < self.policy.every:
            return None
        if run.algorithm.rounds:
            rates = [float(u) for u in self.scope.allgather_json(self.updates)]
        else:
            rates = [1.0 / max(t, 1e-9) for t in self.scope.allgather_json(self.seconds / self.steps)]
        self.seconds, self.steps, self.updates = 0.0, 0, 0
        shares = [r / max(sum(rates), 1e-9) for r in rates]
        current = run.sampler.batch_sizes(run.hp.batch_size)
        sizes = adapt(self.policy, shares, current)
        self.history.append({"iteration": run.state.iteration, "shares": shares, "batch_sizes": list(sizes)})
        return {"batch_size": sizes, "measured": {"shares": shares}} if sizes != current else None

    def state_dict(self) -> dict:
        """Return the window measured so far on this rank, and the history."""
        return {"seconds": self.seconds, "steps": self.steps, "updates": self.updates, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.seconds, self.steps, self.updates = state["seconds"], state["steps"], state["updates"]
        self.history = list(state["history"])
