"""Language models: time to a target test loss of tinygpt on `--dataset text`, crossbow_mpi against PyTorch DDP.

    python -m benchmarks.lm [--quick] [--reps 5] [--budget-minutes 45]

The question: does SMA's advantage survive an attention model? Systems: PyTorch DDP (benchmarks/ddp_peer.py),
crossbow_mpi S-SGD, and SMA at k ∈ {1, 2, 4} learners per rank, all with AdamW (SMA's learners each step their
own; DDP steps torch's).

1. Grid (seed 1): in each layout (2 ranks × 1 thread, 1 rank × 2 threads) every system at every learning rate
   of one grid, the same for all (per learner for SMA), batch `b` per rank (per learner for SMA).
2. Finalists: each system's best learning rate on seeds 2 … reps + 1; rows give the median time to the target
   loss, its spread (max "-" when a seed did not reach it) and the ratio to DDP's.

The corpus is the running Python's standard-library sources (`python -m crossbow_mpi.data.prepare text`), made
once in OUT/lm-text; its SHA-256 is in the settings. Every run is kept in OUT/lm.points.jsonl, so a long sweep
runs in chunks (`--budget-minutes`). `--quick` (a 1-block GPT, 16-byte windows, 64 KB of text, one learning rate,
DDP and SMA at k = 2 only, the 2 × 1 layout, 1 seed) checks both phases with 4 launches.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import harness

LAYOUTS = {"2x1": (2, 1), "1x2": (1, 2)}
"""Each layout's ranks and threads per rank."""


@dataclass
class Budget:
    """What a mode trains, and how far."""

    model_args: str
    seq_len: int
    corpus_bytes: int
    optimizer: str
    """Every system's `--optimizer` (`sgd`: momentum SGD; `adamw`)."""
    target_loss: float
    batch: int
    lrs: tuple[float, ...]
    baselines: tuple[str, ...]
    """Of DDP and S-SGD, those that race."""
    learners: tuple[int, ...]
    """SMA's learners per rank."""
    layouts: tuple[str, ...]
    eval_every: int
    epochs: float
    timeout_s: float


FULL = Budget(
    "layers=2,heads=2,width=64",
    32,
    1 << 20,
    "adamw",
    1.8,
    16,
    (0.001, 0.003, 0.01),
    ("ddp", "ssgd"),
    (1, 2, 4),
    tuple(LAYOUTS),
    4000,
    2,
    600,
)
QUICK = Budget(
    "layers=1,heads=2,width=16", 16, 64 << 10, "adamw", 4.0, 8, (0.01,), ("ddp",), (2,), ("2x1",), 400, 0.2, 120
)
COLUMNS = ["layout", "phase", "system", "k", "lr", "reached", "tta_s", "min", "max", "loss", "samples_per_s", "vs_ddp"]


def corpus(budget: Budget, directory: Path) -> dict:
    """Make the text corpus in `directory` unless it is there; return its manifest."""
    from crossbow_mpi.data.prepare import MANIFEST_FILE, prepare_text

    if not (directory / MANIFEST_FILE).is_file():
        prepare_text(directory, None, budget.corpus_bytes)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    return {key: manifest[key] for key in ("source", "python", "bytes", "sha256") if key in manifest}


def systems(budget: Budget) -> dict[str, dict]:
    """Each system's trainer and flags beyond the shared ones."""
    baselines = {"ddp": {"trainer": "ddp"}, "ssgd": {"trainer": "crossbow", "algorithm": "ssgd", "learners": 1}}
    sma = {f"sma k={k}": {"trainer": "crossbow", "algorithm": "sma", "learners": k} for k in budget.learners}
    return {name: baselines[name] for name in budget.baselines} | sma


def flags(budget: Budget, data_dir: Path, system: dict, threads: int, lr: float) -> dict:
    """The training flags of one point (the same for both trainers besides the system's own)."""
    shared = {"model": "tinygpt", "model_args": budget.model_args, "dataset": "text", "data_dir": str(data_dir)}
    shared |= {"seq_len": budget.seq_len, "batch_size": budget.batch, "lr": lr, "weight_decay": 0.0}
    shared |= {"optimizer": budget.optimizer}
    shared |= {"target_accuracy": 0, "target_loss": budget.target_loss, "eval_every": budget.eval_every}
    own = {key: value for key, value in system.items() if key != "trainer"}
    return {**shared, "epochs": budget.epochs, "threads": threads, **own}


def race(options: harness.Options, budget: Budget, data_dir: Path, layout: str) -> list[dict]:
    """One layout's grid and finalists; return their runs."""
    ranks, threads = LAYOUTS[layout]
    store, runs = options.store, []
    for phase, seeds in (("grid", [1]), ("finalists", range(2, options.reps + 2))):
        variants = {}
        for name, system in systems(budget).items():
            lrs = budget.lrs if phase == "grid" else [best_lr(runs, name, budget.lrs[0])]
            for lr in lrs:
                point = flags(budget, data_dir, system, threads, lr)
                variants[f"{layout} {phase} {name} lr={lr:g}"] = (name, lr, point, system["trainer"])
        for rep, seed in enumerate(seeds):
            for variant, (name, lr, point, trainer) in variants.items():
                result = store.train(f"{layout} {phase}", trainer, ranks, point, seed, budget.timeout_s)
                if result is not None:
                    harness.log(f"  {variant} seed {seed}: {json.dumps(result)}")
                    runs.append({"variant": variant, "rep": rep, "layout": layout, "phase": phase, "system": name})
                    runs[-1] |= {"lr": lr, "k": point.get("learners", 1), **result}
    return runs


def best_lr(runs: list[dict], system: str, default: float) -> float:
    """The system's grid learning rate with the least time to the target (none reached: the least final loss)."""
    mine = [run for run in runs if run["system"] == system and run["phase"] == "grid"]
    ranked = sorted(mine, key=lambda run: (run["tta_s"] is None, run["tta_s"] or 0, run.get("final_loss") or 1e9))
    return ranked[0]["lr"] if ranked else default


def rows(runs: list[dict]) -> list[dict]:
    """One row per variant: medians over its seeds, and the finalists' ratio to DDP's."""
    table = []
    for variant in dict.fromkeys(run["variant"] for run in runs):
        first = next(run for run in runs if run["variant"] == variant)
        low, high = harness.spread(runs, variant, "tta_s")
        losses = [run["final_loss"] for run in runs if run["variant"] == variant and run.get("final_loss") is not None]
        row = {key: first[key] for key in ("layout", "phase", "system", "k", "lr")}
        row |= harness.train_row(runs, variant) | {"min": low, "max": high, "loss": harness.median(losses)}
        table.append(row)
    for row in table:  # the finalists against DDP's finalist in the same layout
        ddp = [r for r in table if r["system"] == "ddp" and r["layout"] == row["layout"] and r["phase"] == "finalists"]
        finalist = row["phase"] == "finalists" and ddp
        row["vs_ddp"] = harness.ratio(row["tta_s"], ddp[0]["tta_s"]) if finalist else None
    return table


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as tmp:
        data_dir = Path(tmp) / "text" if options.quick else options.out / "lm-text"
        text = corpus(budget, data_dir)
        runs = [run for layout in budget.layouts for run in race(options, budget, data_dir, layout)]
    expected = len(budget.layouts) * len(systems(budget)) * (len(budget.lrs) + options.reps)
    return harness.Report(
        question=f"tinygpt ({budget.model_args}) on {text['bytes']} bytes of text, {budget.optimizer}: time to test "
        f"loss {budget.target_loss:g}, DDP against crossbow_mpi S-SGD and SMA; medians, vs_ddp = time / DDP's",
        columns=COLUMNS,
        rows=rows(runs),
        runs=runs,
        settings={"budget": asdict(budget), "corpus": text, "layouts": LAYOUTS},
        missing=harness.progress("runs", runs, expected),
    )


if __name__ == "__main__":
    harness.main(measure, full_reps=5)
