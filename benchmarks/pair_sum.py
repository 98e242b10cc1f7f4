"""Two ranks' sum: Open MPI's Allreduce against `MpiCommunicator.allreduce_sum_`'s pair exchange (one Isend/Irecv
of the message each way and an add, in chunks of `PAIR_CHUNK_BYTES`; the trainer takes it where the two ranks share
no memory), on this host's shared memory and over a rate-limited link between two nodes.

    python -m benchmarks.pair_sum [--quick] [--reps 3]

Methods: `mpi` (Open MPI's Allreduce, its default algorithm), `rd` (the same held to recursive doubling,
`RECURSIVE_DOUBLING`) and `pair` (crossbow_mpi's). Each job sums a float32 vector of N random values per
rank (seeded by the rank) `calls` times after two warm-ups, each call on a fresh copy; jobs alternate the methods.
`*_s`: the mean of every call; `pair_vs_mpi`: mpi's mean / pair's (above 1: pair is faster); `link_share`: the
link rate's time for the bytes each rank sends (the message once) over pair's mean. `same_bits`: every job's sum has
the same SHA-256, whatever the method. Sizes: LeNet's and ResNet-32's flat state, and 4M and 32M floats (the last
in chunks); the links carry LeNet's. Over each link per-step SMA also trains for a tenth of an epoch with
slow_link's flags (seeds 1.. --reps, one evaluation, at the end: `per_step_samples_per_s`), kept in the point store
under the phase "RATE per-step".
"""

from __future__ import annotations

import functools
import hashlib
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import harness, slow_link
from crossbow_mpi.planner.perf_model import Network

RECURSIVE_DOUBLING = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "3"}
"""Open MPI's tuned Allreduce held to recursive doubling (its algorithm 3): at 2 ranks one exchange of the whole
message, where the ring (algorithm 4, as fast here as its default choice) makes two, with a reduction between."""
METHODS = {"mpi": None, "rd": RECURSIVE_DOUBLING, "pair": None}
"""Each method's extra environment for mpirun."""
MODELS = {"lenet": (1, 28, 28), "resnet32": (3, 32, 32)}
"""Models whose flat state (FlatLayout.num_state, 10 classes) is a message size, with their input shapes."""
LARGE = {"4M": 4 << 20, "32M": 32 << 20}
"""Larger messages, in floats."""


@dataclass
class Budget:
    """Which messages a mode sums over which links."""

    host_sizes: tuple[str, ...]
    """Message sizes (MODELS, LARGE) summed on this host (shared memory)."""
    rates: tuple[str, ...]
    """tbf rates of each node's link, where LeNet's message is summed."""
    calls: int
    timeout_s: float
    trained: tuple[str, ...]
    """Links ("host": this host) where per-step SMA also trains, with slow_link's flags."""
    dataset: str
    epochs: float
    """Each training run's epochs: enough syncs for a steady samples/s."""


FULL = Budget(("lenet", "resnet32", "4M", "32M"), ("100mbit", "10mbit"), 10, 600, ("100mbit", "10mbit"), "mnist", 0.1)
QUICK = Budget(("lenet",), (), 2, 120, ("host",), "synthetic-mnist", 0.005)
COLUMNS = ["link", "size", "floats", "mpi_s", "rd_s", "pair_s", "pair_vs_mpi", "link_share", "same_bits"]
COLUMNS += ["per_step_samples_per_s"]


def worker(settings: dict) -> dict:
    """Time `calls` sums of this rank's random vector by one method; return the times and the last sum's digest."""
    import torch

    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.runtime import process

    MPI = process.mpi()
    comm = MpiCommunicator(MPI.COMM_WORLD, pair=True)
    message = torch.randn(settings["floats"], generator=torch.Generator().manual_seed(comm.rank))
    times = []
    for call in range(settings["calls"] + 2):
        vector = message.clone()
        comm.barrier()
        started = time.perf_counter()
        if settings["method"] == "pair":
            comm.allreduce_sum_(vector)
        else:
            comm.mpi_comm.Allreduce(MPI.IN_PLACE, vector.numpy())
        if call >= 2:
            times.append(time.perf_counter() - started)
    return {"seconds": times, "sha256": hashlib.sha256(vector.numpy().tobytes()).hexdigest()}


@functools.cache
def floats(size: str) -> int:
    """A message size's floats."""
    if size in LARGE:
        return LARGE[size]
    from crossbow_mpi.models import build_model
    from crossbow_mpi.replicas.flat import FlatLayout

    return FlatLayout(build_model(size, MODELS[size], 10)).num_state


def bound_s(rate: str, count: int, ranks: int = slow_link.NODES) -> float | None:
    """Seconds the ring allreduce of `count` float32 values needs at the tbf `rate`, by the planner's model without
    latency (None: no limit)."""
    found = re.fullmatch(r"(\d+)([kmg])bit", rate)
    if found is None:
        return None
    gbit_per_s = int(found[1]) * {"k": 1e-6, "m": 1e-3, "g": 1.0}[found[2]]
    return Network.from_link(gbit_per_s, 0).ring_allreduce_s(count * 4, ranks)


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    runs = timed_runs(options, budget, None, budget.host_sizes) + training_runs(options, budget, "host", None)
    for rate in budget.rates:
        with tempfile.TemporaryDirectory(prefix="pair-sum-") as directory:
            link = slow_link.Link(rate, Path(directory))
            try:
                runs += timed_runs(options, budget, link, ("lenet",)) + training_runs(options, budget, rate, link)
            finally:
                link.close()
    expected = len(budget.trained) * options.reps
    missing = harness.progress("training", [run for run in runs if run["part"] == "training"], expected)
    timed = [run for run in runs if run["part"] == "sum"]
    rows = [row(runs, link, size) for link, size in dict.fromkeys((run["link"], run["size"]) for run in timed)]
    return harness.Report(
        question="2 ranks' sum of a float32 vector: mean seconds per call of Open MPI's Allreduce (mpi: its default; "
        "rd: recursive doubling) and crossbow_mpi's pair exchange (MpiCommunicator.allreduce_sum_), on this host "
        "(shared memory) and over a rate-limited link between 2 nodes; pair_vs_mpi = mpi_s / pair_s; link_share = "
        "the link rate's time for the message / pair_s; same_bits: one SHA-256 for every job's sum; "
        "per_step_samples_per_s: per-step SMA's training samples/s over the link (median of the seeds)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"budget": asdict(budget), "methods": METHODS, "flags": slow_link.FLAGS},
        missing=missing,
    )


def timed_runs(options: harness.Options, budget: Budget, link: slow_link.Link | None, sizes) -> list[dict]:
    """Each repetition's job of every method and size, the methods alternating."""
    wrap = None if link is None else link.wrap
    place = "host" if link is None else link.rate
    jobs = {
        f"{method} {size}": lambda rep, method=method, size=size: harness.run_worker(
            options.name,
            2,
            {"method": method, "floats": floats(size), "calls": budget.calls},
            budget.timeout_s,
            wrap=wrap,
            env=METHODS[method],
        )
        for size in sizes
        for method in METHODS
    }
    runs = harness.interleave(jobs, options.reps, quiet=True)
    return [{"part": "sum", "link": place, "size": run["variant"].split()[1], **run} for run in runs]


def training_runs(options: harness.Options, budget: Budget, place: str, link: slow_link.Link | None) -> list[dict]:
    """Per-step SMA's runs over `place` (where budget.trained names it), from the point store or trained now."""
    if place not in budget.trained:
        return []
    variant, flags = slow_link.throughput_flags(budget.dataset, "sma H=1")
    launch = {"wrap": None if link is None else link.wrap}
    seeded = options.store.seeded(
        f"{place} per-step", variant.trainer, 2, {**flags, "epochs": budget.epochs}, budget.timeout_s, launch=launch
    )
    return [
        {"part": "training", "link": place, **run} for run in harness.interleave({"per-step": seeded}, options.reps)
    ]


def row(runs: list[dict], link: str, size: str) -> dict:
    """One message size over one link: each method's mean, and whether every sum had the same bits."""
    mine = [run for run in runs if run["part"] == "sum" and run["link"] == link and run["size"] == size]
    trained = [run for run in runs if run["part"] == "training" and run["link"] == link]
    means = {
        method: statistics.fmean(s for run in mine if run["variant"] == f"{method} {size}" for s in run["seconds"])
        for method in METHODS
    }
    bound = None if link == "host" else bound_s(link, floats(size))
    return {
        "link": link,
        "size": size,
        "floats": floats(size),
        **{f"{method}_s": mean for method, mean in means.items()},
        "pair_vs_mpi": harness.ratio(means["mpi"], means["pair"]),
        "link_share": harness.ratio(bound, means["pair"]),
        "same_bits": len({run["sha256"] for run in mine}) == 1,
        "per_step_samples_per_s": harness.median(harness.column(trained, "per-step", "samples_per_s"))
        if size == "lenet"
        else None,
    }


if __name__ == "__main__":
    harness.main(measure, worker)
