"""Hardware limit: achieved training FLOP/s as a fraction of a large float32 matmul's FLOP/s, same cores, same run.

On 2 ranks × 1 thread, crossbow_mpi trains LeNet on MNIST (S-SGD at batch 64 and SMA with 2 learners at batch 16);
training FLOPs per sample are counted with torch.utils.flop_counter.FlopCounterMode over one forward and backward
pass, and multiplied by the measured samples/s of all ranks. The peak is every rank multiplying two n×n float32
matrices at once, summed over ranks; matmul rounds alternate with the training runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from benchmarks import harness

RANKS = 2
TEST_SAMPLES = 1000
CONFIGS = {
    "ssgd k=1 b=64": {"algorithm": "ssgd", "learners": 1, "batch_size": 64},
    "sma k=2 b=16": {"algorithm": "sma", "learners": 2, "batch_size": 16},
}


@dataclass
class Budget:
    """How much a mode trains and multiplies."""

    samples: int
    """Training samples of one run (all ranks)."""
    matmul_n: int
    matmul_calls: int
    timeout_s: float


FULL = Budget(samples=24000, matmul_n=2048, matmul_calls=5, timeout_s=600)
QUICK = Budget(samples=640, matmul_n=256, matmul_calls=2, timeout_s=120)

COLUMNS = ["config", "flops_per_sample", "samples_per_s", "achieved_gflops", "matmul_gflops", "fraction"]


def flops_per_sample(model_fn, train_set, batch: int) -> float:
    """Count the FLOPs of one forward and backward pass over a batch, per sample."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    inputs, targets = train_set.get_batch(torch.arange(batch))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model_fn()(inputs), targets).backward()
    return counter.get_total_flops() / batch


def worker(settings: dict) -> dict:
    """Alternate matmul rounds with training runs of every config; return every run and the FLOPs per sample."""
    import numpy as np
    import torch

    from crossbow_mpi import Config, runtime
    from crossbow_mpi.models import build_model

    MPI = runtime.mpi()
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    train_set, test_set = harness.mnist(TEST_SAMPLES)

    def model_fn():
        return build_model("lenet", train_set.input_shape, train_set.num_classes)

    n = settings["matmul_n"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up

    def matmul(rep: int) -> dict:
        world.Barrier()
        started = time.perf_counter()
        for _ in range(settings["matmul_calls"]):
            a @ b
        rate = np.array([2 * n**3 * settings["matmul_calls"] / (time.perf_counter() - started)])
        world.Allreduce(MPI.IN_PLACE, rate)
        return {"flops_per_s": float(rate[0])}

    def training(config: dict):
        def run(rep: int) -> dict:
            epochs = settings["samples"] / len(train_set)
            cfg = Config(
                **config, lr=0.01, epochs=epochs, target_accuracy=0, eval_every=harness.NEVER, threads=1, seed=rep + 1
            )
            return {"samples_per_s": harness.crossbow_samples_per_s(cfg, model_fn, train_set, test_set)}

        return run

    runs = harness.interleave(
        {"matmul": matmul, **{name: training(config) for name, config in CONFIGS.items()}}, settings["reps"], quiet=True
    )
    return {
        "runs": runs,
        "flops_per_sample": {
            name: flops_per_sample(model_fn, train_set, config["batch_size"]) for name, config in CONFIGS.items()
        },
    }


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    measured = harness.run_worker(options.name, RANKS, {**asdict(budget), "reps": options.reps}, budget.timeout_s)
    runs = measured["runs"]
    peak = harness.median(harness.column(runs, "matmul", "flops_per_s"))
    rows = []
    for name in CONFIGS:
        flops = measured["flops_per_sample"][name]
        rate = harness.median(harness.column(runs, name, "samples_per_s"))
        rows.append(
            {
                "config": name,
                "flops_per_sample": flops,
                "samples_per_s": rate,
                "achieved_gflops": flops * rate / 1e9,
                "matmul_gflops": peak / 1e9,
                "fraction": harness.ratio(flops * rate, peak),
            }
        )
    return harness.Report(
        question=f"Training FLOP/s (FlopCounterMode forward+backward × samples/s) over a {budget.matmul_n}² float32 "
        f"matmul's FLOP/s, LeNet on MNIST, {RANKS} ranks × 1 thread (medians)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={
            "ranks": RANKS,
            "budget": asdict(budget),
            "configs": CONFIGS,
            "flops_per_sample": measured["flops_per_sample"],
        },
    )


if __name__ == "__main__":
    harness.main(measure, worker)
