"""Omnivore's optimizer (`--groups auto`): pick the compute groups g, momentum μ and learning rate η from timed
probes before training, following the released artifact (HazyResearch/Omnivore `omnivore.py`):

1. g = 1 with μ = 0.9 and η ∈ {10, 1, 0.1, 0.01} × `--lr`;
2. then g doubled while it divides the ranks: μ ∈ {0, .3, .6, .9} × η ∈ {η*, η*/10} around the previous g's best, pruned
   as the artifact does (no larger μ at η*, no smaller μ at η*/10, nothing that dominates a diverged point);
3. stop at the first probe of a g that is less than 10 % faster per sample than the previous g's fastest: that g
   is not chosen;
4. train with the (g, μ, η) of the lowest score (ties: exact);
5. every `--optimizer-epoch` seconds of training, search again: the same pruned grid (5 probes) around the current
   (μ, η) at the current g, preferring a larger (η, μ) whose score is within 1 % of the best (the artifact's 1.01
   buffer); when the best μ there is 0 (asynchrony already gives the momentum), train at g/2 with μ = 0.6.

With `--algorithm auto` the same probes choose the algorithm too, among `sma`, `ssgd`, `eager` (majority) and
`omnivore`, by successive halving (Jamieson & Talwalkar 2016, the inner loop of Li et al.'s Hyperband) over the
algorithms, each with its own cold-start search:

- `ssgd` and `sma`: μ = 0.9 and η ∈ {1, 10, 0.1, 0.01} × `--lr`, in this order (Omnivore's g = 1 is S-SGD);
- `eager`: S-SGD's best, then the pruned grid of the first list's step 2 around it (stale rounds act like
  asynchrony);
- `omnivore`: the first list's steps 2 and 3 from g = 2, with S-SGD as g = 1.

1. rung r = 0, 1, 2, …: every remaining algorithm runs the next 2^r probes of its search (fewer when it ends);
2. the worse half (⌊n/2⌋ of n, by each one's lowest score so far; excluded groups do not count; ties keep the
   order above) is dropped; stop at one algorithm, whose search then runs to its end;
3. train with the lowest score's (algorithm, g, μ, η), the last one's unless Omnivore's groups missed the speedup
   after it won: on 4 ranks 4 + 4 probes, then the last one's rest (1 to 7 more), against 23 for the whole grid;
4. every `--optimizer-epoch`: the current algorithm's search of the first list's step 5 (omnivore halving g down to
   2), and every other algorithm once, at its best of the last search (after a resume: at the current μ and η,
   omnivore at 2 groups).

With one rank eager-SGD and Omnivore are S-SGD: only `sma` and `ssgd` are probed (Omnivore needs an even number
of ranks, for two groups or more). A switch of algorithm restarts the momenta at zero and every learner from z
(`Run.load_state_dict`).

Every probe starts from the same in-memory snapshot (`Run.state_dict`) and trains `--probe-seconds` in the
training's own rounds (so the asynchronous groups' straggler tolerance counts in the timing), 6 iterations (steps,
or rounds) or more; its score is the mean training loss over its last 10 iterations, or its second half when
shorter (infinite when it diverged), its hardware efficiency the seconds per sample. Each probe and the choice is
a metrics record `{"event": "optimizer"}` with its algorithm; the search's seconds count as training time, and
the state's `optimizer_s` adds them up.

The ranks vote before every probe step whether any received a stop signal: a stop ends the search there, with the
run back at its snapshot and setting, and no choice; a resumed run searches again from the start (a cold start at
once, a re-tune `--optimizer-epoch` seconds after the resume).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator

from crossbow_mpi.config import Config
from crossbow_mpi.training.rank_run import Run
from crossbow_mpi.training.records import MetricsLog, Progress

COLD_LR_FACTORS = (10.0, 1.0, 0.1, 0.01)
AUTO_LR_FACTORS = (1.0, 10.0, 0.1, 0.01)
"""The same with `--lr` first: the halving's first rung compares the algorithms at the user's setting."""
COLD_MOMENTUM = 0.9
MOMENTA = (0.0, 0.3, 0.6, 0.9)
SCORE_STEPS = 10
TIMING_STEPS = 3
MIN_SPEEDUP = 0.1
COLD_BUFFER, STEADY_BUFFER = 1.0, 1.01
"""The artifact's tie buffer: a probe of larger (η, μ) whose score is within this factor of the best wins."""
RESET_MOMENTUM = 0.6
"""The artifact's momentum at g/2 after a search whose best μ was 0."""
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
    """Return the (μ, η) points to probe around the best so far, less those that dominate a diverged point."""
    points = []
    for lr in (best_lr, best_lr / 10):
        for momentum in MOMENTA:
            if (lr == best_lr and momentum > best_momentum) or (lr < best_lr and momentum < best_momentum):
                continue
            if not dominates((momentum, lr), diverged):
                points.append((momentum, lr))
    return points


def dominates(point: tuple[float, float], diverged: list[tuple[float, float]]) -> bool:
    """Tell whether (μ, η) is at least as large in both as a point that diverged."""
    return any(point[0] >= m and point[1] >= r for m, r in diverged)


def preferred(probes: list[dict], buffer: float) -> dict:
    """Return the probe of the lowest score, or the one of the largest (η, μ) among those of no smaller η whose
    score is within `buffer` times it (the artifact's tie-break toward larger hyper-parameters)."""
    best = min(probes, key=lambda p: p["score"])
    if not math.isfinite(best["score"]):
        return best
    close = [p for p in probes if p["lr"] >= best["lr"] and p["score"] <= best["score"] * buffer]
    return max(close, key=lambda p: (p["lr"], p["momentum"]))


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
        self.buffer = COLD_BUFFER
        self.excluded: set[int] = set()
        """Groups that missed the hardware-efficiency threshold in this search (not chosen)."""
        self.eliminated: dict[str, int] = {}
        """With `--algorithm auto`: the algorithms the cold start's successive halving dropped, and at which rung."""
        self.bests: dict[str, dict] = {}
        """With `--algorithm auto`: each algorithm's best probe of the last search."""

    def choose(self) -> dict | None:
        """Probe from cold, then leave the run at its snapshot with the best (algorithm, g, μ, η); return the choice's
        record (None: a stop signal ended the search)."""
        return self._search("choice", self._halving if self.auto else self._cold_start, COLD_BUFFER)

    def retune(self) -> dict | None:
        """Search the pruned grid around the current (g, μ, η), choosing g/2 with μ = 0.6 when the best μ is 0 (with
        `--algorithm auto`, then every other algorithm at its last best); leave the run at its snapshot with the
        choice; return the record (None: a stop signal ended the search)."""
        return self._search("retune", self._recheck if self.auto else self._around_current, STEADY_BUFFER)

    def _cold_start(self, snapshot: dict) -> None:
        """Probe the cold start's learning rates at g = 1, then Omnivore's larger g (`_larger_groups`)."""
        learning_rates = self._learning_rates(snapshot, "omnivore", COLD_LR_FACTORS)
        for _ in itertools.chain(learning_rates, self._larger_groups(snapshot)):
            pass

    def _learning_rates(self, snapshot: dict, algorithm: str, factors: tuple[float, ...]) -> Iterator[dict]:
        """Probe μ = 0.9 with each factor × `--lr` in turn, yielding each probe."""
        for lr in (factor * self.config.lr for factor in factors):
            yield self.probe(snapshot, algorithm, 1, COLD_MOMENTUM, lr)

    def _larger_groups(self, snapshot: dict) -> Iterator[dict]:
        """Probe Omnivore's g = 2, 4, … around the previous g's best, yielding each probe, until the first probe that
        is not 10 % faster per sample than the previous g's fastest (that g is excluded)."""
        for groups in group_counts(self.world.size)[1:]:
            previous = self.at(groups // 2)
            fastest = min(p["s_per_sample"] for p in self.probes if _matches(p, previous))
            best = self.best(**previous)
            for point in self.pruned(best["momentum"], best["lr"]):
                probe = self.probe(snapshot, "omnivore", groups, *point)
                if probe["s_per_sample"] > (1 - MIN_SPEEDUP) * fastest:
                    self.excluded.add(groups)
                yield probe
                if groups in self.excluded:
                    return

    def at(self, groups: int) -> dict:
        """Return the fields of the probes of Omnivore at g groups (with `--algorithm auto`, g = 1 is `ssgd`)."""
        return {"algorithm": "ssgd" if self.auto and groups == 1 else "omnivore", "groups": groups}

    def pruned(self, momentum: float, lr: float):
        """Yield the pruned grid around (μ, η), skipping each point that dominates one diverged so far."""
        for point in grid(momentum, lr, []):
            if not dominates(point, self.diverged()):
                yield point

    def _halving(self, snapshot: dict) -> None:
        """Successive halving over the candidates: each rung runs the next 1, 2, 4, … probes of every remaining
        algorithm's search and drops the worse half by its best score so far; the last one's search runs to its end."""
        arms = {name: self._arm(snapshot, name) for name in self.candidates()}
        rung = 0
        while len(arms) > 1:
            for arm in arms.values():
                for _ in itertools.islice(arm, 2**rung):
                    pass
            ranked = sorted(arms, key=self.arm_score)  # stable: ties keep AUTO_ALGORITHMS' order
            for name in ranked[(len(ranked) + 1) // 2 :]:
                self.eliminated[name] = rung
                del arms[name]
            rung += 1
        for _ in next(iter(arms.values())):
            pass

    def _arm(self, snapshot: dict, algorithm: str) -> Iterator[dict]:
        """Return the algorithm's own cold-start search as probes to come: `sma` and `ssgd` the learning rates at
        μ = 0.9 from `--lr`, `eager` S-SGD's best then the pruned grid around it, `omnivore` its larger g."""
        if algorithm == "eager":
            return self._around_best(snapshot, "eager", "ssgd")
        if algorithm == "omnivore":
            return self._larger_groups(snapshot)
        return self._learning_rates(snapshot, algorithm, AUTO_LR_FACTORS)

    def _around_best(self, snapshot: dict, algorithm: str, of: str) -> Iterator[dict]:
        """Probe the algorithm on the pruned grid around the best of `of` when it starts, that best first (a
        comparison at equal settings), yielding each probe."""
        best = self.best(algorithm=of)
        centre = (best["momentum"], best["lr"])
        rest = (point for point in self.pruned(*centre) if point != centre)
        for point in itertools.chain([centre] if not dominates(centre, self.diverged()) else [], rest):
            yield self.probe(snapshot, algorithm, 1, *point)

    def arm_score(self, algorithm: str) -> float:
        """Return the algorithm's lowest probe score in this search, leaving out excluded groups (infinite: none)."""
        mine = [p for p in self.probes if p["algorithm"] == algorithm and p["groups"] not in self.excluded]
        return min((p["score"] for p in mine), default=math.inf)

    def _around_current(self, snapshot: dict) -> dict | None:
        """Probe the pruned grid around the current (μ, η) at the current g; return the choice when its best μ is 0
        and g can halve: g/2 with μ = 0.6 and the best η (None: the best probe is the choice)."""
        algorithm, groups, hp = self.run.algorithm.name, self.run.choice["groups"], self.run.hp
        for point in self.pruned(hp.momentum, hp.lr):
            self.probe(snapshot, algorithm, groups, *point)
        best = self.best(algorithm=algorithm, groups=groups)
        fewest = 2 if self.auto else 1  # with `--algorithm auto`, g = 1 is the `ssgd` probe
        if algorithm == "omnivore" and best["momentum"] == 0 and groups > fewest:
            return {**best, "groups": groups // 2, "momentum": RESET_MOMENTUM}
        return None

    def _recheck(self, snapshot: dict) -> dict | None:
        """The current algorithm's search around its setting, then every other algorithm at its last best; the
        halving stands when the current algorithm's best is still the best."""
        current, hp = self.run.algorithm.name, self.run.hp
        halved = self._around_current(snapshot)
        for algorithm in self.candidates():
            if algorithm != current:
                fallback = {"groups": 2 if algorithm == "omnivore" else 1, "momentum": hp.momentum, "lr": hp.lr}
                last = self.bests.get(algorithm, fallback)
                self.probe(snapshot, algorithm, last["groups"], last["momentum"], last["lr"])
        return halved if halved is not None and self.best()["algorithm"] == current else None

    def candidates(self) -> list[str]:
        """Return the algorithms `--algorithm auto` probes: eager-SGD needs two ranks (with one it is S-SGD), Omnivore
        two groups or more (its one group is S-SGD)."""
        fits = {"eager": self.world.size > 1, "omnivore": self.world.size % 2 == 0}
        return [name for name in AUTO_ALGORITHMS if fits.get(name, True)]

    def _search(self, decision: str, search: Callable[[dict], dict | None], buffer: float) -> dict | None:
        """Run `search` from a snapshot of the run, then restore the snapshot with the (algorithm, g, μ, η) it
        returns or else the best probe's, and record the decision; on a stop signal, restore it as it was and
        return None (collective)."""
        run, started = self.run, time.perf_counter()
        run.settle()
        run.algorithm.drain()
        snapshot, before = run.state_dict(), run.choice
        self.probes, self.buffer, self.excluded, self.eliminated = [], buffer, set(), {}
        try:
            chosen = search(snapshot)
        except SearchStopped:
            run.settle()
            run.algorithm.drain()
            run.switch_algorithm(before["algorithm"], before["groups"])
            run.load_state_dict(snapshot)
            self.progress.note(f"optimizer ({decision}): stopped by a signal after {len(self.probes)} probes")
            return None
        choice = chosen or self.best()
        self.bests.update({p["algorithm"]: self.best(algorithm=p["algorithm"]) for p in self.probes})
        self.start_from(snapshot, choice["algorithm"], choice["groups"], choice["momentum"], choice["lr"])
        seconds = self.world.bcast_json(time.perf_counter() - started)
        run.state.optimizer_s += seconds  # on the training clock already: it runs from before the cold start
        record = {
            "event": "optimizer",
            "decision": decision,
            **_recorded(choice),
            "probes": len(self.probes),
            "halved": chosen is not None,
            "excluded_groups": sorted(self.excluded),
            "eliminated": self.eliminated,
            "search_s": seconds,
        }
        self.metrics.write(record)
        self.progress.note(
            f"optimizer ({decision}): {choice['algorithm']}, {choice['groups']} groups, momentum "
            f"{choice['momentum']}, lr {choice['lr']:g} after {len(self.probes)} probes in {seconds:.1f}s"
        )
        return record

    def best(self, **where) -> dict:
        """Return the preferred probe (`preferred`, with this search's buffer) among those whose fields have the
        values in `where`, leaving out groups that missed the hardware-efficiency threshold."""
        chosen = [p for p in self.probes if _matches(p, where)]
        return preferred([p for p in chosen if p["groups"] not in self.excluded] or chosen, self.buffer)

    def diverged(self) -> list[tuple[float, float]]:
        """Return the (μ, η) of the probes that diverged."""
        return [(p["momentum"], p["lr"]) for p in self.probes if math.isinf(p["score"])]

    def start_from(self, snapshot: dict, algorithm: str, groups: int, momentum: float, lr: float) -> None:
        """Restore the snapshot with this algorithm, its groups and hyper-parameters (collective)."""
        self.run.switch_algorithm(algorithm, groups)
        self.run.load_state_dict(snapshot)
        self.run.hp.update(momentum=momentum, lr=lr)

    def probe(self, snapshot: dict, algorithm: str, groups: int, momentum: float, lr: float) -> dict:
        """Train `--probe-seconds` from the snapshot with (algorithm, g, μ, η), in the training's rounds; record and
        return its score and seconds per sample."""
        run = self.run
        self.start_from(snapshot, algorithm, groups, momentum, lr)
        started = time.perf_counter()
        steps = [self.step(lr) for _ in range(TIMING_STEPS)]
        s_per_iteration = self.world_max((time.perf_counter() - started) / TIMING_STEPS)
        count = max(2 * TIMING_STEPS, math.ceil(self.config.probe_seconds / s_per_iteration))
        steps += [self.step(lr) for _ in range(count - TIMING_STEPS)]
        run.settle()
        run.algorithm.drain()
        s_per_sample = self.world_max((time.perf_counter() - started) / sum(samples for _, samples in steps))
        losses = [loss for loss, _ in steps[-min(SCORE_STEPS, count // 2) :]]
        total, scored = self.world.allreduce_sum_numbers([sum(losses), len(losses)])
        record = {
            "algorithm": algorithm,
            "groups": groups,
            "momentum": momentum,
            "lr": lr,
            "score": total / scored if math.isfinite(total) else math.inf,
            "s_per_sample": s_per_sample,
            "steps": len(steps),
        }
        self.probes.append(record)
        self.metrics.write({"event": "optimizer", "decision": "probe", **_recorded(record)})
        return record

    def step(self, lr: float) -> tuple[float, int]:
        """Take one step (a round, for an asynchronous algorithm), wrapping to the next epoch as the loop does;
        return this rank's mean learner loss and the step's samples; raise SearchStopped when a rank received a
        stop signal (collective)."""
        run = self.run
        if self.stop():
            raise SearchStopped
        if not run.step_fits():
            run.state.next_epoch()
        step = run.train_step(lr)
        return float(step.losses.mean()), step.samples

    def world_max(self, value: float) -> float:
        return max(self.world.allgather_json(value))


def _matches(probe: dict, where: dict) -> bool:
    return all(probe[key] == value for key, value in where.items())


def _recorded(probe: dict) -> dict:
    """Return a probe for a metrics record: a diverged probe's score is null (strict JSON has no infinity)."""
    return {**probe, "score": probe["score"] if math.isfinite(probe["score"]) else None}
