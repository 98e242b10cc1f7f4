"""Omnivore's optimizer (`--groups auto`): pick the compute groups g, momentum μ and learning rate η from timed
probes before training, following the released artifact's cold start:

1. g = 1 with μ = 0.9 and η ∈ {10, 1, 0.1, 0.01} × `--lr`;
2. then g doubled while it divides the ranks: μ ∈ {0, .3, .6, .9} × η ∈ {η*, η*/10} around the previous g's best, pruned
   as the artifact does (no larger μ at η*, no smaller μ at η*/10, nothing that dominates a diverged point);
3. stop adding groups when a g is less than 10 % faster per iteration than the previous one;
4. train with the (g, μ, η) of the lowest score;
5. every `--optimizer-epoch` seconds of training, search again: μ ∈ {0, .3, .6, .9} × η ∈ {η, η/10} at the current
   g, and at g/2 while the best μ is 0 (asynchrony already gives the momentum).

Every probe starts from the same in-memory snapshot (`Run.state_dict`) and trains `--probe-seconds` in rounds of
one global step; its score is the mean training loss over its last 10 steps (infinite when it diverged). Each
probe and the choice is a metrics record `{"event": "optimizer"}`; the search's seconds count as training time.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from crossbow_mpi.config import Config
from crossbow_mpi.metrics import MetricsLog, Progress
from crossbow_mpi.run import Run

COLD_LR_FACTORS = (10.0, 1.0, 0.1, 0.01)
COLD_MOMENTUM = 0.9
MOMENTA = (0.0, 0.3, 0.6, 0.9)
SCORE_STEPS = 10
TIMING_STEPS = 3
MIN_SPEEDUP = 0.1


def group_counts(world_size: int) -> list[int]:
    """Return 1, 2, 4, … while it divides the ranks."""
    counts = [1]
    while world_size % (2 * counts[-1]) == 0:
        counts.append(2 * counts[-1])
    return counts


def grid(best_momentum: float, best_lr: float, diverged: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Return the (μ, η) points to probe at a larger g, given the best so far and the points that diverged."""
    points = []
    for lr in (best_lr, best_lr / 10):
        for momentum in MOMENTA:
            if lr == best_lr and momentum > best_momentum or lr < best_lr and momentum < best_momentum:
                continue
            if any(momentum >= m and lr >= r for m, r in diverged):
                continue
            points.append((momentum, lr))
    return points


class OmnivoreOptimizer:
    """Search (g, μ, η) with timed probes on the run (collective over the world)."""

    def __init__(self, config: Config, run: Run, metrics: MetricsLog, progress: Progress):
        self.config = config
        self.run = run
        self.world = run.topology.world
        self.metrics = metrics
        self.progress = progress
        self.probes: list[dict] = []

    def choose(self) -> dict:
        """Probe from cold, then leave the run at its snapshot with the best (g, μ, η); return the choice's record."""
        return self._search("choice", self._cold_start, count_time=True)

    def retune(self) -> dict:
        """Search μ ∈ {0, .3, .6, .9} × η ∈ {η, η/10} around the current g, halving g while the best μ there is 0;
        leave the run at its snapshot with the best; return the record."""
        return self._search("retune", self._around_current, count_time=False)

    def _cold_start(self, snapshot: dict) -> None:
        for lr in (factor * self.config.lr for factor in COLD_LR_FACTORS):
            self.probe(snapshot, 1, COLD_MOMENTUM, lr)
        previous = min(p["s_per_iteration"] for p in self.probes)
        for groups in group_counts(self.world.size)[1:]:
            best = self.best(groups // 2)
            diverged = [(p["momentum"], p["lr"]) for p in self.probes if math.isinf(p["score"])]
            for momentum, lr in grid(best["momentum"], best["lr"], diverged):
                self.probe(snapshot, groups, momentum, lr)
            measured = [p["s_per_iteration"] for p in self.probes if p["groups"] == groups]
            if not measured or min(measured) > (1 - MIN_SPEEDUP) * previous:
                break
            previous = min(measured)

    def _around_current(self, snapshot: dict) -> None:
        groups, lr = self.run.algorithm.transport.groups, self.run.hp.lr
        while True:
            for momentum in MOMENTA:
                for rate in (lr, lr / 10):
                    self.probe(snapshot, groups, momentum, rate)
            if self.best(groups)["momentum"] > 0 or groups == 1:
                return
            groups //= 2

    def _search(self, decision: str, search: Callable[[dict], None], count_time: bool) -> dict:
        """Run `search` from a snapshot of the run, in rounds of one global step, then restore the snapshot with the
        best probe's (g, μ, η) and record the decision (collective)."""
        run, started = self.run, time.perf_counter()
        run.settle()
        run.algorithm.drain()
        snapshot = run.state_dict()
        round_samples, run.round_samples = run.round_samples, run.sampler.step_size(run.learners.k, run.hp.batch_size)
        self.probes = []
        search(snapshot)
        choice = self.best()
        self.start_from(snapshot, choice["groups"], choice["momentum"], choice["lr"])
        run.round_samples = round_samples
        seconds = self.world.bcast_json(time.perf_counter() - started)
        if count_time:  # before the loop's clock starts; a re-tune inside the loop is on its clock already
            run.state.elapsed_s += seconds
        record = {
            "event": "optimizer",
            "decision": decision,
            **_recorded(choice),
            "probes": len(self.probes),
            "search_s": seconds,
        }
        self.metrics.write(record)
        self.progress.note(
            f"omnivore optimizer ({decision}): {choice['groups']} groups, momentum {choice['momentum']}, "
            f"lr {choice['lr']:g} after {len(self.probes)} probes in {seconds:.1f}s"
        )
        return record

    def best(self, groups: int | None = None) -> dict:
        """Return the probe of the lowest score (among those with `groups`, if given)."""
        return min((p for p in self.probes if groups in (None, p["groups"])), key=lambda p: p["score"])

    def start_from(self, snapshot: dict, groups: int, momentum: float, lr: float) -> None:
        """Restore the snapshot with these groups and hyper-parameters (collective)."""
        self.run.algorithm.transport.regroup(groups)
        self.run.load_state_dict(snapshot)
        self.run.hp.update(momentum=momentum, lr=lr)

    def probe(self, snapshot: dict, groups: int, momentum: float, lr: float) -> None:
        """Train `--probe-seconds` from the snapshot with (g, μ, η); record its score and seconds per iteration."""
        run = self.run
        self.start_from(snapshot, groups, momentum, lr)
        started = time.perf_counter()
        losses = [self.step(lr) for _ in range(TIMING_STEPS)]
        s_per_iteration = self.world_max((time.perf_counter() - started) / TIMING_STEPS)
        steps = max(SCORE_STEPS, math.ceil(self.config.probe_seconds / s_per_iteration))
        losses += [self.step(lr) for _ in range(steps - TIMING_STEPS)]
        run.settle()
        run.algorithm.drain()
        s_per_iteration = self.world_max((time.perf_counter() - started) / len(losses))
        total, count = self.world.allreduce_sum_numbers([sum(losses[-SCORE_STEPS:]), SCORE_STEPS])
        score = total / count if math.isfinite(total) else math.inf
        record = {
            "groups": groups,
            "momentum": momentum,
            "lr": lr,
            "score": score,
            "s_per_iteration": s_per_iteration,
            "steps": len(losses),
        }
        self.probes.append(record)
        self.metrics.write({"event": "optimizer", "decision": "probe", **_recorded(record)})

    def step(self, lr: float) -> float:
        """Take one step, wrapping to the next epoch as the loop does; return this rank's mean learner loss."""
        run = self.run
        if not run.step_fits():
            run.state.next_epoch()
        return float(run.train_step(lr).losses.mean())

    def world_max(self, value: float) -> float:
        return max(self.world.allgather_json(value))


def _recorded(probe: dict) -> dict:
    """Return a probe for a metrics record: a diverged probe's score is null (strict JSON has no infinity)."""
    return {**probe, "score": probe["score"] if math.isfinite(probe["score"]) else None}
