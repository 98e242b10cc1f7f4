"""eager-SGD against S-SGD under the imbalance inherent to a workload, nothing injected: time to the same accuracy.

The paper's gain (Li et al., PPoPP 2020: 1.27× in time to accuracy) comes from video clips of varying length. Here
the `attention` model trains on `synthetic-sequences`, whose batches take the length of their first sample (8 to
64 tokens, log-uniform), so one step costs several times another, on 2 ranks × 1 thread (one rank per core; more
ranks than cores would let a waiting rank's core serve the others). Each variant's learning rate is tuned on one
grid (seed 1, pruned by the best time so far), then its best runs on every seed, and so does S-SGD at each
learning rate an eager mode chose (a control: a gain in time at another learning rate is not eager's own).

The bound: a rank that never waits for the other would step at the mean of the ranks' step costs instead of their
maximum. `ideal_speedup` = E[max] / E[mean] over the ranks, from the bare model's step time at each length (timed
here, one thread) and the training set's lengths; it bounds eager's samples/s over S-SGD's. `eager_wait_ms` is
rank 0's median wait per round for its round to fire (the partial collective's own cost, paid where S-SGD waits
for the slower rank instead).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from benchmarks import eager, harness

RANKS = 2
VARIANTS = ("ssgd", "eager solo", "eager majority")
COLUMNS = ["algorithm", "lr", "reached", "tta_s", "tta_min_s", "tta_max_s", "epochs", "samples_per_s", "speedup"]
COLUMNS += ["samples_speedup", "ideal_speedup", "eager_wait_ms"]


@dataclass
class Budget(eager.Budget):
    """eager's budget, with the model's size and the learning-rate grid."""

    model_args: str
    lr_grid: tuple[float, ...]


FULL = Budget(
    "attention",
    "synthetic-sequences",
    0.88,
    2000,
    epochs=3,
    batch_size=16,
    lr=0.05,
    imbalances={"inherent": ""},
    timeout_s=300,
    model_args="width=128",
    lr_grid=(0.02, 0.05, 0.1),
)
QUICK = Budget(
    "attention",
    "synthetic-sequences",
    0.15,
    300,
    epochs=0.02,
    batch_size=16,
    lr=0.05,
    imbalances={"inherent": ""},
    timeout_s=120,
    model_args="width=32",
    lr_grid=(0.05,),
)


def variant_flags(budget: Budget, name: str, lr: float) -> dict:
    """One variant's training flags at one learning rate: one learner and one thread per rank."""
    return {**eager.common_flags(budget), **eager.ALGORITHMS[name], "lr": lr, "model_args": budget.model_args}


def tune(options: harness.Options, budget: Budget) -> tuple[dict, list[dict]]:
    """Race every variant over the grid on seed 1; return the runs and, once complete, each variant's best lr."""
    pruner = harness.Pruner(options.store, "race", "tta_s", "time_limit")
    points = {f"{name} / lr {lr}": (name, lr) for name in VARIANTS for lr in budget.lr_grid}
    runs = harness.interleave(
        {
            key: pruner.seeded(name, "crossbow", RANKS, variant_flags(budget, name, lr), budget.timeout_s)
            for key, (name, lr) in points.items()
        },
        1,
    )
    if len(runs) < len(points):
        return {}, runs
    return {name: lr for name, lr in harness.best_of(points, runs, lambda point: point[0], "tta_s").values()}, runs


def step_ms(budget: Budget, train_set, lengths: list[int]) -> list[float]:
    """The bare model's training step (forward, backward, SGD) in ms at each length, one thread, median of 20."""
    from crossbow_mpi.data.datasets import SEQUENCE_VOCAB
    from crossbow_mpi.models import build_model

    torch.set_num_threads(1)
    model = build_model(budget.model, train_set.input_shape, train_set.num_classes, budget.model_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for length in lengths:
        inputs = torch.randint(1, SEQUENCE_VOCAB, (budget.batch_size, length)).float()
        targets = torch.randint(train_set.num_classes, (budget.batch_size,))
        samples = []
        for _ in range(25):
            started = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            samples.append(time.perf_counter() - started)
        times.append(1e3 * float(np.median(samples[5:])))
    return times


def ideal_speedup(budget: Budget, draws: int = 100_000) -> tuple[float, dict]:
    """E[max] / E[mean] of the ranks' step costs, each rank's batch length drawn from the training set's."""
    from crossbow_mpi.data import build_dataset

    lengths = [8, 12, 16, 24, 32, 48, 64]
    train_set, _ = build_dataset(budget.dataset, "", seed=1)
    costs = step_ms(budget, train_set, lengths)
    drawn = np.random.default_rng(1).choice(train_set.lengths.numpy(), size=(draws, RANKS))
    per_rank = np.interp(drawn, lengths, costs)
    ratio = float(per_rank.max(axis=1).mean() / per_rank.mean())
    return ratio, {"lengths": lengths, "step_ms": costs}


def controls(best: dict) -> dict:
    """S-SGD at each other learning rate an eager mode chose (`ssgd at lr X`), so that a gain in time can be told
    apart from the learning rate's."""
    lrs = {lr for name, lr in best.items() if name != "ssgd" and lr != best.get("ssgd")}
    return {f"ssgd at lr {lr}": ("ssgd", lr) for lr in sorted(lrs)} if "ssgd" in best else {}


def final_rows(finals: dict, runs: list[dict], ideal: float) -> list[dict]:
    """One row per final run key (→ variant, lr), against S-SGD at its best learning rate."""
    reference = harness.train_row(runs, "ssgd")
    rows = []
    for name, (_, lr) in finals.items():
        row = harness.train_row(runs, name)
        lowest, highest = harness.spread(runs, name, "tta_s")
        rows.append(
            {
                "algorithm": name,
                "lr": lr,
                **row,
                "tta_min_s": lowest,
                "tta_max_s": highest,
                "speedup": harness.ratio(reference["tta_s"], row["tta_s"]),
                "samples_speedup": harness.ratio(row["samples_per_s"], reference["samples_per_s"]),
                "ideal_speedup": ideal if name.startswith("eager") else None,
                "eager_wait_ms": harness.median_of([run for run in runs if run["variant"] == name], "eager_wait_ms"),
            }
        )
    return rows


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    ideal, steps = ideal_speedup(budget)
    harness.log(f"eager_inherent: step ms {steps['step_ms']} at lengths {steps['lengths']}; ideal {ideal:.2f}×")
    best, tuning = tune(options, budget)
    finals = {**{name: (name, lr) for name, lr in best.items()}, **controls(best)}
    runs = harness.interleave(
        {
            key: options.store.seeded("race", "crossbow", RANKS, variant_flags(budget, name, lr), budget.timeout_s)
            for key, (name, lr) in finals.items()
        },
        options.reps,
    )
    missing = harness.progress("race", tuning, len(VARIANTS) * len(budget.lr_grid))
    missing += harness.progress("final", runs, len(finals) * options.reps)
    return harness.Report(
        question=f"Time to {budget.target_accuracy:.0%} test accuracy, {budget.model} ({budget.model_args}) on "
        f"{budget.dataset}, {RANKS} ranks × 1 thread, under the workload's own imbalance, each variant at its best "
        "learning rate of one grid (medians with min–max over the seeds; speedup = S-SGD's time / the variant's; "
        "ideal_speedup = E[max] / E[mean] of the ranks' step costs)",
        columns=COLUMNS,
        rows=final_rows(finals, runs, ideal),
        runs=[{"phase": "race", **run} for run in tuning] + [{"phase": "final", **run} for run in runs],
        settings={"ranks": RANKS, "budget": asdict(budget), "step_ms": steps, "ideal_speedup": ideal},
        missing=missing,
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=5)
