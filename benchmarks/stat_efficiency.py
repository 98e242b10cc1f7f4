"""Statistical efficiency: epochs to 99 % against the aggregate batch k·P·b on P = 2 ranks, S-SGD and SMA, each at
its best learning rate.

    python -m benchmarks.stat_efficiency [--quick] [--reps 3] [--budget-minutes 45]

Does SMA need fewer epochs than S-SGD at the same aggregate batch, for any setting? At each aggregate batch A,
S-SGD trains 1 learner per rank at the per-rank batch b = A/P; SMA keeps b = 16 samples per learner (8 at A = 16)
and trains k = A/(P·b) learners per rank, at α ∈ {0.1, 1/k, 1/(k·P)}.

1. Grid (seed 1): each setting (algorithm, A, k, α) trains at every learning rate {0.0025, 0.005, 0.01, 0.02,
   0.04} × b/16 (per learner for SMA), likeliest first, the settings interleaved point by point. A run stops once
   it has trained as many epochs as its setting's best run so far needed (harness.Pruner), since it can no longer
   win. A setting that diverged at every rate tries half its smallest, up to BELOW_GRID times, until one trains
   (linear scaling puts every rate of S-SGD's b = 512 above its stable range).
2. Finalists (seeds 2 … reps + 1, fresh), interleaved: every setting at its best learning rate (fewest epochs;
   none reaching the target: the most accurate). Rows give the median epochs, their spread (min, max; max "-"
   when a seed did not reach the target) and the ratio to S-SGD's at the same A; settings["answer"] names the
   settings where SMA's median beat S-SGD's. The plot (OUT/stat_efficiency.png) draws the finalists' medians and
   spread.

Duration of the full run (estimated: 2 cores, nothing else running). The grid has 4 aggregates × (5 S-SGD + 15
SMA) = 80 runs, the finalists 4 × 4 settings × 3 seeds = 48; a LeNet run takes ≈ 1.5–2 min with its launch (the
old sweep's 8 runs took 16 min; a diverging run ends early, a pruned one at its setting's best), ≈ 3–4.5 h in all:
5–6 chunks of `--budget-minutes 45` (see benchmarks/tta.py; the store is OUT/stat_efficiency.points.jsonl).
`--quick` (mlp on synthetic data, A = 64, lr 0.01 × b/16, α 0.1, 1 seed) checks
both phases with 4 launches.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import harness

RANKS = 2
SMA_BATCH = 16
ALPHA_RULES = {"0.1": lambda k: 0.1, "1/k": lambda k: 1 / k, "1/kP": lambda k: 1 / (k * RANKS)}
"""SMA's α as a function of its learners per rank k."""
GRID_SEEDS = 1
"""Seeds of the grid (seed 1); the finalists run on the seeds after them."""
BELOW_GRID = 3
"""How many times a setting that diverged at every learning rate it tried halves its smallest one: the grid's
linear scaling with the batch can put every rate of a large batch above its stable range."""


@dataclass
class Budget(harness.Budget):
    """Which aggregate batch sizes, learning rates and α to sweep."""

    aggregates: tuple[int, ...]
    """Aggregate batch sizes k·P·b."""
    lrs_at_16: tuple[float, ...]
    """Learning rates at batch 16, scaled linearly with the (per-learner) batch size, likeliest winner first."""
    alpha_rules: tuple[str, ...]
    """SMA's α rules (of `ALPHA_RULES`)."""


FULL = Budget(
    "lenet",
    "mnist",
    0.99,
    20000,
    epochs=8,
    timeout_s=1200,
    aggregates=(16, 64, 256, 1024),
    lrs_at_16=(0.01, 0.005, 0.02, 0.0025, 0.04),
    alpha_rules=tuple(ALPHA_RULES),
)
QUICK = Budget(**harness.QUICK_TRAINING, aggregates=(64,), lrs_at_16=(0.01,), alpha_rules=("0.1",))

COLUMNS = [
    "phase",
    "algorithm",
    "aggregate",
    "k",
    "b",
    "lr",
    "alpha_rule",
    "alpha",
    "reached",
    "epochs",
    "min",
    "max",
    "vs_ssgd",
    "accuracy",
    "tta_s",
    "samples_per_s",
]


@dataclass(frozen=True)
class Point:
    """One algorithm's settings at one aggregate batch and learning rate."""

    algorithm: str
    aggregate: int
    k: int
    b: int
    lr: float
    alpha_rule: str | None = None

    @property
    def alpha(self) -> float | None:
        return None if self.alpha_rule is None else ALPHA_RULES[self.alpha_rule](self.k)

    @property
    def setting(self) -> tuple:
        """What the grid tunes the learning rate for."""
        return self.algorithm, self.aggregate, self.alpha_rule

    @property
    def name(self) -> str:
        sma = f" alpha={self.alpha_rule}" if self.alpha_rule else ""
        return f"{self.algorithm} aggregate={self.aggregate} k={self.k} b={self.b} lr={self.lr:g}{sma}"

    def flags(self) -> dict:
        """The training CLI's flags for this point (without the budget's)."""
        flags = {"algorithm": self.algorithm, "learners": self.k, "batch_size": self.b, "lr": self.lr}
        return flags | ({} if self.alpha is None else {"alpha": self.alpha})


def grid(budget: Budget) -> list[Point]:
    """Every setting at every learning rate, likeliest first, the settings interleaved point by point."""
    points = []
    for lr_16 in budget.lrs_at_16:
        for aggregate in budget.aggregates:
            ssgd_b, sma_b = aggregate // RANKS, min(SMA_BATCH, aggregate // RANKS)
            k = aggregate // (RANKS * sma_b)
            points.append(Point("ssgd", aggregate, 1, ssgd_b, lr_16 * ssgd_b / 16))
            points += [Point("sma", aggregate, k, sma_b, lr_16 * sma_b / 16, rule) for rule in budget.alpha_rules]
    return points


def below_grid(points: dict[str, Point], runs: list[dict]) -> dict[str, Point]:
    """Each setting whose every run diverged, at half its smallest learning rate."""
    diverged: dict[tuple, bool] = {}
    for run in runs:
        setting = points[run["variant"]].setting
        diverged[setting] = diverged.get(setting, True) and bool(run.get("diverged"))
    lowest: dict[tuple, Point] = {}
    for point in points.values():
        if diverged.get(point.setting) and (point.setting not in lowest or point.lr < lowest[point.setting].lr):
            lowest[point.setting] = point
    halved = [dataclasses.replace(point, lr=point.lr / 2) for point in lowest.values()]
    return {point.name: point for point in halved}


def final_rows(finalists: dict[str, Point], runs: list[dict]) -> list[dict]:
    """One row per finalist with runs: median epochs, their spread, and the ratio to S-SGD's at its aggregate."""
    summary = {name: harness.train_row(runs, name) for name in harness.measured(finalists, runs)}
    ssgd = {point.aggregate: summary.get(name) for name, point in finalists.items() if point.algorithm == "ssgd"}
    rows = []
    for name, point in harness.measured(finalists, runs).items():
        low, high = harness.spread(runs, name, "epochs")
        reference = (ssgd.get(point.aggregate) or {}).get("epochs")
        row = {**row_keys("final", point), **summary[name], "min": low, "max": high}
        rows.append(row | {"vs_ssgd": harness.ratio(row["epochs"], reference)})
    return rows


def row_keys(phase: str, point: Point) -> dict:
    return {
        "phase": phase,
        "algorithm": point.algorithm,
        "aggregate": point.aggregate,
        "k": point.k,
        "b": point.b,
        "lr": point.lr,
        "alpha_rule": point.alpha_rule,
        "alpha": point.alpha,
    }


def answer(rows: list[dict], complete: bool) -> str:
    """Whether SMA needed fewer epochs than S-SGD at the same aggregate batch, for any setting, by the finalists'
    medians ("every seed": SMA's slowest seed beat S-SGD's fastest)."""
    if not complete:
        return "not yet: the finalists are incomplete"
    ssgd = {row["aggregate"]: row for row in rows if row["algorithm"] == "ssgd"}
    wins = []
    for row in rows:
        reference = ssgd[row["aggregate"]]
        if (
            row["algorithm"] == "sma"
            and row["epochs"] is not None
            and (reference["epochs"] or math.inf) > row["epochs"]
        ):
            against = "S-SGD not reaching it" if reference["epochs"] is None else f"S-SGD's {reference['epochs']:.3g}"
            every_seed = row["max"] is not None and row["max"] < (reference["min"] or math.inf)
            setting = f"A = {row['aggregate']}, k = {row['k']}, α = {row['alpha_rule']}"
            wins.append(f"{setting}: {row['epochs']:.3g} against {against}{' (every seed)' if every_seed else ''}")
    if not wins:
        return "no: at no aggregate batch and α did SMA's median epochs beat S-SGD's"
    return "yes, by the median epochs, at " + "; ".join(wins)


def plot(rows: list[dict], budget: Budget, path: Path) -> list[str]:
    """Draw the finalists' median epochs to the target (bars: min to max) against the aggregate batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    lines = dict.fromkeys((row["algorithm"], row["alpha_rule"]) for row in rows)
    for index, ((algorithm, rule), marker) in enumerate(zip(lines, "osD^v", strict=False)):
        mine = [row for row in rows if (row["algorithm"], row["alpha_rule"]) == (algorithm, rule)]
        shift = 2 ** (0.05 * (index - (len(lines) - 1) / 2))  # side by side, so that equal medians stay apart
        reached = [row for row in mine if row["epochs"] is not None]
        label = algorithm if rule is None else f"{algorithm} α={rule}"
        bars = [
            [row["epochs"] - row["min"] for row in reached],
            [(row["max"] or budget.epochs) - row["epochs"] for row in reached],
        ]
        line = ax.errorbar(
            [row["aggregate"] * shift for row in reached],
            [row["epochs"] for row in reached],
            yerr=bars,
            marker=marker,
            capsize=3,
            label=label,
        )
        missed = [row for row in mine if row["epochs"] is None]
        for diverged, how in ((False, f"not reached in {budget.epochs:g} epochs"), (True, "diverged")):
            at = [row["aggregate"] * shift for row in missed if (row["accuracy"] is None) == diverged]
            if at:
                color = line.lines[0].get_color()
                hollow = {"marker": marker, "facecolors": "none", "edgecolors": color}
                style = {"marker": "x", "color": color} if diverged else hollow
                ax.scatter(at, [budget.epochs] * len(at), label=f"{label}: {how}", **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budget.aggregates, [str(a) for a in budget.aggregates])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("aggregate batch k·P·b")
    ax.set_ylabel(f"epochs to {budget.target_accuracy:.0%} (median, min–max)")
    ax.set_title(f"{budget.model} on {budget.dataset}, P = {RANKS}, each at its best lr")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [str(path)]


def run_grid(options: harness.Options, budget: Budget, common: dict) -> tuple[dict[str, Point], list[dict], list[str]]:
    """Run every grid point GRID_SEEDS times, then, up to BELOW_GRID times, the diverged settings at half their
    smallest learning rate (`below_grid`); return the points, their runs and what is missing."""
    points = {point.name: point for point in grid(budget)}
    harness.log(f"stat_efficiency: grid of {len(points)} points")
    pruner = harness.Pruner(options.store, "grid", "epochs", "epochs")

    def tune(grid_points: dict[str, Point]) -> list[dict]:
        return harness.interleave(
            {
                name: pruner.seeded(point.setting, "crossbow", RANKS, {**common, **point.flags()}, budget.timeout_s)
                for name, point in grid_points.items()
            },
            GRID_SEEDS,
        )

    grid_runs = tune(points)
    missing = harness.progress("grid", grid_runs, len(points))
    for _ in range(BELOW_GRID):
        lower = {} if missing else below_grid(points, grid_runs)
        points |= lower
        grid_runs += tune(lower)
        missing = harness.progress("grid", grid_runs, len(points))
    return points, grid_runs, missing


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    common = {**budget.flags(), "threads": 1}
    points, grid_runs, missing = run_grid(options, budget, common)
    grid_rows = [
        {**dict.fromkeys(COLUMNS), **row_keys("grid", point), **harness.train_row(grid_runs, name)}
        for name, point in harness.measured(points, grid_runs).items()
    ]
    runs = [{"phase": "grid", **run} for run in grid_runs]
    best = {} if missing else harness.best_of(points, grid_runs, lambda point: point.setting, "epochs")
    finalists = {point.name: point for point in best.values()}
    if finalists:
        harness.log(f"stat_efficiency: {len(finalists)} finalists × {options.reps} seeds")
    final_runs = harness.interleave(
        {
            name: options.store.seeded(
                "final", "crossbow", RANKS, {**common, **point.flags()}, budget.timeout_s, first_seed=GRID_SEEDS + 1
            )
            for name, point in finalists.items()
        },
        options.reps,
    )
    expected = len(finalists) * options.reps
    missing += harness.progress("finalists", final_runs, expected) if finalists else ["finalists not started"]
    rows = final_rows(finalists, final_runs)
    verdict = answer(rows, not missing)
    harness.log(f"stat_efficiency: does SMA need fewer epochs than S-SGD? {verdict}")
    return harness.Report(
        question=f"Epochs to {budget.target_accuracy:.0%} test accuracy against the aggregate batch, "
        f"{budget.model} on {budget.dataset}, {RANKS} ranks × 1 thread, each setting at its best learning rate "
        f"(final rows: medians, min and max over seeds; '-': not reached within {budget.epochs:g} epochs; "
        "vs_ssgd: epochs / S-SGD's at the same aggregate; accuracy: at the end of the run)",
        columns=COLUMNS,
        rows=rows + grid_rows,
        runs=runs + [{"phase": "final", **run} for run in final_runs],
        settings={
            "ranks": RANKS,
            "budget": asdict(budget),
            "answer": verdict,
            "finalists": {name: point.flags() for name, point in finalists.items()},
        },
        files=plot(rows, budget, options.out / "stat_efficiency.png") if rows else [],
        missing=missing,
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=3)
