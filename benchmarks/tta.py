"""Time to accuracy: LeNet/MNIST to 99 %, crossbow_mpi against PyTorch DDP, each system at its best of one grid.

    python -m benchmarks.tta [--quick] [--reps 5] [--budget-minutes 45]

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
   at DDP's best b and lr, and DDP at each crossbow_mpi system's best b and lr; and DDP's, S-SGD's and SMA's
   best points again with `--compile` (role "compiled"; the first step compiles, and its seconds count in the
   time to the target), which decides whether `--compile` should be on by default. Rows give the median time,
   its spread (min, max; max "-" when a seed did not reach the target), and the ratio to DDP's best (best
   against best) and to DDP at the same b and lr (for a compiled point: uncompiled DDP).
3. Throughput: ResNet-32 on synthetic CIFAR, samples/s of DDP, S-SGD and SMA at their best points' b, lr, k and
   α in each layout, interleaved, training steps only (`--learners auto` is left out: its k is chosen during
   the run; benchmarks/learners.py measures that).

Duration of the full run (measured 2026-12-01/02, 2 cores, nothing else running; the runs' own seconds,
launches included). The grid has 135 points per layout (15 each for DDP, S-SGD and auto; 90 for SMA), 270 in all:
206 min, 46 s a run (a run reaches 99 % or is stopped near its system's best time, at the first evaluation past
it; the lr 0.16 runs mostly diverge within seconds). The finalists (here 12 variants per layout, a number that
depends on the bests) × 5 seeds run to the target unpruned: 198 min, 99 s a run. The throughput phase, 3 systems ×
2 layouts × 5 seeds: 23 min, 45 s a run. In all ≈ 7 h, so it runs in chunks: `--budget-minutes 45` runs the next
points in the order above until 45 minutes cannot hold another (by the longest run of its phase so far; the first
run of a phase by its 15-minute timeout), keeps every finished run in OUT/tta.points.jsonl with its commit, date
and load, and reports what that store holds (the grid's pruning limits come from the stored runs, so the chunks
add up to one long run); longer budgets waste less at the chunks' ends. `--quick` (mlp, synthetic data, b 16,
1 learning rate, k = 2, α 0.1, the 1 × 2 layout only, 1 seed) checks every phase with 11 launches (the pruning
and the same-setting pairs, which need a second learning rate, are tested on a fake trainer).
"""

from __future__ import annotations

import dataclasses
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
    compiled: tuple[str, ...]
    """The systems whose best point also races among the finalists with `--compile` (both trainers take it), its
    compile time counted in its time to the target: what decides `--compile`'s default."""
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
    compiled=("ddp", "ssgd", "sma"),
    speed_model="resnet32",
    speed_dataset="synthetic-cifar",
    speed_epochs=0.05,
)
QUICK = Budget(
    **harness.QUICK_TRAINING,
    grid_epochs=0.02,
    batch_sizes=(16,),
    lrs_at_16=(0.01,),
    learners=(2,),
    scaled_alpha=False,
    layouts=("1x2",),
    compiled=(),
    speed_model="mlp",
    speed_dataset="synthetic-mnist",
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
    compile: bool = False

    @property
    def name(self) -> str:
        sma = f" k={self.k} alpha={self.alpha:g}" if self.alpha is not None else ""
        return f"{self.layout} {self.system} b={self.b} lr={self.lr:g}{sma}{' compiled' if self.compile else ''}"

    @property
    def trainer(self) -> str:
        return "ddp" if self.system == "ddp" else "crossbow"

    @property
    def ranks(self) -> int:
        return LAYOUTS[self.layout][0]

    def flags(self) -> dict:
        """The training CLI's flags for this point (without the budget's)."""
        flags = {"batch_size": self.b, "lr": self.lr, "threads": LAYOUTS[self.layout][1]}
        if self.compile:
            flags["compile"] = True
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


def finalists(best: dict[tuple[str, str], Point], compiled: tuple[str, ...]) -> dict[str, Point]:
    """Each system's best point, the same-setting pairs with DDP's best, and the `compiled` systems' best points
    with `--compile`, per layout, without repeats."""
    chosen = {}
    for layout in dict.fromkeys(layout for layout, _ in best):
        ddp = best[(layout, "ddp")]
        mine = [best[(layout, system)] for system in SYSTEMS]
        pairs = [p for point in mine[1:] for p in (point.at(ddp), ddp.at(point))]
        compiles = [dataclasses.replace(best[(layout, system)], compile=True) for system in compiled]
        chosen |= {point.name: point for point in mine + pairs + compiles if point.name not in chosen}
    return chosen


def race_rows(phase: str, points: dict[str, Point], runs: list[dict], best: dict, role) -> list[dict]:
    """One row per point: its median time to the target and spread, and its ratio to DDP's best and to DDP at
    the same batch size and learning rate (where that DDP point ran in this phase)."""
    summary = {name: harness.train_row(runs, name) for name in harness.measured(points, runs)}

    def ratio_to(point: Point, ddp: Point | None) -> float | None:
        reference = summary.get(ddp.name, {}).get("tta_s") if ddp else None
        return harness.ratio(summary[point.name]["tta_s"], reference)

    rows = []
    for name, point in harness.measured(points, runs).items():
        low, high = harness.spread(runs, name, "tta_s")
        ddp = best.get((point.layout, "ddp"))
        rows.append(
            {
                **row_keys(phase, role(point), point),
                **summary[name],
                "min": low,
                "max": high,
                "vs_ddp_best": ratio_to(point, ddp),
                "vs_ddp_same": ratio_to(point, ddp and ddp.at(point)),
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


def throughput(store: harness.PointStore, budget: Budget, best: dict, reps: int) -> tuple[list[dict], list[dict]]:
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
            name: store.seeded("throughput", point.trainer, point.ranks, {**flags, **point.flags()}, budget.timeout_s)
            for name, point in points.items()
        },
        reps,
    )
    rows = []
    for name, point in harness.measured(points, runs).items():
        rate = harness.train_row(runs, name)["samples_per_s"]
        ddp = harness.train_row(runs, best[(point.layout, "ddp")].name)["samples_per_s"]
        low, high = harness.spread(runs, name, "samples_per_s")
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
    pruner = harness.Pruner(options.store, "grid", "tta_s", "time_limit")
    grid_flags = {**budget.flags(), "epochs": budget.grid_epochs}
    grid_runs = harness.interleave(
        {
            name: pruner.seeded(
                (point.layout, point.system),
                point.trainer,
                point.ranks,
                {**grid_flags, **point.flags()},
                budget.timeout_s,
            )
            for name, point in points.items()
        },
        GRID_SEEDS,
    )
    best = harness.best_of(points, grid_runs, lambda point: (point.layout, point.system), "tta_s")
    grid_rows = race_rows("grid", points, grid_runs, best, lambda point: "-")
    runs = [{"phase": "grid", **run} for run in grid_runs]
    missing = harness.progress("grid", grid_runs, len(points))
    if missing:
        return report(budget, best, {}, grid_rows, runs, [*missing, "finalists and throughput not started"])
    final = finalists(best, budget.compiled)
    harness.log(f"tta: {len(final)} finalists × {options.reps} seeds")
    final_runs = harness.interleave(
        {
            name: options.store.seeded(
                "final",
                point.trainer,
                point.ranks,
                {**budget.flags(), **point.flags()},
                budget.timeout_s,
                first_seed=GRID_SEEDS + 1,
            )
            for name, point in final.items()
        },
        options.reps,
    )
    speed_rows, speed_runs = throughput(options.store, budget, best, options.reps)
    missing = harness.progress("finalists", final_runs, len(final) * options.reps)
    missing += harness.progress("throughput", speed_runs, len(SPEED_SYSTEMS) * len(budget.layouts) * options.reps)

    def role(point: Point) -> str:
        if point.compile:
            return "compiled"
        return "best" if best[(point.layout, point.system)] == point else "pair"

    rows = grid_rows + race_rows("final", final, final_runs, best, role) + speed_rows
    runs += [{"phase": "final", **run} for run in final_runs] + [{"phase": "throughput", **run} for run in speed_runs]
    return report(budget, best, final, rows, runs, missing)


def report(
    budget: Budget, best: dict, final: dict[str, Point], rows: list[dict], runs: list[dict], missing: list[str]
) -> harness.Report:
    """Report what the point store holds (while the grid is incomplete, `best` is the best so far)."""
    return harness.Report(
        question=f"Time to {budget.target_accuracy:.0%} test accuracy, {budget.model} on {budget.dataset}, "
        f"2 ranks × 1 thread (2x1) and 1 rank × 2 threads (1x2); {budget.speed_model} samples/s on "
        f"{budget.speed_dataset} (medians, min and max; vs_ddp_*: time / DDP's best point's and DDP's at the same "
        "b and lr; throughput rows: samples/s / DDP's)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={
            "layouts": LAYOUTS,
            "budget": asdict(budget),
            "best": {f"{layout} {system}": point.name for (layout, system), point in best.items()},
            "finalists": {name: point.flags() for name, point in final.items()},
        },
        missing=missing,
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=5)
