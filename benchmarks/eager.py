"""eager-SGD against S-SGD under load imbalance: time to the same test accuracy, LeNet/MNIST on 4 ranks × 1 thread.

Two injected imbalances: `random` as in the paper (every step one or two ranks, drawn with the seed, sleep a
fixed time) and one slow rank (it takes FACTOR times its own compute), and `none` as the control. Under each,
S-SGD, eager-SGD solo, eager-SGD majority and solo at half the learning rate run with the same seeds,
interleaved repetition by repetition; the table gives medians and the speedup over S-SGD under the same
imbalance (S-SGD's time to accuracy / the algorithm's). The paper's inherent imbalance, with nothing injected,
races in benchmarks/eager_inherent.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import harness

RANKS = 4
ALGORITHMS = {
    "ssgd": {"algorithm": "ssgd"},
    "eager solo": {"algorithm": "eager", "eager_mode": "solo"},
    "eager majority": {"algorithm": "eager", "eager_mode": "majority"},
    "eager solo, lr / 2": {"algorithm": "eager", "eager_mode": "solo", "lr_factor": 0.5},
}
"""Variants; `lr_factor` scales the budget's learning rate (solo's stale gradients need a smaller one)."""


@dataclass
class Budget(harness.Budget):
    """Which imbalances, at which batch size and learning rate."""

    batch_size: int
    lr: float
    imbalances: dict[str, str]
    """Name → `--inject-imbalance` value."""


FULL = Budget(
    "lenet",
    "mnist",
    0.97,
    3200,
    epochs=1,
    batch_size=16,
    lr=0.02,
    imbalances={"none": "", "random": "random:30", "slow rank": f"slow-rank:{RANKS - 1}:1.5"},
    timeout_s=300,
)
QUICK = Budget(
    "mlp",
    "synthetic-mnist",
    0.15,
    600,
    epochs=0.02,
    batch_size=16,
    lr=0.01,
    imbalances={"random": "random:5"},
    timeout_s=120,
)

QUICK_ALGORITHMS = ("ssgd", "eager solo, lr / 2")
"""The variants of `--quick`, to keep it short."""

COLUMNS = ["imbalance", "algorithm", "reached", "tta_s", "epochs", "samples_per_s", "speedup"]


def with_lr(flags: dict, lr: float) -> dict:
    """Return a variant's training flags, its `lr_factor` applied to lr."""
    flags = dict(flags)
    factor = flags.pop("lr_factor", 1.0)
    return {**flags, "lr": lr * factor}


def common_flags(budget: Budget) -> dict:
    """Return the training flags every variant shares: one learner and one thread per rank."""
    return {
        **budget.flags(),
        "batch_size": budget.batch_size,
        "lr": budget.lr,
        "learners": 1,
        "threads": 1,
    }


def imbalanced_runs(name: str, budget: Budget, algorithms: dict[str, dict], reps: int) -> tuple[dict, list[dict]]:
    """Train every algorithm's flags under each of the budget's imbalances on RANKS ranks, `reps` times
    interleaved; return each variant's flags and the runs, the variants named `IMBALANCE / ALGORITHM`."""
    variants = {
        f"{imbalance} / {algorithm}": {**flags, "inject_imbalance": spec}
        for imbalance, spec in budget.imbalances.items()
        for algorithm, flags in algorithms.items()
    }
    harness.log(f"{name}: {len(variants)} variants × {reps} on {RANKS} ranks")
    runs = harness.interleave(
        {variant: harness.seeded("crossbow", RANKS, flags, budget.timeout_s) for variant, flags in variants.items()},
        reps,
    )
    return variants, runs


def speedup_rows(budget: Budget, algorithms, runs: list[dict]) -> list[dict]:
    """One row per imbalance and algorithm: its medians and its speedup over S-SGD under the same imbalance."""
    rows = []
    for imbalance in budget.imbalances:
        reference = harness.train_row(runs, f"{imbalance} / ssgd")["tta_s"]
        for name in algorithms:
            row = harness.train_row(runs, f"{imbalance} / {name}")
            rows.append(
                {"imbalance": imbalance, "algorithm": name, **row, "speedup": harness.ratio(reference, row["tta_s"])}
            )
    return rows


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    common = common_flags(budget)
    names = QUICK_ALGORITHMS if options.quick else tuple(ALGORITHMS)
    algorithms = {name: {**common, **with_lr(ALGORITHMS[name], budget.lr)} for name in names}
    variants, runs = imbalanced_runs("eager", budget, algorithms, options.reps)
    return harness.Report(
        question=f"Time to {budget.target_accuracy:.0%} test accuracy, {budget.model} on {budget.dataset}, {RANKS} "
        "ranks × 1 thread, under injected imbalance (medians; speedup = S-SGD's time / the algorithm's)",
        columns=COLUMNS,
        rows=speedup_rows(budget, names, runs),
        runs=runs,
        settings={"ranks": RANKS, "budget": asdict(budget), "variants": variants},
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=5)
