"""Hybrid against data parallelism: S-SGD at 4 ranks, DP (4 replicas) against 2 pipelines of M = 2 stages.

Both take batch 32 per replica, so DP's aggregate batch is twice hybrid's; each run is the training CLI, run by
run interleaved. samples/s counts the training steps only; the time to the target includes the evaluations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import harness

RANKS = 4
BATCH = 32
LR = 0.01
VARIANTS = {"dp": {"pipeline_stages": 1}, "hybrid M=2": {"pipeline_stages": 2, "micro_batches": 4, "schedule": "1f1b"}}


@dataclass
class Workload:
    """One model's runs."""

    model: str
    dataset: str
    target_accuracy: float
    """0: throughput only."""
    epochs: float
    eval_every: int
    timeout_s: float


FULL = [
    Workload("lenet", "mnist", target_accuracy=0.98, epochs=3, eval_every=20000, timeout_s=1800),
    Workload("resnet32", "synthetic-cifar", target_accuracy=0, epochs=0.2, eval_every=harness.NEVER, timeout_s=1800),
]
QUICK = [Workload("lenet", "synthetic-mnist", target_accuracy=0, epochs=0.02, eval_every=harness.NEVER, timeout_s=120)]

COLUMNS = ["model", "variant", "reached", "tta_s", "epochs", "samples_per_s", "vs_dp"]


def measure(options: harness.Options) -> harness.Report:
    rows, runs = [], []
    for work in QUICK if options.quick else FULL:
        flags = {
            "algorithm": "ssgd",
            "learners": 1,
            "model": work.model,
            "dataset": work.dataset,
            "batch_size": BATCH,
            "lr": LR,
            "epochs": work.epochs,
            "target_accuracy": work.target_accuracy,
            "eval_every": work.eval_every,
            "threads": 1,
        }
        mine = harness.interleave(
            {
                variant: harness.seeded("crossbow", RANKS, {**flags, **extra}, work.timeout_s)
                for variant, extra in VARIANTS.items()
            },
            options.reps,
        )
        reference = harness.median(harness.column(mine, "dp", "samples_per_s"))
        for variant in VARIANTS:
            row = harness.train_row(mine, variant)
            rows.append(
                {
                    "model": work.model,
                    "variant": variant,
                    **row,
                    "vs_dp": harness.ratio(row["samples_per_s"], reference),
                }
            )
        runs += [{"model": work.model, **run} for run in mine]
    return harness.Report(
        question=f"S-SGD at {RANKS} ranks × 1 thread, batch {BATCH} per replica: data parallelism against 2 "
        "pipelines of 2 stages (4 micro-batches, 1f1b); medians, vs_dp = samples/s / DP's",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={
            "ranks": RANKS,
            "batch": BATCH,
            "lr": LR,
            "variants": VARIANTS,
            "workloads": [asdict(w) for w in (QUICK if options.quick else FULL)],
        },
    )


if __name__ == "__main__":
    harness.main(measure)
