"""Training over a slow link: 2 nodes × 1 rank, each node's link limited by a token bucket (tc tbf).

The nodes are network namespaces (launch/netns_nodes.sh, needs root); --quick runs on this host's loopback,
without a limit. Variants: per-step SMA; SMA syncing every H steps with `central` and `nesterov` (DiLoCo's outer
step), each with fp32 and bf16 payloads; PyTorch's local SGD (PostLocalSGDOptimizer + PeriodicModelAverager over
gloo, benchmarks/ddp_peer.py) and, where the `torchft` package imports, torchft's DiLoCo (benchmarks/torchft_peer.py)
at the same H (not in --quick); and streamed syncs (nesterov, bf16, 4 fragments; `--sync-delay`
overlaps fp32 syncs only, and is not a variant). Rows: medians over seeds of the time to the target and of the bytes
each rank sent per training sample (`comm_bytes`, the ring allreduce's model for every trainer).
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


@dataclass
class Budget:
    """What a mode trains over which links."""

    rates: tuple[str, ...]
    """tbf rates of each node's link; "host": no namespaces, this host's loopback."""
    local_steps: tuple[int, ...]
    dataset: str
    target_accuracy: float
    epochs: float
    eval_every: int
    timeout_s: float
    wires: tuple[str, ...]
    outers: tuple[str, ...]
    fragments: tuple[int, ...]
    """Streamed variants (nesterov, bf16): fragments F."""
    torchft: bool = True
    """Whether torchft's DiLoCo is a variant where it imports (its lighthouse and managers start in about 15 s)."""


FULL = Budget(
    ("1gbit", "100mbit", "10mbit"),
    (4, 16, 64),
    "mnist",
    0.99,
    10,
    15000,
    3600,
    ("fp32", "bf16"),
    ("central", "nesterov"),
    (4,),
)
QUICK = Budget(("host",), (4,), "synthetic-mnist", 0, 0.005, harness.NEVER, 120, ("bf16",), ("nesterov",), (), False)
FLAGS = {"model": "lenet", "batch_size": 64, "lr": 0.01, "momentum": 0.9, "threads": 1}
COLUMNS = ["link", "variant", "reached", "tta_s", "accuracy", "comm_bytes_per_sample", "vs_sma"]


def variants(budget: Budget) -> dict[str, tuple[str, dict]]:
    """Each variant's trainer and flags."""
    found = {"sma H=1": ("crossbow", {"algorithm": "sma", "learners": 1})}
    for h in budget.local_steps:
        for outer in budget.outers:
            for wire in budget.wires:
                flags = {"algorithm": "sma", "learners": 1, "sync_every": h, "outer_optimizer": outer}
                found[f"sma H={h} {outer} {wire}"] = ("crossbow", {**flags, "sync_dtype": wire})
        for f in budget.fragments:
            streamed = {"outer_optimizer": "nesterov", "sync_dtype": "bf16", "fragments": f}
            flags = {"algorithm": "sma", "learners": 1, "sync_every": h, **streamed}
            found[f"sma H={h} nesterov bf16 F={f}"] = ("crossbow", flags)
        found[f"local-sgd H={h}"] = ("ddp", {"local_sgd_every": h})
        if TORCHFT and budget.torchft:
            found[f"torchft-diloco H={h}"] = ("torchft", {"diloco_every": h})
    return found


class Link:
    """Two namespace nodes whose links are limited to `rate`; `wrap` launches an mpirun command on them."""

    def __init__(self, rate: str, directory: Path):
        self.prefix = f"cbs{os.getpid() % 100000}"
        self.hostfile = directory / "hostfile"
        self.hostfile.write_text("".join(f"{self.prefix}-{i} slots=1\n" for i in range(NODES)))
        self.script("up", self.prefix, str(NODES), SUBNET)
        self.script("rate", self.prefix, str(NODES), rate)

    def script(self, *args: str) -> None:
        subprocess.run(["bash", str(SCRIPT), *args], check=True, capture_output=True, timeout=60)

    def wrap(self, command: list[str]) -> list[str]:
        mpirun, ranks = command[:3], command[3:4]
        assert ranks == ["--oversubscribe"]
        network = f"{SUBNET}.0/24"
        return [
            "bash", str(SCRIPT), "head", self.prefix, *mpirun, "--hostfile", str(self.hostfile),
            "--mca", "plm_rsh_agent", f"{SCRIPT} rsh",
            "--mca", "oob_tcp_if_include", network, "--mca", "btl_tcp_if_include", network, *command[4:],
        ]  # fmt: skip

    def close(self) -> None:
        self.script("down", self.prefix, str(NODES))


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    if not options.quick and (os.geteuid() != 0 or shutil.which("ip") is None):
        raise harness.BenchmarkError("the rate-limited nodes are network namespaces: run as root with iproute2")
    rows, runs = [], []
    for rate in budget.rates:
        with tempfile.TemporaryDirectory(prefix="slow-link-") as directory:
            link = None if rate == "host" else Link(rate, Path(directory))
            try:
                mine = link_runs(budget, link, options.reps)
            finally:
                if link is not None:
                    link.close()
        reference = harness.median(harness.column(mine, "sma H=1", "tta_s"))
        for variant in variants(budget):
            row = harness.train_row(mine, variant)
            bytes_per_sample = harness.median(harness.column(mine, variant, "comm_bytes_per_sample"))
            rows.append(
                {
                    "link": rate,
                    "variant": variant,
                    "reached": row["reached"],
                    "tta_s": row["tta_s"],
                    "accuracy": row["accuracy"],
                    "comm_bytes_per_sample": bytes_per_sample,
                    "vs_sma": harness.ratio(reference, row["tta_s"]),
                }
            )
        runs += [{"link": rate, **run} for run in mine]
    return harness.Report(
        question=f"LeNet on {budget.dataset}, {NODES} nodes × 1 rank over a rate-limited link: time to "
        f"{budget.target_accuracy:.0%} and bytes sent per sample; medians, vs_sma = per-step SMA's time / the "
        "variant's",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"flags": FLAGS, "budget": asdict(budget), "nodes": NODES},
    )


def link_runs(budget: Budget, link: Link | None, reps: int) -> list[dict]:
    """Every variant's runs over one link, interleaved."""
    common = {
        **FLAGS,
        "dataset": budget.dataset,
        "target_accuracy": budget.target_accuracy,
        "epochs": budget.epochs,
        "eval_every": budget.eval_every,
    }
    env = None if link is None else {"MASTER_ADDR": f"{SUBNET}.2"}
    wrap = None if link is None else link.wrap

    def run(trainer: str, flags: dict):
        return lambda rep: harness.train(
            trainer, NODES, {**common, **flags, "seed": rep + 1}, budget.timeout_s, wrap=wrap, env=env
        )

    return harness.interleave({name: run(*variant) for name, variant in variants(budget).items()}, reps)


if __name__ == "__main__":
    harness.main(measure)
