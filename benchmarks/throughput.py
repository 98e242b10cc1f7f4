"""Throughput at equal algorithm: S-SGD, batch 64 per rank, crossbow_mpi against DDP, on the machine's 2 cores laid
out as 2 ranks × 1 thread and as 1 rank × 2 threads; each also with channels-last weights and batches (DDP too, so
the race stays fair; vs_ddp compares with DDP in the same memory format). In CROSSBOW's regime, 1 rank × 2
threads, SMA's k ∈ {2, 4} learners of batch 64 each on the threads engine race DDP too (issue 38 item 4; --quick:
k = 4 only).

All train the same number of samples with one evaluation at the end, run by run interleaved; samples/s counts
the training steps only (batch fetch, forward, backward, gradient allreduce or sync, update). worst_rep_vs_ddp is
the lowest of each repetition's samples/s over DDP's in the same repetition, so "at or above DDP in every
repetition" reads as worst_rep_vs_ddp ≥ 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import harness

LAYOUTS = {"2 ranks x 1 thread": (2, 1), "1 rank x 2 threads": (1, 2)}
"""Each layout's ranks and threads per rank."""
BATCH = 64
LR = 0.01
SMA_LAYOUT = "1 rank x 2 threads"


@dataclass
class Budget:
    """What a mode trains and how far."""

    model: str
    dataset: str
    epochs: float
    timeout_s: float
    sma_learners: tuple[int, ...]
    """SMA's learners per rank in SMA_LAYOUT, each with batch BATCH."""


FULL = Budget("lenet", "mnist", epochs=0.5, timeout_s=300, sma_learners=(2, 4))
QUICK = Budget("mlp", "synthetic-mnist", epochs=0.02, timeout_s=120, sma_learners=(4,))

COLUMNS = ["layout", "system", "samples_per_s", "min", "max", "vs_ddp", "worst_rep_vs_ddp"]


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
    sma = {f"crossbow sma k={k}": {"algorithm": "sma", "learners": k, "engine": "threads"} for k in budget.sma_learners}
    layouts = {}
    for layout in LAYOUTS:
        for system, extra in systems.items():
            layouts[layout, system] = extra
            if (layout, system) == (SMA_LAYOUT, "ddp"):  # right after their peer: the machine's drift in between
                layouts |= {(layout, name): sma_extra for name, sma_extra in sma.items()}
    variants = {
        (layout, system): harness.seeded(
            system.split()[0], LAYOUTS[layout][0], {**flags, **extra, "threads": LAYOUTS[layout][1]}, budget.timeout_s
        )
        for (layout, system), extra in layouts.items()
    }
    runs = harness.interleave({f"{system} {layout}": run for (layout, system), run in variants.items()}, options.reps)
    rows = []
    for layout, system in variants:
        rates = harness.column(runs, f"{system} {layout}", "samples_per_s")
        peer = "ddp channels-last" if system.endswith("channels-last") else "ddp"
        peer_rates = harness.column(runs, f"{peer} {layout}", "samples_per_s")
        rows.append(
            {
                "layout": layout,
                "system": system,
                "samples_per_s": harness.median(rates),
                "min": min(rates),
                "max": max(rates),
                "vs_ddp": harness.ratio(harness.median(rates), harness.median(peer_rates)),
                "worst_rep_vs_ddp": min(rate / peer_rate for rate, peer_rate in zip(rates, peer_rates, strict=True)),
            }
        )
    return harness.Report(
        question=f"Training samples/s of S-SGD, {budget.model} on {budget.dataset}, batch {BATCH} per rank, "
        f"2 ranks × 1 thread and 1 rank × 2 threads, and of SMA with k ∈ {budget.sma_learners} learners of batch "
        f"{BATCH} on the threads engine in the second (medians; vs_ddp = samples/s / DDP's in the same layout; "
        "worst_rep_vs_ddp = the lowest of the repetitions' ratios)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={
            "layouts": LAYOUTS,
            "sma_layout": SMA_LAYOUT,
            "budget": asdict(budget),
            "flags": flags,
        },
    )


if __name__ == "__main__":
    harness.main(measure)
