"""The planner's measurements on this machine: the model's forward+backward, whole and per stage, the stage
link's cost and the training loop's overhead per step, an allreduce sweep under mpirun, E(B) from S-SGD runs or a
stat-efficiency results file, and validation runs against the projection.

`python -m crossbow_mpi.planner.measure --allreduce-worker|--link-worker SIZES CALLS RESULT` is what the
measurements' mpirun ranks run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

from crossbow_mpi.planner import perf_model
from crossbow_mpi.planner.perf_model import EpochCurve, Network, Workload

INPUT_SHAPES = {"lenet": (1, 28, 28), "mlp": (1, 28, 28), "resnet32": (3, 32, 32)}
DATASETS = {"lenet": "mnist", "mlp": "mnist", "resnet32": "synthetic-cifar"}
"""`--measure-efficiency`'s default dataset per model."""
STAGES = (1, 2, 4, 8)
VALIDATION = ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4))
"""(N ranks, M stages) that run on a small machine."""
OVERHEAD_STEPS, VALIDATION_STEPS = 250, 400
"""Steps of a run that times the training loop's overhead, and of a validation run (each timed over its second
half)."""
EFFICIENCY_FILE = Path("benchmarks/results/stat_efficiency.json")
LR_AT_64 = 0.01
"""`--measure-efficiency`'s S-SGD learning rate at aggregate batch 64."""
ALLREDUCE_WORKER, LINK_WORKER = "--allreduce-worker", "--link-worker"
"""argv[1] of the ranks of the allreduce sweep and of the stage link's ping-pong."""
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ValidationRun = tuple[Workload, Network, float, float]
"""One validation run: the compute and the allreduce measured before it, its seconds per step, the load average
after it."""
Key = TypeVar("Key", bound=Hashable)
Result = TypeVar("Result")


class PlanError(RuntimeError):
    """A measurement job failed; carries the end of its output."""


def measure_workload(model_name: str, batch: int, micro_batches: int, reps: int, cut: str = "params") -> Workload:
    """Time the model's forward+backward at `batch` on one thread, and each stage's at the micro-batch, for every
    M in STAGES the model can be split into, cut as `--cut` cuts it in training (`params` or `time`); as in
    training, the model and the first stage do not compute their inputs' gradient."""
    import torch
    from torch import nn

    from crossbow_mpi.models import build_model
    from crossbow_mpi.parallel.partition import forward_backward_s, split_model, time_cut

    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = build_model(model_name, INPUT_SHAPES[model_name], 10)
    loss_fn = nn.CrossEntropyLoss()
    micro = max(1, batch // micro_batches)

    def fwd_bwd_s(module: nn.Module, inputs: torch.Tensor, first: bool, last: bool) -> tuple[float, torch.Tensor]:
        def loss(y: torch.Tensor) -> torch.Tensor:
            return loss_fn(y, torch.zeros(len(y), dtype=torch.long)) if last else y.sum()

        return forward_backward_s(module, inputs, reps, loss, input_grad=not first)

    whole_s, _ = fwd_bwd_s(model, torch.randn(batch, *INPUT_SHAPES[model_name]), first=True, last=True)
    stages = {}
    for m in STAGES[1:]:
        try:
            x = torch.randn(micro, *INPUT_SHAPES[model_name])
            groups = split_model(model, m, time_cut(model, m, x, reps) if cut == "time" else None)
        except ValueError:
            continue
        stage_s, cut_bytes, stage_bytes = [], [], []
        for index, group in enumerate(groups):
            seconds, x = fwd_bwd_s(nn.Sequential(*group), x, first=index == 0, last=index == m - 1)
            stage_s.append(seconds / micro)
            stage_bytes.append(sum(p.numel() * p.element_size() for g in group for p in g.parameters()))
            if index < m - 1:
                cut_bytes.append(x[0].numel() * x.element_size())
        stages[m] = (stage_s, cut_bytes, stage_bytes)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Workload(
        batch, whole_s / batch, param_bytes, stages, micro_batches, update_s(param_bytes, reps) / param_bytes
    )


def read_workload(path: Path) -> tuple[str, str, Workload]:
    """Return the model, its cut into stages and the workload measured in an earlier plan.json."""
    try:
        record = json.loads(path.read_text())
        saved = {k: v for k, v in record["workload"].items() if k not in ("cut", "source")}
        stages = {int(m): tuple(values) for m, values in saved.pop("stages").items()}
        link = perf_model.LinkCost(**saved.pop("link", {}))
        return record["model"], record["workload"]["cut"], Workload(**saved, stages=stages, link=link)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"--workload {path}: not a plan.json with a measured workload ({err})") from err


def update_s(nbytes: int, reps: int) -> float:
    """Time an SGD step with momentum and weight decay on `nbytes` of float32 parameters."""
    import torch

    params, grads, momentum = (torch.randn(nbytes // 4) for _ in range(3))
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        grads.add_(params, alpha=5e-4)
        momentum.mul_(0.9).add_(grads)
        params.add_(momentum, alpha=-0.01)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def sweep_allreduce(ranks: int, quick: bool, reps: int) -> Network:
    """Time float32 allreduces of growing sizes on `ranks` ranks under mpirun, the median of `reps` runs; return
    the ring model's α-β fit."""
    sizes = [4**i for i in range(1, 9 if quick else 11)]
    seconds = run_worker(ALLREDUCE_WORKER, ranks, sizes, 5 if quick else 30, reps)
    return perf_model.fit_ring_allreduce([4 * n for n in sizes], seconds, ranks)


def measure_link(work: Workload, quick: bool, reps: int) -> Workload:
    """Return the workload with its stage link's cost (`perf_model.LinkCost`): the host seconds of a message
    through pipeline.StageLink at each cut's size per micro-batch and empty, fitted, and the poll delay, measured
    by a ping-pong on two ranks under mpirun (the median of `reps` runs)."""
    micro = max(1, work.batch // work.micro_batches)
    sizes = sorted({0, *(micro * n for _, cuts, _ in work.stages.values() for n in cuts)})
    if len(sizes) == 1:
        return work
    *seconds, poll_delay = run_worker(LINK_WORKER, 2, sizes, 20 if quick else 200, reps)
    return dataclasses.replace(work, link=perf_model.fit_link(sizes, seconds, poll_delay))


def run_worker(worker: str, ranks: int, sizes: list[int], calls: int, reps: int) -> list[float]:
    """Run `worker` `reps` times on `ranks` ranks under mpirun with the sizes and calls; return the median over
    the runs of each entry of the list its rank 0 wrote."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="plan-") as tmp:
        result = Path(tmp) / "result.json"
        for _ in range(reps):
            mpirun(
                ranks, ["-m", "crossbow_mpi.planner.measure", worker, json.dumps(sizes), str(calls), str(result)], 300
            )
            runs.append(json.loads(result.read_text()))
    return median_of(runs)


def allreduce_worker(sizes: list[int], calls: int, result: Path) -> None:
    """On every rank: time `calls` allreduces of each size (float32) on the slowest rank; rank 0 writes the
    median per call of each size."""
    import numpy as np

    from crossbow_mpi.runtime import process

    process.install_abort_on_failure()
    MPI = process.mpi()
    comm = MPI.COMM_WORLD
    seconds = []
    for size in sizes:
        buffer, loops = np.ones(size, dtype=np.float32), []
        comm.Allreduce(MPI.IN_PLACE, buffer)
        for _ in range(5):
            comm.Barrier()
            started = time.perf_counter()
            for _ in range(calls):
                comm.Allreduce(MPI.IN_PLACE, buffer)
            elapsed = np.array([(time.perf_counter() - started) / calls])
            comm.Allreduce(MPI.IN_PLACE, elapsed, op=MPI.MAX)
            loops.append(float(elapsed[0]))
        seconds.append(statistics.median(loops))
    if comm.Get_rank() == 0:
        result.write_text(json.dumps(seconds))


def link_worker(sizes: list[int], calls: int, result: Path) -> None:
    """On two ranks: rank 0 sends `calls` + 1 messages of each size (bytes of float32) through a
    pipeline.StageLink, rank 1 receives each once it is posted; the first of each size is a warm-up. Rank 0
    writes the median of each size's host seconds, sender's and receiver's together, then the poll delay: half
    of the longest poll, POLL_MAX_S plus the median oversleep of sleeping that long."""
    import torch

    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.comm.base import POLL_MAX_S
    from crossbow_mpi.parallel.pipeline import ACTIVATION, StageLink
    from crossbow_mpi.runtime import process

    process.install_abort_on_failure()
    link = StageLink(MpiCommunicator(process.mpi().COMM_WORLD))
    seconds = []
    for size in sizes:
        message, times = torch.ones(size // 4), []
        for _ in range(calls + 1):
            if link.first:
                started = time.perf_counter()
                link.send(message, 1, ACTIVATION)
                host = time.perf_counter() - started
            link.comm.barrier()
            if link.first:
                link.flush()
            else:
                started = time.perf_counter()
                link.recv(0, ACTIVATION, message.device)
                host = time.perf_counter() - started
            times.append(link.comm.allreduce_sum_numbers([host])[0])
        seconds.append(statistics.median(times[1:]))
    if link.first:
        result.write_text(json.dumps([*seconds, (POLL_MAX_S + oversleep_s(POLL_MAX_S, calls)) / 2]))


def oversleep_s(seconds: float, reps: int) -> float:
    """The median time by which sleeping `seconds` overshoots them."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        time.sleep(seconds)
        times.append(time.perf_counter() - started - seconds)
    return statistics.median(times)


def mpirun(ranks: int, args: list[str], timeout: float) -> None:
    """Run `python ARGS` on `ranks` ranks under a timeout; raise PlanError with the output's end if it fails."""
    launcher = Path(sys.executable).parent / "mpirun"
    command = [
        "timeout",
        "--kill-after=10",
        str(int(timeout)),
        str(launcher) if launcher.exists() else shutil.which("mpirun") or "mpirun",
        "-n",
        str(ranks),
        "--oversubscribe",
        sys.executable,
        *args,
    ]
    done = subprocess.run(command, env={**os.environ, **MPI_ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise PlanError(
            f"{' '.join(args[:2])} on {ranks} ranks exited {done.returncode}: "
            + " | ".join(done.stderr[-300:].splitlines())
        )


def epoch_curve(path: Path | None) -> tuple[EpochCurve, str]:
    """Fit E(B) to the S-SGD runs of a stat-efficiency results file that reached the target: its finalists' medians,
    or, in a file without them (a benchmark still running in chunks), the fewest epochs of its grid at each
    aggregate batch. Without a file: the repository's results if they fit, else the default."""
    if path is None:
        if not EFFICIENCY_FILE.is_file():
            return perf_model.DEFAULT_EPOCHS, "default (no stat-efficiency results)"
        try:
            return epoch_curve(EFFICIENCY_FILE)
        except ValueError as err:  # the repository's own file, perhaps still being measured: not the user's mistake
            return perf_model.DEFAULT_EPOCHS, f"default ({err})"
    try:
        rows = [row for row in json.loads(path.read_text())["rows"] if row.get("epochs") is not None]
        ssgd = [row for row in rows if row.get("algorithm", "ssgd") == "ssgd"]
        final = [row for row in ssgd if row.get("phase", "final") == "final"] or ssgd
        fewest: dict[int, float] = {}
        for row in final:
            fewest[row["aggregate"]] = min(row["epochs"], fewest.get(row["aggregate"], math.inf))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a stat-efficiency results file ({err})") from err
    return perf_model.fit_epochs(list(fewest), list(fewest.values())), str(path)


def validate(args: argparse.Namespace, planned: Workload, reps: int) -> list[dict]:
    """Train S-SGD through the CLI at each VALIDATION size the model splits into, `reps` times in rounds of all
    sizes, and compare the median time per step with the projection (`validation_row`)."""
    sizes = [(n, m) for n, m in (VALIDATION[:2] if args.quick else VALIDATION) if m == 1 or m in planned.stages]
    runs = interleaved(lambda size: validation_run(args, planned, *size), sizes, reps)
    return [validation_row(n, m, runs[n, m]) for n, m in sizes]


def validation_run(args: argparse.Namespace, planned: Workload, ranks: int, stages: int) -> ValidationRun:
    """Measure the compute and the allreduce at `ranks` ranks, so that both see the machine's load of the moment,
    then train; the stage link and the loop's overhead are the planned workload's."""
    work = measure_workload(args.model, args.batch_size, args.micro_batches, 3 if args.quick else 10, args.cut)
    work = dataclasses.replace(work, link=planned.link, step_overhead_s=planned.step_overhead_s)
    network = dataclasses.replace(sweep_allreduce(ranks, quick=True, reps=1), allreduce=args.allreduce)
    step_s = train_step_s(args, ranks, stages, 60 if args.quick else VALIDATION_STEPS)
    return work, network, step_s, os.getloadavg()[0]


def validation_row(ranks: int, stages: int, runs: list[ValidationRun]) -> dict:
    """Project the step from the runs' median compute and allreduce (CPU work slowed by ranks/cores where the
    ranks outnumber this machine's cores) and compare it with their median step; keep every run's step."""
    work = median_workload([work for work, *_ in runs])
    network, measured, load = median_of([rest for _, *rest in runs])
    projected = perf_model.hybrid_step_s(_slowed(work, max(1.0, ranks / (os.cpu_count() or 1))), ranks, stages, network)
    return {
        "load_average": load,
        "ranks": ranks,
        "stages": stages,
        "measured_step_ms": measured * 1e3,
        "measured_runs_ms": [step_s * 1e3 for _, _, step_s, _ in runs],
        "projected_step_ms": projected * 1e3,
        "error": projected / measured - 1,
        "sample_ms": work.sample_s * 1e3,
        "step_overhead_ms": work.step_overhead_s * 1e3,
        "link": dataclasses.asdict(work.link),
        "allreduce_alpha_us": network.latency_s * 1e6,
        "allreduce_s_per_byte": network.seconds_per_byte,
    }


def interleaved(measure: Callable[[Key], Result], keys: list[Key], reps: int) -> dict[Key, list[Result]]:
    """Measure every key `reps` times in rounds, each round key by key, so that the machine's drift over the
    rounds hits all keys alike; return each key's results in the order taken."""
    results: dict[Key, list[Result]] = {key: [] for key in keys}
    for _ in range(reps):
        for key in keys:
            results[key].append(measure(key))
    return results


def median_of(values: list):
    """The median of repeated measurements: of numbers, and field by field of dataclasses, dicts, lists and tuples
    of them; what all repetitions agree on (an int, a name) is kept as it is."""
    first = values[0]
    if all(value == first for value in values[1:]):
        return first
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: median_of([getattr(v, f.name) for v in values]) for f in dataclasses.fields(first)}
        return dataclasses.replace(first, **fields)
    if isinstance(first, dict):
        return {key: median_of([v[key] for v in values]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(median_of(list(items)) for items in zip(*values, strict=True))
    return statistics.median(values)


def median_workload(works: list[Workload]) -> Workload:
    """The median of repeated workload measurements, each M's stages of the repetitions that cut the model as
    most did (a cut by time can differ between them)."""
    stages = {}
    for m in works[0].stages:
        cuts = [work.stages[m][1:] for work in works]
        common = max(cuts, key=cuts.count)
        stages[m] = median_of([work.stages[m] for work in works if work.stages[m][1:] == common])
    return dataclasses.replace(median_of([dataclasses.replace(work, stages={}) for work in works]), stages=stages)


def measure_step_overhead(args: argparse.Namespace, reps: int) -> Workload:
    """Measure the workload and the training loop's host work per step `reps` times in pairs: a step of S-SGD on
    one rank through the CLI less the batch's forward+backward and the update timed just before it; return the
    median workload with the median difference."""
    works, overheads = [], []
    for _ in range(reps):
        work = measure_workload(args.model, args.batch_size, args.micro_batches, 3 if args.quick else 20, args.cut)
        step = train_step_s(args, 1, 1, 50 if args.quick else OVERHEAD_STEPS)
        works.append(work)
        overheads.append(step - work.batch * work.sample_s - work.param_bytes * work.update_s_per_byte)
    print(
        f"training loop per step: {spread(overheads, 1e3)} ms over {reps} paired runs, median "
        f"{statistics.median(overheads) * 1e3:.3g} ms",
        flush=True,
    )
    return dataclasses.replace(median_workload(works), step_overhead_s=max(statistics.median(overheads), 0.0))


def spread(values: list[float], scale: float = 1.0) -> str:
    """`min–max` of the values times `scale`."""
    return f"{min(values) * scale:.3g}–{max(values) * scale:.3g}"


def train_step_s(args: argparse.Namespace, ranks: int, stages: int, steps: int) -> float:
    """Train S-SGD through the CLI on `ranks` ranks in pipelines of `stages` for `steps` steps; return the time
    per step of the second half."""
    aggregate = ranks // stages * args.batch_size
    samples = steps * aggregate
    flags = {
        "algorithm": "ssgd",
        "model": args.model,
        "learners": 1,
        "batch-size": args.batch_size,
        "pipeline-stages": stages,
        "cut": args.cut,
        "micro-batches": args.micro_batches if stages > 1 else 1,
        "threads": 1,
        "epochs": samples / 60000,
        "eval-every": samples // 2,
        "target-accuracy": 0,
        "data-dir": args.data_dir,
    }
    rate = [r["samples_per_s"] for r in train(ranks, flags) if "samples_per_s" in r][-1]
    return aggregate / rate


def train(ranks: int, flags: dict) -> list[dict]:
    """Train through the CLI on `ranks` ranks with `--KEY=VALUE` flags in a fresh run directory; return its
    metrics.jsonl records."""
    with tempfile.TemporaryDirectory(prefix="plan-run-") as run_dir:
        flags = {**flags, "run-dir": run_dir}
        mpirun(ranks, ["-m", "crossbow_mpi.train", *[f"--{k}={v}" for k, v in flags.items()]], 1800)
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def measure_efficiency(args: argparse.Namespace) -> Path:
    """Train S-SGD to `--target-accuracy` at aggregate batches B, 4B and 16B (B, 4B with --quick) on one rank
    (S-SGD at aggregate batch B on P ranks is SGD at batch B), the learning rate scaled by √(B/64) from 0.01 (one
    run per batch, not tuned as benchmarks/stat_efficiency.py tunes it); write the epochs each took as a
    stat-efficiency results file and return it."""
    aggregates = [args.batch_size * f for f in ((1, 4) if args.quick else (1, 4, 16))]
    rows = []
    for aggregate in aggregates:
        flags = {
            "algorithm": "ssgd",
            "model": args.model,
            "dataset": args.dataset or DATASETS[args.model],
            "batch-size": aggregate,
            "lr": LR_AT_64 * (aggregate / 64) ** 0.5,
            "epochs": args.efficiency_epochs,
            "eval-every": max(aggregate, 200 if args.quick else 2000),
            "target-accuracy": args.target_accuracy,
            "data-dir": args.data_dir,
        }
        summary = train(1, flags)[-1]
        rows.append(
            {
                "algorithm": "ssgd",
                "aggregate": aggregate,
                "lr": flags["lr"],
                "epochs": summary["epochs"] if summary["reached"] else None,
                "accuracy": summary["final_test_accuracy"],
            }
        )
        print(f"E({aggregate}): {rows[-1]['epochs']} epochs to {args.target_accuracy:.0%}", flush=True)
    path = args.out / "efficiency.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: flags[key] for key in ("model", "dataset", "epochs", "target-accuracy")}
    path.write_text(json.dumps({"settings": {**settings, "ranks": 1}, "rows": rows}, indent=1) + "\n")
    return path


def _slowed(work: Workload, factor: float) -> Workload:
    """The workload with its CPU work (compute, update, the stage link's host work, the loop's overhead) slowed."""
    stages = {m: ([s * factor for s in stage_s], cuts, sizes) for m, (stage_s, cuts, sizes) in work.stages.items()}
    link = work.link
    return dataclasses.replace(
        work,
        sample_s=work.sample_s * factor,
        update_s_per_byte=work.update_s_per_byte * factor,
        stages=stages,
        step_overhead_s=work.step_overhead_s * factor,
        link=dataclasses.replace(
            link, host_s_fixed=link.host_s_fixed * factor, host_s_per_byte=link.host_s_per_byte * factor
        ),
    )


if __name__ == "__main__":
    workers = {ALLREDUCE_WORKER: allreduce_worker, LINK_WORKER: link_worker}
    workers[sys.argv[1]](json.loads(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
