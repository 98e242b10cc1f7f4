"""Throughput at equal algorithm: S-SGD, batch 64 per rank, 2 ranks × 1 thread, crossbow_mpi against DDP.

Both train the same number of samples with one evaluation at the end, run by run interleaved; samples/s counts
the training steps only (batch fetch, forward, backward, gradient allreduce, update).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import harness

RANKS = 2
BATCH = 64
LR = 0.01


@dataclass
class Budget:
    """What a mode trains and how far."""

    model: str
    dataset: str
    epochs: float
    timeout_s: float


FULL = Budget("lenet", "mnist", epochs=0.5, timeout_s=300)
QUICK = Budget("mlp", "synthetic-mnist", epochs=0.02, timeout_s=120)

COLUMNS = ["system", "samples_per_s", "min", "max", "vs_ddp"]


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    flags = {
        "model": budget.model,
        "dataset": budget.dataset,
        "batch_size": BATCH,
        "lr": LR,
        "epochs": budget.epochs,
        "target_accuracy": 0,
        "eval_every": harness.NEVER,
        "threads": 1,
    }
    systems = {"ddp": {}, "crossbow": {"algorithm": "ssgd", "learners": 1}}
    runs = harness.interleave(
        {
            system: harness.seeded(system, RANKS, {**flags, **extra}, budget.timeout_s)
            for system, extra in systems.items()
        },
        options.reps,
    )
    reference = harness.median(harness.column(runs, "ddp", "samples_per_s"))
    rows = []
    for system in systems:
        rates = harness.column(runs, system, "samples_per_s")
        rows.append(
            {
                "system": system,
                "samples_per_s": harness.median(rates),
                "min": min(rates),
                "max": max(rates),
                "vs_ddp": harness.ratio(harness.median(rates), reference),
            }
        )
    return harness.Report(
        question=f"Training samples/s of S-SGD, {budget.model} on {budget.dataset}, batch {BATCH} per rank, "
        f"{RANKS} ranks × 1 thread (medians; vs_ddp = samples/s / DDP's)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"ranks": RANKS, "budget": asdict(budget), "flags": flags},
    )


if __name__ == "__main__":
    harness.main(measure)
