"""Throughput against learners per rank, for each engine, with the auto-tuner's choice marked.

    python -m benchmarks.learners [--quick] [--out DIR]

For LeNet on MNIST and ResNet-32 on synthetic CIFAR-shaped data, at b = 16 and 64, with 1 and 2 ranks and
each CPU engine: samples/s of SMA with k = 1..8 learners per rank (measured after warm-up steps), and the k
that `--learners auto` settles on in a separate run. Writes JSON and a PNG plot; prints a table last.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks import harness

FULL = {
    "models": ["lenet", "resnet32"],
    "batches": [16, 64],
    "ranks": [1, 2],
    "engines": ["sequential", "threads"],
    "learners": {"lenet": list(range(1, 9)), "resnet32": [1, 2, 4, 8]},
    "warmup": {"lenet": 2, "resnet32": 1},
    "steps": {"lenet": 8, "resnet32": 2},
}
QUICK = {
    "models": ["lenet"],
    "batches": [16],
    "ranks": [1],
    "engines": ["sequential", "threads"],
    "learners": {"lenet": [1, 2]},
    "warmup": {"lenet": 1},
    "steps": {"lenet": 2},
}


def datasets(model: str, samples: int, seed: int):
    """Training data for `samples` samples, and a small test set (evaluation is not what is measured)."""
    from crossbow_mpi.data import ArrayDataset, build_dataset, synthetic_dataset

    if model == "lenet":
        train, _ = build_dataset("mnist", str(harness.REPO / "datasets" / "mnist"), seed)
        subset = ArrayDataset(train.inputs[:samples], train.targets[:samples], train.num_classes, train.mean, train.std)
        return subset, ArrayDataset(train.inputs[:64], train.targets[:64], train.num_classes, train.mean, train.std)
    data = synthetic_dataset((3, 32, 32), 10, samples + 64, seed)
    return (
        ArrayDataset(data.inputs[:samples], data.targets[:samples], 10),
        ArrayDataset(data.inputs[samples:], data.targets[samples:], 10),
    )


def worker(settings: dict) -> dict:
    """On every rank: measure samples/s for each k, then let the auto-tuner pick k (rank 0 returns both)."""
    from mpi4py import MPI

    from crossbow_mpi import Config, Trainer
    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.control.learner_tuner import WARMUP_STEPS
    from crossbow_mpi.models import build_model

    comm = MpiCommunicator(MPI.COMM_WORLD)
    world = comm.size
    model, batch, engine = settings["model"], settings["batch"], settings["engine"]
    shape = (1, 28, 28) if model == "lenet" else (3, 32, 32)
    steps = settings["warmup"] + settings["steps"]
    run_root = comm.bcast_json(tempfile.mkdtemp(prefix="bench-learners-") if comm.rank == 0 else None)

    def run(learners, **overrides) -> list[dict]:
        step_samples = (1 if learners == "auto" else learners) * world * batch
        samples = overrides.pop("samples", steps * step_samples)
        train, test = datasets(model, samples, seed=1)
        run_dir = Path(run_root) / f"k{learners}"
        cfg = Config(
            model=model,
            learners=learners,
            batch_size=batch,
            engine=engine,
            run_dir=str(run_dir),
            epochs=1,
            target_accuracy=0,
            eval_every=settings["warmup"] * step_samples,
            seed=1,
            device=settings.get("device", "cpu"),
            algorithm=settings.get("algorithm", "sma"),
            **overrides,
        )
        Trainer(cfg).fit(lambda: build_model(model, shape, 10), train, test)
        return comm.bcast_json(
            [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            if comm.rank == 0
            else None
        )

    throughput = {}
    for k in settings["learners"]:
        evaluations = [r for r in run(k) if "test_accuracy" in r]
        throughput[k] = evaluations[-1]["samples_per_s"]
    max_learners = max(settings["learners"])
    interval = settings["steps"]
    budget = (WARMUP_STEPS + interval) * sum(range(1, max_learners + 2)) * world * batch
    records = run("auto", max_learners=max_learners, autotune_interval=interval, samples=budget)
    decisions = [r for r in records if r.get("event") == "autotune"]
    return {
        "throughput": throughput,
        "auto_learners": records[-1]["learners"],
        "decisions": decisions,
        "auto_samples_per_s": max((d["samples_per_s"] or 0) for d in decisions) if decisions else None,
    }


def measure(options: harness.Options) -> harness.Report:
    grid = QUICK if options.quick else FULL
    runs = []
    for model in grid["models"]:
        for batch in grid["batches"]:
            for ranks in grid["ranks"]:
                for engine in grid["engines"]:
                    settings = {
                        "model": model,
                        "batch": batch,
                        "engine": engine,
                        "learners": grid["learners"][model],
                        "warmup": grid["warmup"][model],
                        "steps": grid["steps"][model],
                    }
                    harness.log(f"{model} b={batch} ranks={ranks} engine={engine}")
                    result = harness.run_worker("learners", ranks, settings, timeout=1800)
                    result["throughput"] = {int(k): v for k, v in result["throughput"].items()}
                    runs.append({"model": model, "batch": batch, "ranks": ranks, "engine": engine, **result})
    all_learners = sorted({k for ks in grid["learners"].values() for k in ks})
    columns = ["model", "b", "ranks", "engine"] + [f"k={k}" for k in all_learners] + ["auto k", "best k"]
    rows = []
    for run in runs:
        rates = run["throughput"]
        row = {
            "model": run["model"],
            "b": run["batch"],
            "ranks": run["ranks"],
            "engine": run["engine"],
            "auto k": run["auto_learners"],
            "best k": max(rates, key=rates.get),
        }
        row.update({f"k={k}": rates.get(k) for k in all_learners})
        rows.append(row)
    plot = options.out / "learners.png"
    _plot(runs, plot)
    return harness.Report(
        question="SMA samples/s (all ranks) against learners per rank; auto k = the tuner's choice",
        columns=columns,
        rows=rows,
        runs=runs,
        settings=grid,
        files=[str(plot)],
    )


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["batch"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (model, batch) in zip(axes[0], panels, strict=True):
        for run in (r for r in runs if (r["model"], r["batch"]) == (model, batch)):
            ks = sorted(run["throughput"])
            rates = [run["throughput"][k] for k in ks]
            (line,) = ax.plot(ks, rates, marker="o", label=f"{run['ranks']} rank(s), {run['engine']}")
            auto = run["auto_learners"]
            if auto in ks:
                ax.plot([auto], [rates[ks.index(auto)]], marker="*", markersize=16, color=line.get_color())
        ax.set_title(f"{model}, b = {batch}")
        ax.set_xlabel("learners per rank (★ auto-tuned)")
        ax.set_ylabel("samples/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    harness.main(measure, worker)
