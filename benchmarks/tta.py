"""Time to accuracy: LeNet/MNIST to 99 %, crossbow_mpi against PyTorch DDP, each system at its best of one grid.

    python -m benchmarks.tta [--quick] [--reps 5]

The machine's 2 cores run in two layouts: 2 ranks × 1 thread, and 1 rank × 2 threads, CROSSBOW's regime (one
device that a single small-batch learner cannot fill; SMA's learners share it on the threads engine, which
`--engine auto` picks on a CPU rank with several threads, and DDP runs 1 process × 2 threads).

1. Grid (seed 1). In each layout every system, PyTorch DDP (benchmarks/ddp_peer.py), crossbow_mpi S-SGD, SMA
   and SMA with `--learners auto`, trains at every per-rank batch b ∈ {16, 32, 64} and learning rate
   {0.0025, 0.005, 0.01, 0.02, 0.04} × b/16 (per learner for SMA); SMA also at k ∈ {1, 2, 4} learners per rank
   and α ∈ {0.1, 1/(k·P)} (auto: α 0.1). Points run likeliest winner first, the systems interleaved point by
   point. A run stops once it has trained longer than the fastest run of its own system in its layout so far
   took to reach the target, since it can no longer win (`--time-limit`, checked at evaluations, in both
   DDP and crossbow_mpi). No system gets fewer points.
2. Finalists (seeds 2 … reps + 1, fresh: a point that won on seed 1 is not measured on its lucky seed again),
   interleaved: each system's best point, and the same-setting pairs: every crossbow_mpi system's best k and α
   at DDP's best b and lr, and DDP at each crossbow_mpi system's best b and lr. Rows give the median time, its
   spread (min, max; max "-" when a seed did not reach the target), and the ratio to DDP's best (best against
   best) and to DDP at the same b and lr.
3. Throughput: ResNet-32 on synthetic CIFAR, samples/s of DDP, S-SGD and SMA at their best points' b, lr, k and
   α in each layout, interleaved, training steps only (`--learners auto` is left out: its k is chosen during
   the run; benchmarks/learners.py measures that).

Duration of the full run (estimated, not measured: 2 cores, nothing else running). The grid has 135 points per
layout (15 each for DDP, S-SGD and auto; 90 for SMA), 270 in all. A LeNet run costs about 70 s with its launch (the
old grid's 24 runs took 28 min): it reaches 99 % or is stopped near its system's best time (at the first
evaluation past it), so the grid takes ≈ 270 × 70–90 s ≈ 5–7 h. The finalists are
4–10 variants per layout × 5 seeds × ≈ 70 s ≈ 1–2 h; the throughput phase 3 systems × 2 layouts × 5 seeds of
≈ 20 s ≈ 10 min. In all ≈ 7–9 h. `--quick` (mlp, synthetic data, b 16, 2 learning rates, k = 2, α 0.1,
the 1 × 2 layout only, 1 seed) checks every phase with about 15 launches.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from benchmarks import harness

LAYOUTS = {"2x1": (2, 1), "1x2": (1, 2)}
"""Each layout's ranks and threads per rank."""
SYSTEMS = ("ddp", "ssgd", "sma", "sma auto")
SPEED_SYSTEMS = ("ddp", "ssgd", "sma")
"""The systems of the throughput phase (auto's k is chosen during the run)."""
ALPHA = 0.1
"""SMA's α besides 1/(k·P), and auto's (crossbow_mpi's default)."""
GRID_SEEDS = 1
"""Seeds of the grid (seed 1); the finalists run on the seeds after them."""


@dataclass
class Budget(harness.Budget):
    """The grid's extent; `epochs` is the finalists' epoch limit."""

    grid_epochs: float
    """Epoch limit of a grid run: a point that needs more is not a contender."""
    batch_sizes: tuple[int, ...]
    """Per-rank (SMA: per-learner) batch sizes, likeliest winner first."""
    lrs_at_16: tuple[float, ...]
    """Learning rates at batch 16, scaled linearly with the batch size, likeliest winner first."""
    learners: tuple[int, ...]
    """SMA's learners per rank, likeliest winner first."""
    scaled_alpha: bool
    """Also try SMA with α = 1/(k·P) besides α = 0.1."""
    layouts: tuple[str, ...]
    """The layouts (of `LAYOUTS`) it races in."""
    speed_model: str
    speed_dataset: str
    speed_epochs: float
    """Training of a throughput run (one evaluation, at the end)."""


FULL = Budget(
    "lenet",
    "mnist",
    0.99,
    15000,
    epochs=8,
    timeout_s=900,
    grid_epochs=6,
    batch_sizes=(16, 32, 64),
    lrs_at_16=(0.01, 0.005, 0.02, 0.0025, 0.04),
    learners=(2, 1, 4),
    scaled_alpha=True,
    layouts=tuple(LAYOUTS),
    speed_model="resnet32",
    speed_dataset="synthetic-cifar",
    speed_epochs=0.05,
)
QUICK = Budget(
    "mlp",
    "synthetic-mnist",
    0.15,
    600,
    epochs=0.02,
    timeout_s=120,
    grid_epochs=0.02,
    batch_sizes=(16,),
    lrs_at_16=(0.01, 0.02),
    learners=(2,),
    scaled_alpha=False,
    layouts=("1x2",),
    speed_model="mlp",
    speed_dataset="synthetic-cifar",
    speed_epochs=0.01,
)

COLUMNS = [
    "layout",
    "phase",
    "role",
    "system",
    "k",
    "alpha",
    "b",
    "lr",
    "reached",
    "tta_s",
    "min",
    "max",
    "epochs",
    "samples_per_s",
    "vs_ddp_best",
    "vs_ddp_same",
]


@dataclass(frozen=True)
class Point:
    """One system's settings in one layout."""

    layout: str
    system: str
    b: int
    lr: float
    k: int | str = 1
    alpha: float | None = None

    @property
    def name(self) -> str:
        sma = f" k={self.k} alpha={self.alpha:g}" if self.alpha is not None else ""
        return f"{self.layout} {self.system} b={self.b} lr={self.lr:g}{sma}"

    @property
    def trainer(self) -> str:
        return "ddp" if self.system == "ddp" else "crossbow"

    @property
    def ranks(self) -> int:
        return LAYOUTS[self.layout][0]

    def flags(self) -> dict:
        """The training CLI's flags for this point (without the budget's)."""
        flags = {"batch_size": self.b, "lr": self.lr, "threads": LAYOUTS[self.layout][1]}
        if self.system == "ddp":
            return flags
        algorithm = {"algorithm": "ssgd" if self.system == "ssgd" else "sma", "learners": self.k}
        return {**flags, **algorithm, **({} if self.alpha is None else {"alpha": self.alpha})}

    def at(self, other: Point) -> Point:
        """This system's settings at `other`'s batch size and learning rate."""
        return dataclasses.replace(self, b=other.b, lr=other.lr)


def grid(budget: Budget) -> list[Point]:
    """Every system's points in every layout, likeliest winner first, the systems interleaved point by point."""
    points = []
    for b in budget.batch_sizes:
        for lr in (lr_16 * b / 16 for lr_16 in budget.lrs_at_16):
            for layout in budget.layouts:
                ranks = LAYOUTS[layout][0]
                points += [Point(layout, "ddp", b, lr), Point(layout, "ssgd", b, lr)]
                for k in budget.learners:
                    alphas = [ALPHA] + ([1 / (k * ranks)] if budget.scaled_alpha else [])
                    points += [Point(layout, "sma", b, lr, k, alpha) for alpha in dict.fromkeys(alphas)]
                points.append(Point(layout, "sma auto", b, lr, "auto", ALPHA))
    return points


class Pruner:
    """Limit each grid run to the fastest time to the target of its layout's system so far (see the docstring)."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.best_s: dict[tuple, float] = {}

    def limit(self, point: Point) -> dict:
        best = self.best_s.get((point.layout, point.system))
        return {} if best is None else {"time_limit": best}

    def run(self, point: Point, flags: dict):
        """Return a run for `interleave` that trains `point` within its limit and records its time."""

        def run(rep: int) -> dict:
            limit = self.limit(point)
            result = harness.seeded(point.trainer, point.ranks, {**flags, **limit}, self.budget.timeout_s)(rep)
            if result["tta_s"] is not None:
                race = (point.layout, point.system)
                self.best_s[race] = min(self.best_s.get(race, math.inf), result["tta_s"])
            return {"limit": limit, **result}

        return run


def best_points(points: list[Point], rows: dict[str, dict]) -> dict[tuple[str, str], Point]:
    """Each layout's system's fastest point (ties, and no point reaching the target: the most accurate)."""
    best = {}
    for point in points:
        rank = (rows[point.name]["tta_s"] or math.inf, -(rows[point.name]["accuracy"] or 0.0))
        race = (point.layout, point.system)
        if race not in best or rank < best[race][0]:
            best[race] = (rank, point)
    return {race: point for race, (_, point) in best.items()}


def finalists(best: dict[tuple[str, str], Point]) -> dict[str, Point]:
    """Each system's best point and the same-setting pairs with DDP's best, per layout, without repeats."""
    chosen = {}
    for layout in dict.fromkeys(layout for layout, _ in best):
        ddp = best[(layout, "ddp")]
        mine = [best[(layout, system)] for system in SYSTEMS]
        pairs = [p for point in mine[1:] for p in (point.at(ddp), ddp.at(point))]
        chosen |= {point.name: point for point in mine + pairs if point.name not in chosen}
    return chosen


def fresh_seeds(run):
    """Run repetition r with seed r + 2: the grid's seed 1, on which the finalists won, is not used again."""
    return lambda rep: run(rep + GRID_SEEDS)


def spread(runs: list[dict], name: str, key: str) -> tuple[float | None, float | None]:
    """Min and max of `key` over one variant's runs; max None when a run has none (did not reach the target)."""
    values = harness.column(runs, name, key)
    known = [value for value in values if value is not None]
    return (min(known) if known else None), (max(known) if len(known) == len(values) else None)


def race_rows(phase: str, points: dict[str, Point], runs: list[dict], best: dict, role) -> list[dict]:
    """One row per point: its median time to the target and spread, and its ratio to DDP's best and to DDP at
    the same batch size and learning rate (where that DDP point ran in this phase)."""
    summary = {name: harness.train_row(runs, name) for name in points}

    def ratio_to(point: Point, ddp: Point) -> float | None:
        return harness.ratio(summary[point.name]["tta_s"], summary.get(ddp.name, {}).get("tta_s"))

    rows = []
    for name, point in points.items():
        low, high = spread(runs, name, "tta_s")
        ddp = best[(point.layout, "ddp")]
        rows.append(
            {
                **row_keys(phase, role(point), point),
                **summary[name],
                "min": low,
                "max": high,
                "vs_ddp_best": ratio_to(point, ddp),
                "vs_ddp_same": ratio_to(point, ddp.at(point)),
            }
        )
    return rows


def row_keys(phase: str, role: str, point: Point) -> dict:
    return {
        "layout": point.layout,
        "phase": phase,
        "role": role,
        "system": point.system,
        "k": point.k,
        "alpha": point.alpha,
        "b": point.b,
        "lr": point.lr,
    }


def throughput(budget: Budget, best: dict, reps: int) -> tuple[list[dict], list[dict]]:
    """Samples/s of `speed_model` for DDP, S-SGD and SMA at their best points in each layout: rows and runs."""
    flags = {
        "model": budget.speed_model,
        "dataset": budget.speed_dataset,
        "target_accuracy": 0,
        "eval_every": harness.NEVER,
        "epochs": budget.speed_epochs,
    }
    points = {
        best[(layout, system)].name: best[(layout, system)] for layout in budget.layouts for system in SPEED_SYSTEMS
    }
    runs = harness.interleave(
        {
            name: harness.seeded(point.trainer, point.ranks, {**flags, **point.flags()}, budget.timeout_s)
            for name, point in points.items()
        },
        reps,
    )
    rows = []
    for name, point in points.items():
        rate = harness.train_row(runs, name)["samples_per_s"]
        ddp = harness.train_row(runs, best[(point.layout, "ddp")].name)["samples_per_s"]
        low, high = spread(runs, name, "samples_per_s")
        rows.append(
            {
                **dict.fromkeys(COLUMNS),
                **row_keys("throughput", "best", point),
                "samples_per_s": rate,
                "min": low,
                "max": high,
                "vs_ddp_best": harness.ratio(rate, ddp),
            }
        )
    return rows, runs


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    points = {point.name: point for point in grid(budget)}
    harness.log(f"tta: grid of {len(points)} points")
    pruner = Pruner(budget)
    grid_runs = harness.interleave(
        {
            name: pruner.run(point, {**budget.flags(), "epochs": budget.grid_epochs, **point.flags()})
            for name, point in points.items()
        },
        1,
    )
    best = best_points(list(points.values()), {name: harness.train_row(grid_runs, name) for name in points})
    final = finalists(best)
    harness.log(f"tta: {len(final)} finalists × {options.reps} seeds")
    final_runs = harness.interleave(
        {
            name: fresh_seeds(
                harness.seeded(point.trainer, point.ranks, {**budget.flags(), **point.flags()}, budget.timeout_s)
            )
            for name, point in final.items()
        },
        options.reps,
    )
    speed_rows, speed_runs = throughput(budget, best, options.reps)

    def role(point: Point) -> str:
        return "best" if best[(point.layout, point.system)] == point else "pair"

    rows = race_rows("grid", points, grid_runs, best, lambda point: "-") + race_rows(
        "final", final, final_runs, best, role
    )
    return harness.Report(
        question=f"Time to {budget.target_accuracy:.0%} test accuracy, {budget.model} on {budget.dataset}, "
        f"2 ranks × 1 thread (2x1) and 1 rank × 2 threads (1x2); {budget.speed_model} samples/s on "
        f"{budget.speed_dataset} (medians, min and max; vs_ddp_*: time / DDP's best point's and DDP's at the same "
        "b and lr; throughput rows: samples/s / DDP's)",
        columns=COLUMNS,
        rows=rows + speed_rows,
        runs=[{"phase": "grid", **run} for run in grid_runs]
        + [{"phase": "final", **run} for run in final_runs]
        + [{"phase": "throughput", **run} for run in speed_runs],
        settings={
            "layouts": LAYOUTS,
            "budget": asdict(budget),
            "best": {f"{layout} {system}": point.name for (layout, system), point in best.items()},
            "finalists": {name: point.flags() for name, point in final.items()},
        },
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=5)
