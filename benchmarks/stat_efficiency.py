"""Statistical efficiency: epochs to 99 % against the aggregate batch k·P·b on P = 2 ranks, S-SGD and SMA.

S-SGD grows the per-rank batch (k = 1) with the learning rate scaled by the square root of the aggregate batch
(0.01 at 64; linear scaling diverged on LeNet without warm-up at aggregate 512 in the DDP grid). SMA keeps
16 samples per learner (8 at aggregate 16) and adds learners at lr 0.01, with α = min(0.1, 1/(k·P)) so that the
k·P corrections summed into z stay stable. One run per point by default; the plot goes to OUT/stat_efficiency.png.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import harness

RANKS = 2
SMA_BATCH = 16
LR_AT_64 = 0.01


@dataclass
class Budget(harness.Budget):
    """Which aggregate batch sizes to sweep."""

    aggregates: tuple[int, ...]


FULL = Budget("lenet", "mnist", 0.99, 20000, epochs=8, aggregates=(16, 64, 256, 1024), timeout_s=1200)
QUICK = Budget("mlp", "synthetic-mnist", 0.15, 600, epochs=0.02, aggregates=(16, 64), timeout_s=120)

COLUMNS = ["algorithm", "aggregate", "k", "b", "lr", "alpha", "reached", "epochs", "accuracy", "tta_s", "samples_per_s"]


def points(aggregate: int) -> dict[str, dict]:
    """The S-SGD and SMA configurations whose global step takes `aggregate` samples."""
    batch = min(SMA_BATCH, aggregate // RANKS)
    learners = aggregate // (RANKS * batch)
    return {
        "ssgd": {
            "algorithm": "ssgd",
            "learners": 1,
            "batch_size": aggregate // RANKS,
            "lr": LR_AT_64 * (aggregate / 64) ** 0.5,
        },
        "sma": {
            "algorithm": "sma",
            "learners": learners,
            "batch_size": batch,
            "lr": LR_AT_64,
            "alpha": min(0.1, 1 / (learners * RANKS)),
        },
    }


def plot(rows: list[dict], budget: Budget, path: Path) -> list[str]:
    """Draw epochs to the target against the aggregate batch; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algorithm, marker in (("ssgd", "o"), ("sma", "s")):
        mine = [row for row in rows if row["algorithm"] == algorithm]
        reached = [(row["aggregate"], row["epochs"]) for row in mine if row["epochs"] is not None]
        missed = [row["aggregate"] for row in mine if row["epochs"] is None]
        (line,) = ax.plot([x for x, _ in reached], [y for _, y in reached], marker=marker, label=algorithm)
        if missed:
            ax.scatter(
                missed,
                [budget.epochs] * len(missed),
                marker=marker,
                facecolors="none",
                edgecolors=line.get_color(),
                label=f"{algorithm}: not reached in {budget.epochs:g} epochs",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(budget.aggregates, [str(a) for a in budget.aggregates])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("aggregate batch k·P·b")
    ax.set_ylabel(f"epochs to {budget.target_accuracy:.0%}")
    ax.set_title(f"{budget.model} on {budget.dataset}, P = {RANKS}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [str(path)]


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    common = {**budget.flags(), "threads": 1}
    configs = {
        f"{name} aggregate={aggregate}": config
        for aggregate in budget.aggregates
        for name, config in points(aggregate).items()
    }
    runs = harness.interleave(
        {
            name: harness.seeded("crossbow", RANKS, {**common, **config}, budget.timeout_s)
            for name, config in configs.items()
        },
        options.reps,
    )
    rows = [
        {
            "algorithm": config["algorithm"],
            "aggregate": RANKS * config["learners"] * config["batch_size"],
            "k": config["learners"],
            "b": config["batch_size"],
            "lr": config["lr"],
            "alpha": config.get("alpha"),
            **harness.train_row(runs, name),
        }
        for name, config in configs.items()
    ]
    return harness.Report(
        question=f"Epochs to {budget.target_accuracy:.0%} test accuracy against the aggregate batch, "
        f"{budget.model} on {budget.dataset}, {RANKS} ranks × 1 thread (medians; '-': not reached "
        f"within {budget.epochs:g} epochs; accuracy: at the end of the run)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"ranks": RANKS, "budget": asdict(budget), "configs": configs},
        files=plot(rows, budget, options.out / "stat_efficiency.png"),
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=1)
