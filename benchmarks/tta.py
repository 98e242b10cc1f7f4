"""Time to accuracy: LeNet/MNIST to 99 % on 2 ranks × 1 thread, crossbow_mpi against the best PyTorch DDP run.

The DDP peer (benchmarks/ddp_peer.py, S-SGD with momentum over gloo) first runs a grid of per-rank batch sizes ×
two learning rates (scaled linearly with the batch), a run stopping once it has trained longer than the fastest
so far needed; the fastest point is the reference. Then, interleaved repetition by repetition, the reference,
crossbow_mpi S-SGD at the same batch and learning rate, and SMA with 1, 2 and 4 learners per rank and with
`--learners auto` run with the same seeds, evaluation interval and evaluation cost.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from benchmarks import harness

RANKS = 2
LEARNERS = (1, 2, 4)
SMA = {"batch_size": 16, "lr": 0.01}
"""SMA's hyper-parameters: crossbow_mpi's defaults (batch 16 per learner, lr 0.01, α 0.1, μ_z 0.9)."""


@dataclass
class Budget(harness.Budget):
    """The DDP grid's extent."""

    grid_epochs: float
    """Epoch limit of a grid run: a point that needs more is not a contender."""
    batch_sizes: tuple[int, ...]
    """Per-rank batch sizes of the DDP grid, likeliest winner first: a grid run stops (`--time-limit`) once it
    has trained longer than the fastest run so far took to reach the target, since it can no longer win."""
    lrs_at_64: tuple[float, ...]
    """The grid's learning rates at per-rank batch 64, scaled linearly with the batch size."""
    grid_reps: int


FULL = Budget(
    "lenet",
    "mnist",
    0.99,
    15000,
    grid_epochs=3,
    epochs=6,
    batch_sizes=(64, 256, 16),
    lrs_at_64=(0.03, 0.01),
    grid_reps=1,
    timeout_s=900,
)
QUICK = Budget(
    "mlp",
    "synthetic-mnist",
    0.15,
    600,
    grid_epochs=0.02,
    epochs=0.02,
    batch_sizes=(16,),
    lrs_at_64=(0.01, 0.03),
    grid_reps=1,
    timeout_s=120,
)

COLUMNS = ["phase", "system", "algorithm", "k", "b", "lr", "reached", "tta_s", "epochs", "samples_per_s", "vs_ddp"]


def common_flags(budget: Budget, epochs: float) -> dict:
    return {
        "model": budget.model,
        "dataset": budget.dataset,
        "target_accuracy": budget.target_accuracy,
        "eval_every": budget.eval_every,
        "epochs": epochs,
        "threads": 1,
    }


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    grid = {
        f"ddp b={b} lr={lr_64 * b / 64:g}": {"batch_size": b, "lr": lr_64 * b / 64}
        for b in budget.batch_sizes
        for lr_64 in budget.lrs_at_64
    }
    harness.log(f"tta: DDP grid of {len(grid)} points × {budget.grid_reps}")
    best_time = [math.inf]

    def grid_runner(flags: dict):
        def run(rep: int) -> dict:
            limit = {} if math.isinf(best_time[0]) else {"time_limit": best_time[0]}
            result = harness.seeded(
                "ddp", RANKS, {**common_flags(budget, budget.grid_epochs), **flags, **limit}, budget.timeout_s
            )(rep)
            best_time[0] = min(best_time[0], result["tta_s"] or math.inf)
            return result

        return run

    grid_runs = harness.interleave({name: grid_runner(flags) for name, flags in grid.items()}, budget.grid_reps)
    grid_rows = {name: harness.train_row(grid_runs, name) for name in grid}
    best = min(
        grid,
        key=lambda name: (
            grid_rows[name]["tta_s"] or math.inf,
            -max(harness.column(grid_runs, name, "final_accuracy")),
        ),
    )
    harness.log(f"tta: best DDP point {best}; comparison × {options.reps}")

    ssgd = grid[best]
    variants = {"ddp": ("ddp", ssgd), "crossbow ssgd": ("crossbow", {"algorithm": "ssgd", "learners": 1, **ssgd})}
    variants |= {f"crossbow sma k={k}": ("crossbow", {"algorithm": "sma", "learners": k, **SMA}) for k in LEARNERS}
    variants["crossbow sma auto"] = ("crossbow", {"algorithm": "sma", "learners": "auto", **SMA})
    flags = {name: {**common_flags(budget, budget.epochs), **extra} for name, (_, extra) in variants.items()}
    runs = harness.interleave(
        {
            name: harness.seeded(trainer, RANKS, flags[name], budget.timeout_s)
            for name, (trainer, _) in variants.items()
        },
        options.reps,
    )

    rows = [
        {
            "phase": "grid",
            "system": "ddp",
            "algorithm": "ssgd",
            "k": 1,
            "b": point["batch_size"],
            "lr": point["lr"],
            **grid_rows[name],
            "vs_ddp": None,
        }
        for name, point in grid.items()
    ]
    reference = harness.train_row(runs, "ddp")["tta_s"]
    for name, (trainer, _) in variants.items():
        row = harness.train_row(runs, name)
        rows.append(
            {
                "phase": "compare",
                "system": trainer,
                "algorithm": flags[name].get("algorithm", "ssgd"),
                "k": flags[name].get("learners", 1),
                "b": flags[name]["batch_size"],
                "lr": flags[name]["lr"],
                **row,
                "vs_ddp": harness.ratio(row["tta_s"], reference),
            }
        )
    return harness.Report(
        question=f"Time to {budget.target_accuracy:.0%} test accuracy, {budget.model} on {budget.dataset}, "
        f"{RANKS} ranks × 1 thread (medians; vs_ddp = time / best DDP time)",
        columns=COLUMNS,
        rows=rows,
        runs=[{"phase": "grid", **run} for run in grid_runs] + [{"phase": "compare", **run} for run in runs],
        settings={"ranks": RANKS, "budget": asdict(budget), "grid": grid, "best_ddp": best, "variants": flags},
    )


if __name__ == "__main__":
    harness.main(measure)
