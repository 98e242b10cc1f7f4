"""Omnivore's optimizer (`--groups auto`): pick the compute groups g, momentum μ and learning rate η from timed
probes before training, following the released artifact's cold start:

1. g = 1 with μ = 0.9 and η ∈ {10, 1, 0.1, 0.01} × `--lr`;
2. then g doubled while it divides the ranks: μ ∈ {0, .3, .6, .9} × η ∈ {η*, η*/10} around the previous g's best, pruned
   as the artifact does (no larger μ at η*, no smaller μ at η*/10, nothing that dominates a diverged point);
3. stop adding groups when a g is less than 10 % faster per iteration than the previous one;
4. train with the (g, μ, η) of the lowest score;
5. every `--optimizer-epoch` seconds of training, search again: μ ∈ {0, .3, .6, .9} × η ∈ {η, η/10} at the current
   g, and at g/2 while the best μ is 0 (asynchrony already gives the momentum).

With `--algorithm auto` the same probes choose the algorithm too, among `sma`, `ssgd`, `eager` (majority) and
`omnivore`:

1. the cold start above with `ssgd` as g = 1 (Omnivore's g = 1 is S-SGD bit for bit) and `omnivore` for g > 1;
2. `sma` with μ = 0.9 and η ∈ {10, 1, 0.1, 0.01} × `--lr` (its learners' momentum and learning rate);
3. `eager` on the pruned grid of the first list's step 2, around S-SGD's best (stale rounds act like asynchrony);
4. train with the (algorithm, g, μ, η) of the lowest score: about 4 + 4 + 5 probes, and 5 per g > 1;
5. every `--optimizer-epoch`: the current algorithm's search of the first list's step 5 (omnivore halving g down to
   2), and every other algorithm once, at its best of the last search (after a resume: at the current μ and η,
   omnivore at 2 groups).

With one rank eager-SGD and Omnivore are S-SGD: only `sma` and `ssgd` are probed (Omnivore needs an even number
of ranks, for two groups or more). A switch of algorithm restarts the momenta at zero and every learner from z
(`Run.load_state_dict`).

Every probe starts from the same in-memory snapshot (`Run.state_dict`) and trains `--probe-seconds` in rounds of
one global step; its score is the mean training loss over its last 10 steps (infinite when it diverged). Each
probe and the choice is a metrics record `{"event": "optimizer"}` with its algorithm; the search's seconds count as
training time, and the state's `optimizer_s` adds them up.

The ranks vote before every probe step whether any received a stop signal: a stop ends the search there, with the
run back at its snapshot and setting, and no choice; a resumed run searches again from the start (a cold start at
once, a re-tune `--optimizer-epoch` seconds after the resume).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from crossbow_mpi.config import Config
from crossbow_mpi.training.rank_run import Run
from crossbow_mpi.training.records import MetricsLog, Progress

COLD_LR_FACTORS = (10.0, 1.0, 0.1, 0.01)
COLD_MOMENTUM = 0.9
MOMENTA = (0.0, 0.3, 0.6, 0.9)
SCORE_STEPS = 10
TIMING_STEPS = 3
MIN_SPEEDUP = 0.1
AUTO_ALGORITHMS = ("sma", "ssgd", "eager", "omnivore")
"""What `--algorithm auto` chooses among."""


class SearchStopped(Exception):
    """A stop signal ended the search (raised on every rank at the same step)."""


def optimizes(config: Config) -> bool:
    """Tell whether the optimizer searches in this run (`--groups auto` or `--algorithm auto`)."""
    return config.groups == "auto" or config.algorithm == "auto"


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
            if (lr == best_lr and momentum > best_momentum) or (lr < best_lr and momentum < best_momentum):
                continue
            if any(momentum >= m and lr >= r for m, r in diverged):
                continue
            points.append((momentum, lr))
    return points


class OmnivoreOptimizer:
    """Search (g, μ, η), and with `--algorithm auto` the algorithm, with timed probes on the run (collective over
    the world). One optimizer serves a whole session: it remembers each algorithm's best of its last search."""

    def __init__(
        self, config: Config, run: Run, metrics: MetricsLog, progress: Progress, stop: Callable[[], bool] = bool
    ):
        self.config = config
        self.stop = stop
        """Votes whether any rank received a stop signal (collective); by default never."""
        self.run = run
        self.world = run.topology.world
        self.metrics = metrics
        self.progress = progress
        self.auto = config.algorithm == "auto"
        self.probes: list[dict] = []
        self.bests: dict[str, dict] = {}
        """With `--algorithm auto`: each algorithm's best probe of the last search."""

    def choose(self) -> dict | None:
        """Probe from cold, then leave the run at its snapshot with the best (algorithm, g, μ, η); return the choice's
        record (None: a stop signal ended the search)."""
        return self._search("choice", self._cold_start_algorithms if self.auto else self._cold_start, count_time=True)

    def retune(self) -> dict | None:
        """Search μ ∈ {0, .3, .6, .9} × η ∈ {η, η/10} around the current g, halving g while the best μ there is 0
        (with `--algorithm auto`, then every other algorithm at its last best); leave the run at its snapshot with
        the best; return the record (None: a stop signal ended the search)."""
        return self._search("retune", self._recheck if self.auto else self._around_current, count_time=False)

    def _cold_start(self, snapshot: dict, first: str = "omnivore") -> None:
        """Probe the cold start's learning rates at g = 1 with algorithm `first`, then Omnivore's larger g."""
        for lr in (factor * self.config.lr for factor in COLD_LR_FACTORS):
            self.probe(snapshot, first, 1, COLD_MOMENTUM, lr)
        previous = min(p["s_per_iteration"] for p in self.probes)
        for groups in group_counts(self.world.size)[1:]:
            best = self.best(groups=groups // 2)
            for momentum, lr in grid(best["momentum"], best["lr"], self.diverged()):
                self.probe(snapshot, "omnivore", groups, momentum, lr)
            measured = [p["s_per_iteration"] for p in self.probes if p["groups"] == groups]
            if not measured or min(measured) > (1 - MIN_SPEEDUP) * previous:
                break
            previous = min(measured)

    def _cold_start_algorithms(self, snapshot: dict) -> None:
        """S-SGD's learning rates and Omnivore's groups, then SMA's learning rates and eager-SGD's grid around
        S-SGD's best (see the module docstring)."""
        self._cold_start(snapshot, "ssgd")
        for lr in (factor * self.config.lr for factor in COLD_LR_FACTORS):
            self.probe(snapshot, "sma", 1, COLD_MOMENTUM, lr)
        if "eager" in self.candidates():
            best = self.best(algorithm="ssgd")
            for momentum, lr in grid(best["momentum"], best["lr"], self.diverged()):
                self.probe(snapshot, "eager", 1, momentum, lr)

    def _around_current(self, snapshot: dict) -> None:
        algorithm, groups, lr = self.run.algorithm.name, self.run.choice["groups"], self.run.hp.lr
        fewest = 2 if self.auto else 1  # with `--algorithm auto`, g = 1 is the `ssgd` probe
        while True:
            for momentum in MOMENTA:
                for rate in (lr, lr / 10):
                    self.probe(snapshot, algorithm, groups, momentum, rate)
            if self.best(algorithm=algorithm, groups=groups)["momentum"] > 0 or groups <= fewest:
                return
            groups //= 2

    def _recheck(self, snapshot: dict) -> None:
        """The current algorithm's search around its setting, then every other algorithm at its last best."""
        current, hp = self.run.algorithm.name, self.run.hp
        self._around_current(snapshot)
        for algorithm in self.candidates():
            if algorithm != current:
                fallback = {"groups": 2 if algorithm == "omnivore" else 1, "momentum": hp.momentum, "lr": hp.lr}
                last = self.bests.get(algorithm, fallback)
                self.probe(snapshot, algorithm, last["groups"], last["momentum"], last["lr"])

    def candidates(self) -> list[str]:
        """Return the algorithms `--algorithm auto` probes: eager-SGD needs two ranks (with one it is S-SGD), Omnivore
        two groups or more (its one group is S-SGD)."""
        fits = {"eager": self.world.size > 1, "omnivore": self.world.size % 2 == 0}
        return [name for name in AUTO_ALGORITHMS if fits.get(name, True)]

    def _search(self, decision: str, search: Callable[[dict], None], count_time: bool) -> dict | None:
        """Run `search` from a snapshot of the run, in rounds of one global step, then restore the snapshot with the
        best probe's (algorithm, g, μ, η) and record the decision; on a stop signal, restore it as it was and return
        None (collective)."""
        run, started = self.run, time.perf_counter()
        run.settle()
        run.algorithm.drain()
        snapshot, before = run.state_dict(), run.choice
        round_samples, run.round_samples = run.round_samples, run.sampler.step_size(run.learners.k, run.hp.batch_size)
        self.probes = []
        try:
            search(snapshot)
        except SearchStopped:
            run.settle()
            run.algorithm.drain()
            run.switch_algorithm(before["algorithm"], before["groups"])
            run.load_state_dict(snapshot)
            run.round_samples = round_samples
            self.progress.note(f"optimizer ({decision}): stopped by a signal after {len(self.probes)} probes")
            return None
        choice = self.best()
        self.bests.update({p["algorithm"]: self.best(algorithm=p["algorithm"]) for p in self.probes})
        self.start_from(snapshot, choice["algorithm"], choice["groups"], choice["momentum"], choice["lr"])
        run.round_samples = round_samples
        seconds = self.world.bcast_json(time.perf_counter() - started)
        run.state.optimizer_s += seconds
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
            f"optimizer ({decision}): {choice['algorithm']}, {choice['groups']} groups, momentum "
            f"{choice['momentum']}, lr {choice['lr']:g} after {len(self.probes)} probes in {seconds:.1f}s"
        )
        return record

    def best(self, **where) -> dict:
        """Return the probe of the lowest score (among those whose fields have the values in `where`)."""
        chosen = (p for p in self.probes if all(p[key] == value for key, value in where.items()))
        return min(chosen, key=lambda p: p["score"])

    def diverged(self) -> list[tuple[float, float]]:
        """Return the (μ, η) of the probes that diverged."""
        return [(p["momentum"], p["lr"]) for p in self.probes if math.isinf(p["score"])]

    def start_from(self, snapshot: dict, algorithm: str, groups: int, momentum: float, lr: float) -> None:
        """Restore the snapshot with this algorithm, its groups and hyper-parameters (collective)."""
        self.run.switch_algorithm(algorithm, groups)
        self.run.load_state_dict(snapshot)
        self.run.hp.update(momentum=momentum, lr=lr)

    def probe(self, snapshot: dict, algorithm: str, groups: int, momentum: float, lr: float) -> None:
        """Train `--probe-seconds` from the snapshot with (algorithm, g, μ, η); record its score and seconds per
        iteration."""
        run = self.run
        self.start_from(snapshot, algorithm, groups, momentum, lr)
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
            "algorithm": algorithm,
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
        """Take one step, wrapping to the next epoch as the loop does; return this rank's mean learner loss; raise
        SearchStopped when a rank received a stop signal (collective)."""
        run = self.run
        if self.stop():
            raise SearchStopped
        if not run.step_fits():
            run.state.next_epoch()
        return float(run.train_step(lr).losses.mean())

    def world_max(self, value: float) -> float:
        return max(self.world.allgather_json(value))


def _recorded(probe: dict) -> dict:
    """Return a probe for a metrics record: a diverged probe's score is null (strict JSON has no infinity)."""
    return {**probe, "score": probe["score"] if math.isfinite(probe["score"]) else None}
