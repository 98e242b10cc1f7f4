"""Open MPI's TCP connections per pair of ranks (`OMPI_MCA_btl_tcp_links=N`) over a rate-limited link: the trainer's
Allreduce of LeNet's flat state alone, and SMA's training samples/s, with 1 and 2 connections.

    python -m benchmarks.tcp_links [--quick] [--reps 3] [--budget-minutes 30]

2 nodes × 1 rank over the namespaces of benchmarks/slow_link.py (root, iproute2); --quick on this host's loopback,
where the ranks share memory and N changes nothing. The Allreduce is Open MPI's, of random float32 values as many as the
model's flat state (what `MpiCommunicator.allreduce_sum_` called at 2 ranks before its pair exchange), timed `calls`
times a job after two warm-ups by benchmarks/pair_sum.py's worker (method `mpi`); jobs alternate N. `allreduce_s`: the
mean of every call (what a run of syncs pays: over one connection the calls alternate between two durations);
`link_share`: the time the link's rate gives the ring allreduce's bytes (each rank sends 2 (P - 1) / P of the
message, `Network.ring_allreduce_s` without latency) over that mean, above 1 where tbf's 256 kB burst passes at the
veth's speed. `rd_s`, `rd_share`: the same with Open MPI's Allreduce held to recursive doubling
(`RECURSIVE_DOUBLING`). `socket_s`, `socket_share`: the same bytes each way over N plain TCP connections between the
two nodes, without MPI (benchmarks/socket_exchange.py), which tells Open MPI's transport from TCP over tbf.
Training: slow_link's per-step SMA and SMA H=16 nesterov fp32 (its flags, seed 1.. --reps) for a fraction of an
epoch with one evaluation, at the end (`*_vs_one`: samples/s against N = 1's); and at `target_rates`, per-step SMA
to slow_link's target with slow_link's flags (`per_step_tta_vs_one`: N = 1's time / N's). Training runs are kept in
the point store under the phase "RATE links=N", so that they run in chunks (the Allreduce jobs, a minute, run every
time).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import harness, slow_link
from benchmarks.pair_sum import RECURSIVE_DOUBLING, bound_s, floats, worker

NODES = slow_link.NODES
TRAINED = {"per_step": "sma H=1", "h16": "sma H=16 nesterov fp32"}
"""Each trained variant's column prefix, and its name among benchmarks/slow_link.py's variants."""


@dataclass
class Budget:
    """What a mode times over which links."""

    rates: tuple[str, ...]
    """tbf rates of each node's link; "host": no namespaces, this host's loopback."""
    links: tuple[int, ...]
    """`btl_tcp_links` values, alternating."""
    calls: int
    """Timed Allreduces a job."""
    dataset: str
    epochs: dict[str, float]
    """Each trained variant's epochs (by its column prefix): enough syncs for a steady samples/s."""
    timeout_s: float
    target_rates: tuple[str, ...]
    """Where per-step SMA also trains to slow_link's target, with its flags (the longest runs)."""
    target_reps: int
    """Seeds of the runs to the target (at most --reps)."""


FULL = Budget(("100mbit", "10mbit"), (1, 2), 5, "mnist", {"per_step": 0.1, "h16": 0.5}, 900, ("100mbit",), 3)
QUICK = Budget(("host",), (1, 2), 2, "synthetic-mnist", {"per_step": 0.005, "h16": 0.05}, 120, ("host",), 1)
SECONDS_COLUMNS = (
    ("allreduce", "links", "link_share"),
    ("rd", "rd links", "rd_share"),
    ("socket", "sockets", "socket_share"),
)
"""Each timed variant's column prefix, its name in the runs, and its share-of-the-link column."""
COLUMNS = ["link", "tcp_links", *(name for column, _, share in SECONDS_COLUMNS for name in (f"{column}_s", share))]
COLUMNS += ["per_step_samples_per_s", "per_step_vs_one"]
COLUMNS += ["h16_samples_per_s", "h16_vs_one", "per_step_tta_s", "per_step_tta_vs_one"]


def launch(link: slow_link.Link | None, links: int, env: dict | None = None) -> dict:
    """`harness.mpirun`'s `wrap` and `env` for `links` TCP connections a pair over `link`'s nodes (None: this host):
    the variable a user sets (docs/clusters.md), which mpirun passes on to every rank; `env`: more such variables."""
    wrap = None if link is None else link.wrap
    return {"wrap": wrap, "env": {"OMPI_MCA_btl_tcp_links": str(links), **(env or {})}}


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    rows, runs, missing = [], [], []
    for rate in budget.rates:
        with tempfile.TemporaryDirectory(prefix="tcp-links-") as directory:
            link = None if rate == "host" else slow_link.Link(rate, Path(directory))
            try:
                timed = allreduce_runs(options, budget, link)
                timed += socket_runs(options, budget, link, floats("lenet") * 4)
                trained = training_runs(options, budget, rate, link)
                targets = target_runs(options, budget, rate, link)
            finally:
                if link is not None:
                    link.close()
        missing += harness.progress(f"{rate} training", trained, len(TRAINED) * len(budget.links) * options.reps)
        expected = len(budget.links) * min(options.reps, budget.target_reps) * (rate in budget.target_rates)
        missing += harness.progress(f"{rate} to the target", targets, expected)
        rows += link_rows(rate, budget, timed, trained + targets)
        runs += [{"link": rate, **run} for run in timed + trained + targets]
    return harness.Report(
        question=f"{NODES} nodes × 1 rank over a rate-limited link, Open MPI with 1 or 2 TCP connections a pair "
        "(btl_tcp_links): mean seconds per Allreduce of LeNet's flat state (float32), link_share = the "
        "link's rate's time for the ring allreduce's bytes / the mean; rd_s, rd_share: the same with Open MPI's "
        "Allreduce held to recursive doubling; socket_s, socket_share: the same bytes over "
        "plain TCP between the nodes without MPI, over as many connections; training samples/s (medians) of per-step "
        "SMA and SMA H=16 nesterov fp32, *_vs_one = against 1 connection's; per-step SMA's seconds to slow_link's "
        "target, per_step_tta_vs_one = 1 connection's / N's",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"flags": slow_link.FLAGS, "budget": asdict(budget), "trained": TRAINED},
        missing=missing,
    )


def allreduce_runs(options: harness.Options, budget: Budget, link: slow_link.Link | None) -> list[dict]:
    """Each repetition's Allreduce job at every `links` value, the values alternating."""
    settings = {"method": "mpi", "floats": floats("lenet"), "calls": budget.calls}
    jobs = {
        f"{name}links={links}": lambda rep, links=links, env=env: harness.run_worker(
            options.name, NODES, settings, budget.timeout_s, **launch(link, links, env)
        )
        for links in budget.links
        for name, env in (("", None), ("rd ", RECURSIVE_DOUBLING))
    }
    return [{"part": "allreduce", **run} for run in harness.interleave(jobs, options.reps)]


def socket_runs(options: harness.Options, budget: Budget, link: slow_link.Link | None, size: int) -> list[dict]:
    """Each repetition's plain-TCP exchange of `size` bytes over every `links` count of connections, alternating."""
    jobs = {
        f"sockets={links}": lambda rep, links=links: socket_exchange(link, links, size, budget.calls, budget.timeout_s)
        for links in budget.links
    }
    return [{"part": "sockets", **run} for run in harness.interleave(jobs, options.reps)]


def socket_exchange(link: slow_link.Link | None, sockets: int, size: int, calls: int, timeout: float) -> dict:
    """One benchmarks/socket_exchange.py job: node 1 serves, node 0 connects (without `link`: this host's
    loopback); the seconds of each call."""
    host = "127.0.0.1" if link is None else link.address(1)
    base = [sys.executable, "-m", "benchmarks.socket_exchange"]
    counts = [str(sockets), str(size), str(calls)]

    def on(node: int, command: list[str]) -> list[str]:
        return command if link is None else link.on(node, command)

    pipe = subprocess.PIPE
    with subprocess.Popen(
        on(1, [*base, "serve", host, *counts]), cwd=harness.REPO, stdout=pipe, stderr=pipe, text=True
    ) as server:
        try:
            port = server.stdout.readline().strip() if server.stdout else ""
            connect = on(0, [*base, "connect", f"{host}:{port}", *counts])
            client = subprocess.run(connect, cwd=harness.REPO, capture_output=True, text=True, timeout=timeout)
            server.wait(timeout)
        except subprocess.TimeoutExpired as hung:
            raise harness.BenchmarkError(f"socket_exchange ran past {timeout} s", hung=True) from hung
        finally:
            server.kill()
        failed = server.returncode or client.returncode  # a server that failed first leaves the client no port
        why = (server.stderr.read() if server.returncode and server.stderr else client.stderr).strip().splitlines()
    if failed:
        raise harness.BenchmarkError(f"socket_exchange failed: {why[-1] if why else f'exit {failed}'}", failed)
    return {"seconds": json.loads(client.stdout)}


def training_runs(options: harness.Options, budget: Budget, rate: str, link: slow_link.Link | None) -> list[dict]:
    """Each trained variant's runs at every `links` value, from the point store or trained now, seeds interleaved."""
    trained = {prefix: slow_link.throughput_flags(budget.dataset, name) for prefix, name in TRAINED.items()}
    seeded = {
        f"{prefix} links={links}": options.store.seeded(
            f"{rate} links={links}",
            variant.trainer,
            NODES,
            {**flags, "epochs": budget.epochs[prefix]},
            budget.timeout_s,
            launch=launch(link, links),
        )
        for prefix, (variant, flags) in trained.items()
        for links in budget.links
    }
    return [{"part": "training", **run} for run in harness.interleave(seeded, options.reps)]


def target_runs(options: harness.Options, budget: Budget, rate: str, link: slow_link.Link | None) -> list[dict]:
    """Per-step SMA to slow_link's target with its flags at every `links` value, where `rate` is a target rate."""
    if rate not in budget.target_rates:
        return []
    goal = slow_link.QUICK if options.quick else slow_link.FULL
    flags = {**slow_link.common_flags(goal), **slow_link.variants(slow_link.FULL)[TRAINED["per_step"]].flags}
    seeded = {
        f"target links={links}": options.store.seeded(
            f"{rate} links={links}", "crossbow", NODES, flags, goal.timeout_s, launch=launch(link, links)
        )
        for links in budget.links
    }
    return [{"part": "target", **run} for run in harness.interleave(seeded, min(options.reps, budget.target_reps))]


def link_rows(rate: str, budget: Budget, timed: list[dict], trained: list[dict]) -> list[dict]:
    """One row per `links` value over one link."""
    rows = []
    bound = bound_s(rate, floats("lenet"))
    for links in budget.links:
        row: dict = {"link": rate, "tcp_links": links}
        for column, variant, share in SECONDS_COLUMNS:
            mean = mean_seconds(timed, f"{variant}={links}")
            row |= {f"{column}_s": mean, share: harness.ratio(bound, mean)}
        for prefix in TRAINED:
            samples = harness.median(harness.column(trained, f"{prefix} links={links}", "samples_per_s"))
            one = harness.median(harness.column(trained, f"{prefix} links={budget.links[0]}", "samples_per_s"))
            row |= {f"{prefix}_samples_per_s": samples, f"{prefix}_vs_one": harness.ratio(samples, one)}
        tta = harness.median(harness.column(trained, f"target links={links}", "tta_s"))
        one = harness.median(harness.column(trained, f"target links={budget.links[0]}", "tta_s"))
        row |= {"per_step_tta_s": tta, "per_step_tta_vs_one": harness.ratio(one, tta)}
        rows.append(row)
    return rows


def mean_seconds(timed: list[dict], variant: str) -> float:
    """The mean of every timed call of one variant's jobs."""
    return statistics.fmean(second for run in timed if run["variant"] == variant for second in run["seconds"])


if __name__ == "__main__":
    harness.main(measure, worker)
