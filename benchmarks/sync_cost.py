"""Sync cost: one SMA step against a raw mpi4py Allreduce of a float32 buffer of the model's size, against the
memory it must move, and against the optimizer a user would otherwise run.

The SMA step (2 learners per rank) is everything crossbow_mpi does per iteration after the gradients: the
learners' momentum update, the corrections, their local sum, the allreduce of [corrections | buffers] and the
central update; `fused_step` is the same with `--fused-step`. Each time is the mean over a loop of calls on the
slowest rank; rounds alternate the variants.

- memory_ratio: the fused step on this rank alone (its allreduce over one rank) against a copy of the bytes the
  step must move (read w, v, g, z and write w, v and the corrections; sum the corrections; update z and u), at
  the copy bandwidth measured in the same rounds. Goal: at most 1.3.
- peer_ratio: the fused step against `torch.optim.SGD(foreach=True)` stepping the same k replicas plus one
  Allreduce of the model. Goal: at most 1.2.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from benchmarks import harness

MODELS = {"lenet": (1, 28, 28), "resnet32": (3, 32, 32)}
LEARNERS = 2


@dataclass
class Budget:
    """How long a mode times."""

    ranks: tuple[int, ...]
    calls: int
    """Calls per timed loop; --reps loops of each variant alternate."""
    timeout_s: float


FULL = Budget(ranks=(2, 4), calls=50, timeout_s=300)
QUICK = Budget(ranks=(2,), calls=3, timeout_s=300)

COLUMNS = [
    "ranks",
    "model",
    "floats",
    "sma_step_us",
    "fused_step_us",
    "allreduce_us",
    "ratio",
    "memory_ratio",
    "peer_ratio",
]
VARIANTS = ("sma_step", "fused_step", "allreduce", "fused_alone", "copy", "peer")


def floats_moved(k: int, n: int) -> int:
    """Floats an SMA step of k learners over n-float models must read or write: the learners' step reads w, v, g
    and z and writes w, v and the corrections; the sync sums the corrections into one message and updates z and u
    (dz += μ u, u = dz, z += dz)."""
    return (6 * k + 1) * n + (k + 1) * n + 7 * n


def worker(settings: dict) -> dict:
    """Time both variants for every model on this job's ranks; return per-model medians and every loop."""
    import torch

    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.runtime import process

    comm = MpiCommunicator(process.mpi().COMM_WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(1)
    results = {}
    for name, shape in MODELS.items():
        floats, variants = _variants(comm, name, shape, settings["calls"])
        for loop in variants.values():
            loop(-1)  # warm up (and compile the fused step)
        runs = harness.interleave(variants, settings["reps"], quiet=True)
        results[name] = {
            "floats": floats,
            "runs": runs,
            **{f"{v}_us": statistics.median(harness.column(runs, v, "us")) for v in VARIANTS},
        }
    return results


def _variants(comm, name: str, shape: tuple, calls: int) -> tuple[int, dict]:
    """Build the model's SMA steps (plain, fused, and fused on this rank alone), the copy and the peer step;
    return the model's floats and each variant's timed loop."""
    import numpy as np
    import torch

    from crossbow_mpi import Config
    from crossbow_mpi.algorithms import SynchronousModelAveraging
    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.models import build_model
    from crossbow_mpi.replicas.flat import FlatLayout
    from crossbow_mpi.replicas.kernels import fuse
    from crossbow_mpi.replicas.learners import CentralModel, Learners
    from crossbow_mpi.replicas.state import HyperParams
    from crossbow_mpi.runtime import process

    MPI = process.mpi()

    def model_fn():
        return build_model(name, shape, 10)

    def sma_over(transport, fused: bool):
        module = model_fn()
        layout = FlatLayout(module)
        central = CentralModel(module, layout)
        learners = Learners(model_fn, layout, central, LEARNERS)
        learners.grads.normal_(std=1e-3)
        sma = SynchronousModelAveraging(HyperParams.from_config(Config()), transport, central, learners)
        if fused:
            fuse(sma, torch.device("cpu"))
        return sma

    sma, fused, alone = sma_over(comm, False), sma_over(comm, True), sma_over(MpiCommunicator(MPI.COMM_SELF), True)
    layout = sma.learners.layout
    buffer = np.ones(layout.num_state, dtype=np.float32)
    source = torch.ones(floats_moved(LEARNERS, layout.num_state) // 2)
    target = torch.empty_like(source)
    replicas = [model_fn() for _ in range(LEARNERS)]
    params = [p for replica in replicas for p in replica.parameters()]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    sgd = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4, foreach=True)

    def peer_step():
        sgd.step()
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, buffer)

    return layout.num_state, {
        "sma_step": _timed(comm, lambda: sma.step(0.01), calls),
        "fused_step": _timed(comm, lambda: fused.step(0.01), calls),
        "allreduce": _timed(comm, lambda: comm.mpi_comm.Allreduce(MPI.IN_PLACE, buffer), calls),
        "fused_alone": _timed(comm, lambda: alone.step(0.01), calls),
        "copy": _timed(comm, lambda: target.copy_(source), calls),
        "peer": _timed(comm, peer_step, calls),
    }


def _timed(comm, call, calls: int):
    """Return a loop that makes `calls` calls and returns the microseconds per call of the slowest rank."""
    import numpy as np

    from crossbow_mpi.runtime import process

    MPI = process.mpi()

    def loop(rep: int) -> dict:
        comm.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed = np.array([(time.perf_counter() - started) / calls])
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, elapsed, op=MPI.MAX)
        return {"us": float(elapsed[0]) * 1e6}

    return loop


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    rows, runs = [], []
    for ranks in budget.ranks:
        harness.log(f"sync_cost: {ranks} ranks")
        measured = harness.run_worker(
            options.name, ranks, {"calls": budget.calls, "reps": options.reps}, budget.timeout_s
        )
        for model, result in measured.items():
            rows.append(
                {
                    "ranks": ranks,
                    "model": model,
                    "floats": result["floats"],
                    "sma_step_us": result["sma_step_us"],
                    "fused_step_us": result["fused_step_us"],
                    "allreduce_us": result["allreduce_us"],
                    "ratio": harness.ratio(result["sma_step_us"], result["allreduce_us"]),
                    "memory_ratio": harness.ratio(result["fused_alone_us"], result["copy_us"]),
                    "peer_ratio": harness.ratio(result["fused_step_us"], result["peer_us"]),
                }
            )
            runs += [{"ranks": ranks, "model": model, **run} for run in result["runs"]]
    return harness.Report(
        question=f"One SMA step ({LEARNERS} learners per rank; fused: --fused-step) against a raw Allreduce of the "
        "model's float32 state, µs per call on the slowest rank (medians of alternating loops; 1 thread per rank, "
        "more ranks than cores oversubscribe them); memory_ratio: the fused step on one rank against a copy of the "
        "bytes it must move (goal <= 1.3); peer_ratio: the fused step against SGD(foreach=True) on the same "
        "replicas plus one Allreduce (goal <= 1.2)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"learners": LEARNERS, "budget": asdict(budget)},
    )


if __name__ == "__main__":
    harness.main(measure, worker, full_reps=7)
