"""Training over a slow link: 2 nodes × 1 rank, each node's link limited by a token bucket (tc tbf).

    python -m benchmarks.slow_link [--quick] [--reps 3] [--budget-minutes 45]

The nodes are network namespaces (launch/netns_nodes.sh, needs root), made for a link only while it still has runs
to do; --quick runs on this host's loopback, without a limit. Variants: per-step SMA; SMA syncing every H steps
with `central` and `nesterov` (DiLoCo's outer step), each with fp32, bf16 and int8 payloads (int8: per-block
scales, error feedback; flat MPI, so every SMA variant runs `--hierarchy flat`), and with plain averaging (`sgd`,
outer lr 1, momentum 0: local SGD's algorithm) and an int8 payload; PyTorch's local SGD
(PostLocalSGDOptimizer + PeriodicModelAverager over gloo, benchmarks/ddp_peer.py) and, where the `torchft` package
imports, torchft's DiLoCo (benchmarks/torchft_peer.py) at the same H (not in --quick); and streamed syncs
(nesterov, bf16, 4 fragments) and streamed with overlap (nesterov, fp32, 4 fragments, `--sync-delay` 1: the delay
needs fp32 payloads) at each H where a fragment's sync spans more steps than the delay.

Every run is kept in the point store (OUT/slow_link.points.jsonl), so the grid runs in chunks: the goal variants
(`Budget.first`, the seeds interleaved) link by link in `Budget.rates` order, then the rest, link by link. A run
stops at its first evaluation past `time_limit_s` (not reached). Rows: medians over seeds of the time to the
target and of the bytes each rank sent per training sample (`comm_bytes`, the ring allreduce's model for every
trainer), against per-step SMA and, for SMA at H > 1, against both peers at the same H; `goals` computes issue 35's
goals at `Budget.goal_link`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import harness

TORCHFT = importlib.util.find_spec("torchft") is not None
"""Whether torchft's DiLoCo (benchmarks/torchft_peer.py) is a variant: only where this interpreter imports it."""
SCRIPT = harness.REPO / "launch" / "netns_nodes.sh"
NODES = 2
SUBNET = "10.215.0"
PEERS = {"local-sgd": "vs_local_sgd", "torchft-diloco": "vs_torchft"}
"""Each peer's variant name before " H=…", and its column: the peer's time at the same H / the variant's."""
GOAL_SPEEDUP = 2.0
"""Issue 35: at the goal link, time to the target ≥ 2× faster than per-step SMA's."""
GOAL_FEWER_BYTES = 16.0
"""Issue 35: ≥ 16× fewer bytes per sample than per-step SMA's, at equal final accuracy (both reached the target)."""


@dataclass
class Budget:
    """What a mode trains over which links, in which order."""

    rates: tuple[str, ...]
    """tbf rates of each node's link, in the order they run; "host": no namespaces, this host's loopback."""
    local_steps: tuple[int, ...]
    dataset: str
    target_accuracy: float
    epochs: float
    eval_every: int
    time_limit_s: float
    """A run stops at its first evaluation past this many seconds, not reached (0: no limit)."""
    timeout_s: float
    """A launched job's wall-clock limit: above time_limit_s by an evaluation interval and the start."""
    wires: tuple[str, ...]
    outers: tuple[str, ...]
    fragments: tuple[int, ...]
    """Streamed variants (nesterov, bf16): fragments F."""
    delays: tuple[int, ...]
    """Streamed variants with overlap (nesterov, fp32, each of `fragments`): `--sync-delay` τ, at each H with
    H / F > τ."""
    averaged: tuple[str, ...]
    """Payloads of SMA variants whose outer step is plain averaging (`sgd`, outer lr 1, momentum 0: the algorithm of
    PyTorch's local SGD), at every H."""
    first: tuple[str, ...]
    """The variants each link runs first, the evidence for the goals (those that exist here)."""
    goal_link: str
    torchft: bool = True
    """Whether torchft's DiLoCo is a variant where it imports (its lighthouse and managers start in about 15 s)."""


GOAL_VARIANTS = ("sma H=16 nesterov bf16", "sma H=16 nesterov int8", "sma H=16 central bf16")
GOAL_VARIANTS += ("sma H=16 nesterov bf16 F=4", "local-sgd H=16", "torchft-diloco H=16", "sma H=16 nesterov fp32")
GOAL_VARIANTS += ("sma H=1",)
"""The goals' evidence, run first at each link, in this order: fp32 SMA after the peers' fp32 payloads; per-step SMA
last, the longest run (at 10 Mbit/s it runs to the time limit), since a point store's budget holds a new run by the
longest of its phase so far."""
FULL = Budget(
    ("100mbit", "1gbit", "10mbit"),
    (4, 16, 64),
    "mnist",
    0.99,
    10,
    15000,
    1800,
    2400,
    ("fp32", "bf16", "int8"),
    ("central", "nesterov"),
    (4,),
    (1,),
    ("int8",),
    GOAL_VARIANTS,
    "100mbit",
)
QUICK = Budget(
    ("host",),
    (4,),
    "synthetic-mnist",
    0,
    0.01,
    harness.NEVER,
    0,
    120,
    ("int8",),
    ("nesterov",),
    (),
    (),
    (),
    ("sma H=1", "sma H=4 nesterov int8"),
    "host",
    torchft=False,
)
FLAGS = {"model": "lenet", "batch_size": 64, "lr": 0.01, "momentum": 0.9, "threads": 1}
COLUMNS = ["link", "variant", "reached", "tta_s", "accuracy", "comm_bytes_per_sample", "vs_sma", "fewer_bytes"]
COLUMNS += ["vs_local_sgd", "vs_torchft"]


@dataclass(frozen=True)
class Variant:
    trainer: str
    flags: dict
    h: int
    """Steps between syncs."""


def variants(budget: Budget) -> dict[str, Variant]:
    """Each variant's trainer, flags and H: the goal variants first, then the rest."""
    sma = {"algorithm": "sma", "learners": 1, "hierarchy": "flat"}  # int8 needs flat; 1 rank a node: the same sum
    found = {"sma H=1": Variant("crossbow", sma, 1)}
    for h in budget.local_steps:
        for outer in budget.outers:
            for wire in budget.wires:
                flags = {**sma, "sync_every": h, "outer_optimizer": outer, "sync_dtype": wire}
                found[f"sma H={h} {outer} {wire}"] = Variant("crossbow", flags, h)
        for wire in budget.averaged:
            flags = {**sma, "sync_every": h, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}
            found[f"sma H={h} average {wire}"] = Variant("crossbow", {**flags, "sync_dtype": wire}, h)
        for f in budget.fragments:
            streamed = {"outer_optimizer": "nesterov", "sync_dtype": "bf16", "fragments": f}
            found[f"sma H={h} nesterov bf16 F={f}"] = Variant("crossbow", {**sma, "sync_every": h, **streamed}, h)
            for delay in (delay for delay in budget.delays if h // f > delay):
                overlapped = {**streamed, "sync_dtype": "fp32", "sync_delay": delay}
                flags = {**sma, "sync_every": h, **overlapped}
                found[f"sma H={h} nesterov fp32 F={f} delay={delay}"] = Variant("crossbow", flags, h)
        found[f"local-sgd H={h}"] = Variant("ddp", {"local_sgd_every": h}, h)
        if TORCHFT and budget.torchft:
            found[f"torchft-diloco H={h}"] = Variant("torchft", {"diloco_every": h}, h)
    first = [name for name in budget.first if name in found]
    return {name: found[name] for name in [*first, *(name for name in found if name not in first)]}


NODE_ENV = {"MASTER_ADDR": f"{SUBNET}.2", "GLOO_SOCKET_IFNAME": "eth0"}
"""The gloo peers' environment on the nodes: node 0's address, and the interface gloo listens on (without it gloo
takes the address of the node's hostname, a loopback one, which the other node cannot reach)."""


class Link:
    """Two namespace nodes whose links are limited to `rate`, made at the first launch over them; `wrap` launches
    an mpirun command (`harness.mpirun`'s) on them."""

    def __init__(self, rate: str, directory: Path):
        self.rate, self.prefix, self.made = rate, f"cbs{os.getpid() % 100000}", False
        self.hostfile = directory / "hostfile"
        self.hostfile.write_text("".join(f"{self.prefix}-{i} slots=1\n" for i in range(NODES)))

    def script(self, *args: str) -> None:
        subprocess.run(["bash", str(SCRIPT), *args], check=True, capture_output=True, timeout=60)

    def make(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise harness.BenchmarkError("the rate-limited nodes are network namespaces: run as root with iproute2")
        self.made = True  # before `up`, so that `close` removes half-made namespaces too
        self.script("up", self.prefix, str(NODES), SUBNET)
        self.script("rate", self.prefix, str(NODES), self.rate)
        harness.log(f"slow_link: namespace nodes {self.prefix}-0..{NODES - 1} at {self.rate}")

    def wrap(self, command: list[str]) -> list[str]:
        if not self.made:
            self.make()
        network = f"{SUBNET}.0/24"
        return [
            "bash", str(SCRIPT), "head", self.prefix, command[0], "--hostfile", str(self.hostfile),
            "--mca", "plm_rsh_agent", f"{SCRIPT} rsh",
            "--mca", "oob_tcp_if_include", network, "--mca", "btl_tcp_if_include", network,
            *(arg for arg in command[1:] if arg != "--oversubscribe"),  # a slot a node: one rank each
        ]  # fmt: skip

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 2}"

    def on(self, node: int, command: list[str]) -> list[str]:
        """`command` run inside node `node`'s namespace (no launcher)."""
        if not self.made:
            self.make()
        return ["ip", "netns", "exec", f"{self.prefix}-{node}", *command]

    def close(self) -> None:
        if self.made:
            self.script("down", self.prefix, str(NODES))


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    every = variants(budget)
    first = [name for name in every if name in budget.first]
    stages = {"goal variants": first, "the rest": [name for name in every if name not in first]}
    found: dict[str, list[dict]] = {rate: [] for rate in budget.rates}
    missing = []
    for stage, names in stages.items():
        for rate in budget.rates:
            done, lacking = link_runs(options, budget, rate, {name: every[name] for name in names}, stage)
            found[rate] += done
            missing += lacking
    rows = [row for rate in budget.rates for row in link_rows(rate, every, found[rate])]
    runs = [{"link": rate, **run} for rate in budget.rates for run in found[rate]]
    return harness.Report(
        question=f"LeNet on {budget.dataset}, {NODES} nodes × 1 rank over a rate-limited link: time to "
        f"{budget.target_accuracy:.0%} and bytes sent per sample; medians, vs_sma = per-step SMA's time / the "
        "variant's, fewer_bytes = per-step SMA's bytes per sample / the variant's, vs_PEER = the peer's time at the "
        "same H / the variant's",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"flags": FLAGS, "budget": asdict(budget), "nodes": NODES, "variants": list(every)},
        missing=missing,
        goals=goals(budget, rows),
    )


def link_runs(options: harness.Options, budget: Budget, rate: str, stage: dict[str, Variant], name: str):
    """One link's runs of one stage's variants, the seeds interleaved; and what the store lacks of them."""
    common = common_flags(budget)
    with tempfile.TemporaryDirectory(prefix="slow-link-") as directory:
        link = None if rate == "host" else Link(rate, Path(directory))
        launch = {} if link is None else {"wrap": link.wrap, "env": NODE_ENV}
        try:
            seeded = {
                variant: options.store.seeded(
                    rate, each.trainer, NODES, {**common, **each.flags}, budget.timeout_s, launch=launch
                )
                for variant, each in stage.items()
            }  # fmt: skip
            runs = harness.interleave(seeded, options.reps)
        finally:
            if link is not None:
                link.close()
    return runs, harness.progress(f"{rate} {name}", runs, len(stage) * options.reps)


def throughput_flags(dataset: str, name: str) -> tuple[Variant, dict]:
    """Variant `name` of the full grid, and its flags for a run that measures samples a second on `dataset`: the
    model and batch of every variant, never evaluated."""
    variant = variants(FULL)[name]
    return variant, {**FLAGS, "dataset": dataset, "eval_every": harness.NEVER, **variant.flags}


def common_flags(budget: Budget) -> dict:
    """Every variant's training flags: the model, the data, the target and how long a run may go on."""
    return {
        **FLAGS,
        "dataset": budget.dataset,
        "target_accuracy": budget.target_accuracy,
        "epochs": budget.epochs,
        "eval_every": budget.eval_every,
        "time_limit": budget.time_limit_s,
    }


def link_rows(rate: str, every: dict[str, Variant], runs: list[dict]) -> list[dict]:
    """One row per variant with runs over one link."""
    reference = harness.train_row(runs, "sma H=1")["tta_s"]
    reference_bytes = bytes_per_sample(runs, "sma H=1")
    rows = []
    for name, variant in harness.measured(every, runs).items():
        row = harness.train_row(runs, name)
        sent = bytes_per_sample(runs, name)
        local = variant.trainer == "crossbow" and variant.h > 1
        peers = {
            column: harness.ratio(harness.train_row(runs, f"{peer} H={variant.h}")["tta_s"], row["tta_s"])
            for peer, column in PEERS.items()
        }
        rows.append(
            {
                "link": rate,
                "variant": name,
                "h": variant.h,
                "trainer": variant.trainer,
                "reached": row["reached"],
                "tta_s": row["tta_s"],
                "accuracy": row["accuracy"],
                "comm_bytes_per_sample": sent,
                "vs_sma": harness.ratio(reference, row["tta_s"]),
                "fewer_bytes": harness.ratio(reference_bytes, sent),
                **(peers if local else dict.fromkeys(peers)),
            }
        )
    return rows


def bytes_per_sample(runs: list[dict], name: str) -> float | None:
    """The median bytes per sample of a variant's runs that measured them (a run that diverged did not)."""
    measured = [run for run in runs if "diverged" not in run]
    return harness.median(harness.column(measured, name, "comm_bytes_per_sample"))


def goals(budget: Budget, rows: list[dict]) -> dict:
    """Issue 35's goals at the goal link, among the SMA variants syncing every H > 1 steps that reached the target:
    the fastest against per-step SMA (≥ 2×), the fewest bytes per sample against per-step SMA's where it reached
    the target too (≥ 16× fewer), and at each H the fastest against both peers. None: not measured yet."""
    mine = {row["variant"]: row for row in rows if row["link"] == budget.goal_link}
    local = [row for row in mine.values() if row["trainer"] == "crossbow" and row["h"] > 1 and row["tta_s"]]
    fastest = min(local, key=lambda row: row["tta_s"], default=None)
    reference = mine.get("sma H=1", {}).get("tta_s")
    leanest = max(local, key=lambda row: row["fewer_bytes"], default=None) if reference else None
    found = {
        "link": budget.goal_link,
        "time": threshold(fastest, "vs_sma", GOAL_SPEEDUP),
        "bytes": threshold(leanest, "fewer_bytes", GOAL_FEWER_BYTES),
    }
    for h in budget.local_steps:
        best = min((row for row in local if row["h"] == h), key=lambda row: row["tta_s"], default=None)
        found[f"peers H={h}"] = against_peers(best, mine, [f"{peer} H={h}" for peer in PEERS], variants(budget))
    return found


def against_peers(best: dict | None, rows: dict[str, dict], peers: list[str], every: dict) -> dict:
    """The fastest SMA variant at one H against the peers at that H that are variants here: each one's time, and
    whether it is ahead of all (a peer's time ≥ its, or the peer did not reach the target; None: not measured)."""
    found: dict = {
        "variant": None if best is None else best["variant"],
        "tta_s": None if best is None else best["tta_s"],
    }
    ahead = []
    for peer in (peer for peer in peers if peer in every):
        theirs = rows.get(peer)
        found[peer] = None if theirs is None else theirs["tta_s"]
        measured = best is not None and theirs is not None
        ahead.append(None if not measured else theirs["tta_s"] is None or theirs["tta_s"] >= best["tta_s"])
    return {**found, "met": None if None in ahead else all(ahead)}


def threshold(row: dict | None, key: str, goal: float) -> dict:
    """A goal on one row's `key`: its variant, the value, the goal and whether it is met (None: not measured)."""
    value = None if row is None else row[key]
    variant = None if row is None else row["variant"]
    return {"variant": variant, key: value, "goal": goal, "met": None if value is None else value >= goal}


if __name__ == "__main__":
    harness.main(measure)
