"""Throughput at equal algorithm: S-SGD, batch 64 per rank, crossbow_mpi against DDP, on the machine's 2 cores laid
out as 2 ranks × 1 thread and as 1 rank × 2 threads; each also with channels-last weights and batches (DDP too, so
the race stays fair; vs_ddp compares with DDP in the same memory format).

Both train the same number of samples with one evaluation at the end, run by run interleaved; samples/s counts
the training steps only (batch fetch, forward, backward, gradient allreduce, update).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import harness

LAYOUTS = {"2 ranks x 1 thread": (2, 1), "1 rank x 2 threads": (1, 2)}
"""Each layout's ranks and threads per rank."""
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

COLUMNS = ["layout", "system", "samples_per_s", "min", "max", "vs_ddp"]


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
    }
    systems = {"ddp": {}, "crossbow": {"algorithm": "ssgd", "learners": 1}}
    systems |= {f"{name} channels-last": {**extra, "memory_format": "channels_last"} for name, extra in systems.items()}
    variants = {
        (layout, system): harness.seeded(
            system.split()[0], ranks, {**flags, **extra, "threads": threads}, budget.timeout_s
        )
        for layout, (ranks, threads) in LAYOUTS.items()
        for system, extra in systems.items()
    }
    runs = harness.interleave({f"{system} {layout}": run for (layout, system), run in variants.items()}, options.reps)
    rows = []
    for layout, system in variants:
        rates = harness.column(runs, f"{system} {layout}", "samples_per_s")
        peer = "ddp channels-last" if system.endswith("channels-last") else "ddp"
        reference = harness.median(harness.column(runs, f"{peer} {layout}", "samples_per_s"))
        rows.append(
            {
                "layout": layout,
                "system": system,
                "samples_per_s": harness.median(rates),
                "min": min(rates),
                "max": max(rates),
                "vs_ddp": harness.ratio(harness.median(rates), reference),
            }
        )
    return harness.Report(
        question=f"Training samples/s of S-SGD, {budget.model} on {budget.dataset}, batch {BATCH} per rank, "
        "2 ranks × 1 thread and 1 rank × 2 threads (medians; vs_ddp = samples/s / DDP's in the same layout)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"layouts": LAYOUTS, "budget": asdict(budget), "flags": flags},
    )


if __name__ == "__main__":
    harness.main(measure)
