"""Planner: `python -m crossbow_mpi.plan`: project data parallelism against hybrid pipelines up to 1024 devices.

Measures on this machine what the model in `projection` needs: the model's forward+backward per sample, whole
and per stage (cut as `--cut`; or `--workload` takes them from an earlier plan.json), its activation sizes, and
an α-β fit of the allreduce from a sweep of message sizes under mpirun
(or takes a given network instead of the sweep: `--bandwidth --latency`). Reads E(B) from a stat-efficiency
results file, or measures it with `--measure-efficiency` (short S-SGD runs to `--target-accuracy` at a few
aggregate batches, written as such a results file). Prints SU_DP(N) and SU_hybrid(N, M) and writes a plot.
`--validate` trains at the sizes that run here and compares the measured time per step with the projection.
Every measured quantity is the median of `--reps` repetitions, taken in turns where two are compared, so that
the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from crossbow_mpi.config import CUTS
from crossbow_mpi.planner import perf_model
from crossbow_mpi.planner.measure import (
    DATASETS,
    EFFICIENCY_FILE,
    INPUT_SHAPES,
    STAGES,
    PlanError,
    epoch_curve,
    interleaved,
    measure_efficiency,
    measure_link,
    measure_step_overhead,
    median_of,
    median_workload,
    read_workload,
    spread,
    sweep_allreduce,
    validate,
    validation_row,
)
from crossbow_mpi.planner.perf_model import EpochCurve, Network, Workload

__all__ = [  # with the measurements that tests/test_plan.py reaches through this module
    "build_parser",
    "epoch_curve",
    "interleaved",
    "main",
    "measure_step_overhead",
    "median_of",
    "median_workload",
    "read_workload",
    "spread",
    "validate",
    "validation_row",
    "validation_table",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m crossbow_mpi.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lenet", choices=sorted(INPUT_SHAPES))
    parser.add_argument("--batch-size", type=int, default=16, help="samples per worker per step (default: 16)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per pipeline step (default: 4)")
    parser.add_argument(
        "--cut", default="params", choices=CUTS, help="how the stages are balanced, as train's --cut (default: params)"
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the allreduce sweep (default: 2)")
    parser.add_argument(
        "--bandwidth", type=float, help="a given network's bandwidth in Gb/s instead of the allreduce sweep"
    )
    parser.add_argument("--latency", type=float, help="a given network's latency in µs (with --bandwidth)")
    parser.add_argument(
        "--allreduce",
        default="auto",
        choices=perf_model.ALLREDUCES,
        help="allreduce model: ring, binomial tree, or auto: the faster per message size and N (default: auto)",
    )
    parser.add_argument(
        "--efficiency", type=Path, help=f"stat-efficiency results for E(B) (default: {EFFICIENCY_FILE} if present)"
    )
    parser.add_argument(
        "--measure-efficiency",
        action="store_true",
        help="measure E(B): S-SGD on one rank at aggregate batches B, 4B, 16B (B = --batch-size) to the target",
    )
    parser.add_argument("--dataset", help="--measure-efficiency's dataset (default: mnist; resnet32: synthetic-cifar)")
    parser.add_argument(
        "--target-accuracy", type=float, default=0.97, help="--measure-efficiency's target (default: 0.97)"
    )
    parser.add_argument(
        "--efficiency-epochs", type=float, default=4, help="--measure-efficiency's epoch limit per run (default: 4)"
    )
    parser.add_argument(
        "--workload",
        type=Path,
        help="project from the compute measured in an earlier run's plan.json (its model, batch and micro-batches) "
        "instead of measuring",
    )
    parser.add_argument("--max-devices", type=int, default=1024, help="largest N projected (default: 1024)")
    parser.add_argument("--validate", action="store_true", help="train at N = 2, 4 and M = 1, 2, 4; report errors")
    parser.add_argument(
        "--reps", type=int, help="repetitions of every measurement, the median taken (default: 3; --quick: 1)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny measurements: check that it runs")
    parser.add_argument("--out", type=Path, default=Path("plan"), help="directory for plan.json and plan.png")
    parser.add_argument(
        "--data-dir",
        default="datasets/mnist",
        help="MNIST's directory, for the runs the planner trains (default: datasets/mnist, from the repository root)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check(args)
        plan(args)
    except (ValueError, PlanError) as err:
        print(f"crossbow_mpi.plan: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def check(args: argparse.Namespace) -> None:
    if args.batch_size < 1 or not 1 <= args.micro_batches <= args.batch_size:
        raise ValueError(f"need 1 <= --micro-batches <= --batch-size, got {args.micro_batches} and {args.batch_size}")
    if args.ranks < 2:
        raise ValueError(f"--ranks must be at least 2 for the allreduce sweep, got {args.ranks}")
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    if args.max_devices < 1:
        raise ValueError(f"--max-devices must be at least 1, got {args.max_devices}")
    if (args.bandwidth is None) != (args.latency is None):
        raise ValueError("give --bandwidth and --latency together")
    if args.bandwidth is not None and not (math.isfinite(args.bandwidth) and args.bandwidth > 0):
        raise ValueError(f"--bandwidth must be a positive number of Gb/s, got {args.bandwidth}")
    if args.latency is not None and not (math.isfinite(args.latency) and args.latency >= 0):
        raise ValueError(f"--latency must be a non-negative number of µs, got {args.latency}")
    check_out(args.out)
    trains = args.workload is None or args.validate or args.measure_efficiency
    on_mnist = (args.dataset or DATASETS[args.model]) == "mnist"
    if trains and on_mnist and not (Path(args.data_dir) / "SHA256SUMS").is_file():
        raise ValueError(f"--data-dir {args.data_dir}: no MNIST there (run from the repository root, or pass it)")
    if args.efficiency is not None and not args.efficiency.is_file():
        raise ValueError(f"--efficiency {args.efficiency}: no such file")
    if args.workload is not None and not args.workload.is_file():
        raise ValueError(f"--workload {args.workload}: no such file")
    if args.efficiency is not None and args.measure_efficiency:
        raise ValueError("give --efficiency or --measure-efficiency, not both")
    if not 0 < args.target_accuracy <= 1 or not args.efficiency_epochs > 0:
        raise ValueError(
            f"need 0 < --target-accuracy <= 1 and --efficiency-epochs > 0, got {args.target_accuracy} and "
            f"{args.efficiency_epochs}"
        )


def check_out(out: Path) -> None:
    """Refuse, before any measurement, an --out that holds an earlier plan or that cannot be written."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: not a directory")
    if (out / "plan.json").exists():
        raise ValueError(f"--out {out} holds an earlier plan (plan.json): choose another directory")
    existing = next(parent for parent in (out, *out.parents) if parent.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable")


def plan(args: argparse.Namespace) -> None:
    reps = args.reps or (1 if args.quick else 3)
    if args.workload is not None:
        args.model, args.cut, work = read_workload(args.workload)
        args.batch_size, args.micro_batches = work.batch, work.micro_batches
    else:
        work = measure_link(measure_step_overhead(args, reps), args.quick, reps)
    given = args.bandwidth is not None
    network = (
        Network.from_link(args.bandwidth, args.latency) if given else sweep_allreduce(args.ranks, args.quick, reps)
    )
    network = dataclasses.replace(network, allreduce=args.allreduce)
    curve, curve_source = epoch_curve(measure_efficiency(args) if args.measure_efficiency else args.efficiency)
    devices = [2**i for i in range(args.max_devices.bit_length()) if 2**i <= args.max_devices]
    cells = perf_model.project(work, network, curve, devices, list(STAGES))
    print(describe(args, work, network, curve, curve_source))
    print(table(cells))
    record = {
        "model": args.model,
        "reps": reps,
        "workload": {**dataclasses.asdict(work), "cut": args.cut, "source": str(args.workload or "measured")},
        "network": {**vars(network), "source": "given" if given else f"allreduce sweep on {args.ranks} ranks"},
        "epoch_curve": {**vars(curve), "source": curve_source},
        "projection": [vars(cell) for cell in cells],
    }
    if args.validate:
        rows = validate(args, work, reps)
        print(validation_table(rows))
        record["validation"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(cells, args.out / "plan.png", f"{args.model}, batch {work.batch} per worker")
    print(f"wrote {args.out / 'plan.json'} and {args.out / 'plan.png'}")


def describe(args, work: Workload, network: Network, curve: EpochCurve, source: str) -> str:
    origin = "given" if args.bandwidth is not None else f"fit to an allreduce sweep on {args.ranks} ranks"
    return (
        f"{args.model}: {work.sample_s * 1e3:.3f} ms forward+backward per sample (1 thread), "
        f"{work.param_bytes / 1e6:.2f} MB of parameters; batch {work.batch} per worker, "
        f"{work.micro_batches} micro-batches; {work.step_overhead_s * 1e3:.3g} ms of training loop per step\n"
        f"stage link: {work.link.host_s_fixed * 1e6:.3g} µs + {work.link.host_s_per_byte * 1e9:.3g} ns/byte of host "
        f"work per message, poll delay {work.link.poll_delay_s * 1e6:.3g} µs\n"
        f"network ({origin}): α = {network.latency_s * 1e6:.3g} µs, {gbit_per_s(network):.3g} Gb/s, "
        f"{network.allreduce} allreduce\n"
        f"E(B) = {curve.min_epochs:.3g}·(1 + B/{curve.noise_batch:.0f}) from {source}\n"
        "hybrid beats DP where SU_hybrid(N, M) > SU_DP(N) (vs DP > 1); Pal et al.'s criterion (column Pal): "
        "SU_MP(M) > SU_DP(N)/SU_DP(N/M), which charges hybrid the allreduce of the whole model at N/M ranks, "
        "not of one stage's shard, so it can say no where vs DP > 1"
    )


def gbit_per_s(network: Network) -> float:
    return 8e-9 / network.seconds_per_byte if network.seconds_per_byte else float("inf")


def table(cells: list[perf_model.Projection]) -> str:
    """One row per N: SU_DP, then SU_hybrid for each M with the ratio to DP and Pal et al.'s criterion."""
    by_devices: dict[int, dict[int, perf_model.Projection]] = {}
    for cell in cells:
        by_devices.setdefault(cell.devices, {})[cell.stages] = cell
    header = f"{'N':>5} {'SU_DP':>9}" + "".join(
        f" {'SU_hyb M=' + str(m):>13} {'vs DP':>6} {'Pal':>3}" for m in STAGES[1:]
    )
    lines = [header]
    for n, row in by_devices.items():
        dp = row[1].speedup
        line = f"{n:>5} {dp:>9.3g}"
        for m in STAGES[1:]:
            hybrid = row.get(m)
            line += (
                f" {hybrid.speedup:>13.3g} {hybrid.speedup / dp:>6.2f} {'yes' if hybrid.pal_criterion else 'no':>3}"
                if hybrid
                else f" {'-':>13} {'':>6} {'':>3}"
            )
        lines.append(line)
    return "\n".join(lines)


def validation_table(rows: list[dict]) -> str:
    if not rows:
        return "validation: no size of the model runs here"
    lines = [
        f"validation (S-SGD through the CLI, this machine, {os.cpu_count()} cores; load average "
        f"{min(r['load_average'] for r in rows):.1f} to {max(r['load_average'] for r in rows):.1f}; the median of "
        f"{len(rows[0]['measured_runs_ms'])} runs per size, min–max beside it):",
        f"{'N':>3} {'M':>3} {'measured':>9} {'min–max':>13} {'projected':>9} {'error':>7}",
    ]
    lines += [
        f"{r['ranks']:>3} {r['stages']:>3} {r['measured_step_ms']:>7.2f}ms {spread(r['measured_runs_ms']):>11}ms "
        f"{r['projected_step_ms']:>7.2f}ms {r['error']:>+7.1%}"
        for r in rows
    ]
    return "\n".join(lines)


def plot(cells: list[perf_model.Projection], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for m in STAGES:
        mine = [c for c in cells if c.stages == m]
        if mine:
            label = "DP" if m == 1 else f"hybrid M={m}"
            axes.plot([c.devices for c in mine], [c.speedup for c in mine], marker="o", label=label)
    axes.set(xscale="log", yscale="log", xlabel="devices N", ylabel="speedup in time to target", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


if __name__ == "__main__":
    sys.exit(main())
