"""Heterogeneous ranks: fixed and adaptive batch sizes, synchronous and asynchronous, when one rank is slow:
time to the same test accuracy and update-count balance, LeNet/MNIST on 4 ranks × 1 thread, the last rank slower
by factor 2 and by factor 4.

Under each imbalance, S-SGD (fixed batch), eager-SGD majority, Hogbatch (every rank updates the central model on
the server asynchronously, at its own pace, in rounds of `round_samples`), Adaptive Hogbatch, S-SGD with
adaptive batch sizes and adaptive elastic averaging (local steps at each rank's pace, merged by update share every
`round_samples`) run with the same seeds, interleaved repetition by repetition; the table gives medians, the
speedup over S-SGD under the same imbalance (S-SGD's time to accuracy / the algorithm's) and the update balance:
max / min of the ranks' update counts over the run (the asynchronous algorithms' evaluation records), 1.0 for the
synchronous algorithms, where every rank takes every step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import eager, harness

RANKS = eager.RANKS
ALGORITHMS = {
    "ssgd": {"algorithm": "ssgd"},
    "eager majority": {"algorithm": "eager", "eager_mode": "majority"},
    "hogbatch": {"algorithm": "hogbatch", "momentum": 0},
    "hogbatch adaptive": {"algorithm": "hogbatch", "momentum": 0, "adaptive_batch": True, "adapt_every": 1},
    "ssgd adaptive": {"algorithm": "ssgd", "adaptive_batch": True, "adapt_every": 20},
    "elastic": {"algorithm": "elastic", "lr_factor": 0.25},
}
"""Variants; `adapt_every` counts rounds for Hogbatch, steps for S-SGD; `lr_factor` scales the budget's learning
rate (elastic's local steps are single-learner steps of one rank's batch: a quarter of S-SGD's aggregate batch on
4 ranks, so a quarter of its learning rate)."""
ROUNDS = ("hogbatch", "elastic")
"""The algorithms that run in rounds, with per-rank update counts."""


@dataclass
class Budget(eager.Budget):
    """eager's budget, with Hogbatch's round length and the bounds and increment of adaptive batch sizes."""

    round_samples: int
    batch_min: int
    batch_max: int
    batch_step: int


FULL = Budget(
    "lenet",
    "mnist",
    0.98,
    3200,
    epochs=2,
    batch_size=16,
    lr=0.02,
    imbalances={"factor 2": f"slow-rank:{RANKS - 1}:2", "factor 4": f"slow-rank:{RANKS - 1}:4"},
    round_samples=2048,
    batch_min=4,
    batch_max=64,
    batch_step=2,
    timeout_s=900,
)
QUICK = Budget(
    "mlp",
    "synthetic-mnist",
    0.12,
    600,
    epochs=0.02,
    batch_size=16,
    lr=0.01,
    imbalances={"factor 2": f"slow-rank:{RANKS - 1}:2"},
    round_samples=192,
    batch_min=4,
    batch_max=32,
    batch_step=4,
    timeout_s=120,
)

COLUMNS = ["imbalance", "algorithm", "reached", "tta_s", "accuracy", "samples_per_s", "speedup", "update_balance"]


def variant_flags(budget: Budget, flags: dict) -> dict:
    """Return a variant's own training flags with the budget's round length, adaptive-batch bounds and learning
    rate where they apply."""
    flags = dict(flags)
    lr = {"lr": budget.lr * flags.pop("lr_factor")} if "lr_factor" in flags else {}
    rounds = {"round_samples": budget.round_samples} if flags["algorithm"] in ROUNDS else {}
    bounds = ("batch_min", "batch_max", "batch_step")
    adaptive = {key: getattr(budget, key) for key in bounds} if flags.get("adaptive_batch") else {}
    return {**flags, **rounds, **adaptive, **lr}


def update_balance(runs: list[dict], variant: str) -> float | None:
    """Median over an asynchronous variant's runs of max / min of the ranks' update counts (None: a rank made none)."""
    counts = [run["updates"] for run in runs if run["variant"] == variant and "updates" in run]
    return harness.median([harness.ratio(max(c), min(c)) for c in counts])


def plot(rows: list[dict], path: Path) -> list[str]:
    """Draw each variant's time to the target under each imbalance, bars labelled with the update balance; return
    the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    imbalances = list(dict.fromkeys(row["imbalance"] for row in rows))
    width = 0.8 / len(ALGORITHMS)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, name in enumerate(ALGORITHMS):
        mine = {row["imbalance"]: row for row in rows if row["algorithm"] == name}
        xs = [j + (i - (len(ALGORITHMS) - 1) / 2) * width for j in range(len(imbalances))]
        times = [mine[imbalance]["tta_s"] or 0 for imbalance in imbalances]
        bars = ax.bar(xs, times, width, label=name)
        labels = [f"{mine[imbalance]['update_balance'] or 0:.1f}" for imbalance in imbalances]
        ax.bar_label(bars, labels, fontsize=7)
    ax.set_xticks(range(len(imbalances)), [f"slow rank: {imbalance}" for imbalance in imbalances])
    ax.set_ylabel("seconds to the target (0: not reached)")
    ax.set_title("Time to the target accuracy; bar labels: update balance (max / min per rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [str(path)]


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    common = eager.common_flags(budget)
    algorithms = {name: {**common, **variant_flags(budget, flags)} for name, flags in ALGORITHMS.items()}
    variants, runs = eager.imbalanced_runs("hetero", budget, algorithms, options.reps)
    rows = []
    for imbalance in budget.imbalances:
        reference = harness.train_row(runs, f"{imbalance} / ssgd")["tta_s"]
        for name, flags in ALGORITHMS.items():
            variant = f"{imbalance} / {name}"
            row = harness.train_row(runs, variant)
            rows.append(
                {
                    "imbalance": imbalance,
                    "algorithm": name,
                    **row,
                    "speedup": harness.ratio(reference, row["tta_s"]),
                    "update_balance": update_balance(runs, variant) if flags["algorithm"] in ROUNDS else 1.0,
                }
            )
    return harness.Report(
        question=f"Time to {budget.target_accuracy:.0%} test accuracy, {budget.model} on {budget.dataset}, {RANKS} "
        "ranks × 1 thread, one rank slowed, fixed against adaptive batch sizes (medians; speedup = S-SGD's time / "
        "the algorithm's; update_balance = max / min updates per rank). Goals: adaptive ≥ 1.3× faster than "
        "fixed-batch S-SGD at factor 2, update counts balanced within 1.1, no loss of final accuracy",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"ranks": RANKS, "budget": asdict(budget), "variants": variants},
        files=plot(rows, options.out / "hetero.png"),
    )


if __name__ == "__main__":
    harness.main(measure)
