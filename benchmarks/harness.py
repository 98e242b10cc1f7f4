"""Shared benchmark harness: MPI launches, interleaved repetitions, medians, JSON results and a closing table.

Every benchmark module calls `main(measure, worker)`. `measure(options)` runs the benchmark and returns a
Report; the harness writes it to OUT/NAME.json and prints its table last. A module that must time code inside
an MPI job also passes `worker(settings) -> dict`, which `run_worker` starts on the ranks with
`python -m benchmarks.NAME --worker SETTINGS.json RESULT.json`.

A long benchmark runs in chunks: it trains through `options.store` (a PointStore), which keeps every finished
training run in OUT/NAME.points.jsonl, skips the runs already there, and starts no run once `--budget-minutes`
cannot hold it; the benchmark then reports what the store holds and which phases are incomplete (Report.missing).
Running it again continues where it stopped.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1"}
TRAINERS = {"crossbow": "crossbow_mpi.train", "ddp": "benchmarks.ddp_peer", "torchft": "benchmarks.torchft_peer"}
NEVER = 10**9
"""An evaluation interval past the end of any run: evaluate once, at the end."""
TIMED_OUT = 124
"""`timeout`'s exit code when the command ran past its limit."""


class BenchmarkError(RuntimeError):
    """A launched job failed or hung; the message carries the end of its output."""

    def __init__(self, message: str, returncode: int | None = None, hung: bool = False):
        super().__init__(message)
        self.returncode = returncode
        self.hung = hung
        """Whether it ran past its timeout."""


def repo_path(path: str | Path) -> str:
    """`path` relative to the repository where it lies inside it, so that a result file means the same on any
    machine; elsewhere (a user's --out) as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


@dataclass
class Options:
    """How a benchmark runs."""

    name: str
    """Module name under benchmarks/, also the JSON file's name."""
    quick: bool
    """Tiny budget: check that it runs and writes well-formed results, never speeds."""
    out: Path
    """Directory for NAME.json (and any plot)."""
    reps: int
    """Repetitions of each variant, run interleaved."""
    store: PointStore
    """Where training runs are kept across invocations, and the wall-clock budget for new ones."""


@dataclass
class Budget:
    """What a training benchmark's mode trains and how far; each benchmark adds its own fields."""

    model: str
    dataset: str
    target_accuracy: float
    eval_every: int
    """Training samples (all ranks) between evaluations of the whole test set."""
    epochs: float
    """Epoch limit of a run: a run that needs more has not reached the target."""
    timeout_s: float
    """Wall-clock limit of one launched job."""

    def flags(self) -> dict:
        """The training CLI's flags for what this budget trains and how far."""
        return {
            "model": self.model,
            "dataset": self.dataset,
            "target_accuracy": self.target_accuracy,
            "eval_every": self.eval_every,
            "epochs": self.epochs,
        }


QUICK_TRAINING = {
    "model": "mlp",
    "dataset": "synthetic-mnist",
    "target_accuracy": 0.15,
    "eval_every": 600,
    "epochs": 0.02,
    "timeout_s": 120,
}
"""A quick mode's Budget fields: seconds of an MLP on synthetic MNIST, to check that a benchmark runs."""


@dataclass
class Report:
    """What a benchmark measured: its table's rows (medians, ratios) and every run behind them."""

    question: str
    columns: list[str]
    rows: list[dict]
    runs: list[dict]
    settings: dict
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """What the point store does not hold yet, phase by phase (e.g. "grid 83/270 runs"); empty when complete."""
    goals: dict = field(default_factory=dict)
    """The benchmark's goals as measured (each with its target, its value and whether it is met); empty: none."""

    def table(self) -> str:
        """Render the rows as a fixed-width text table."""
        cells = [self.columns] + [[format_value(row.get(c)) for c in self.columns] for row in self.rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(self.columns))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def format_value(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def main(
    measure: Callable[[Options], Report],
    worker: Callable[[dict], dict] | None = None,
    full_reps: int = 3,
    runner: Callable[..., dict] | None = None,
) -> None:
    """Run a benchmark module from the command line (or, with --worker, one rank of its MPI job); `runner`: what
    the point store launches for a run, with `train`'s signature (None: `train`)."""
    name = Path(sys.modules["__main__"].__file__).stem
    if sys.argv[1:2] == ["--worker"]:
        _worker_main(worker, Path(sys.argv[2]), Path(sys.argv[3]))
        return
    args = _parser(name, full_reps).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store_path = args.out / f"{name}{'.quick' if args.quick else ''}.points.jsonl"
    if args.quick:
        store_path.unlink(missing_ok=True)
    budget_s = None if args.budget_minutes is None else args.budget_minutes * 60
    store = PointStore(store_path, name, budget_s, runner or train, phases=args.phases)
    options = Options(name, args.quick, args.out, args.reps or (1 if args.quick else full_reps), store)
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    try:
        report = measure(options)
    except BenchmarkError as err:  # the failed job's own output says why; Python's stack would not
        sys.exit(f"benchmarks.{name}: {err}")
    if unknown := sorted(set(args.phases or ()) - store.asked):
        asked = ", ".join(sorted(store.asked))
        print(f"--phases: no run was asked in {', '.join(unknown)} (asked: {asked})", file=sys.stderr, flush=True)
    incomplete = f" INCOMPLETE: {'; '.join(report.missing)}." if report.missing else ""
    record = {
        "benchmark": name,
        "question": report.question + incomplete,
        "missing": report.missing,
        "points": store.provenance(),
        "quick": options.quick,
        "reps": options.reps,
        "date": started.isoformat(timespec="seconds"),
        "wall_s": (datetime.datetime.now(datetime.UTC) - started).total_seconds(),
        "command": " ".join(["python", "-m", f"benchmarks.{name}", *sys.argv[1:]]),
        "machine": machine(),
        "code": code_version(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "settings": report.settings,
        "columns": report.columns,
        "rows": report.rows,
        "goals": report.goals,
        "runs": report.runs,
        "files": [repo_path(file) for file in report.files],
    }
    path = options.out / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    goals = f"goals: {json.dumps(report.goals)}\n" if report.goals else ""
    print(f"\n{record['question']}\nwrote {path}\n{goals}\n{report.table()}", flush=True)


def _parser(name: str, full_reps: int) -> argparse.ArgumentParser:
    """The command line of benchmark `name`."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}", description=sys.modules["__main__"].__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny budget, from an empty point store: check that it runs, not speeds"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help=f"directory for {name}.json (default: %(default)s)"
    )
    parser.add_argument(
        "--reps", type=positive(int), default=None, help=f"repetitions of each variant (default: {full_reps}, quick: 1)"
    )
    parser.add_argument(
        "--budget-minutes",
        type=positive(float),
        default=None,
        help="start no training run that would end past this many minutes; report what the point store holds",
    )
    parser.add_argument(
        "--phases",
        type=phase_names,
        default=None,
        help="start training runs only in these point-store phases, comma-separated (slow_link's: its links, "
        "e.g. 100mbit); report the others from the store",
    )
    return parser


def phase_names(text: str) -> frozenset[str]:
    """An argparse type: comma-separated point-store phases, else argparse's one-line error (exit 2)."""
    names = text.split(",")
    if "" in names:
        raise argparse.ArgumentTypeError(f"an empty phase name in {text!r}")
    return frozenset(names)


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above 0, else argparse's one-line error (exit 2)."""

    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def _worker_main(worker: Callable[[dict], dict], settings_path: Path, result_path: Path) -> None:
    from crossbow_mpi.runtime import process

    process.install_abort_on_failure()
    result = worker(json.loads(settings_path.read_text()))
    if process.mpi().COMM_WORLD.Get_rank() == 0:
        result_path.write_text(json.dumps(result))


def log(message: str) -> None:
    """Report progress on stderr, so that the table stays the last thing on stdout."""
    print(message, file=sys.stderr, flush=True)


@functools.cache
def machine() -> dict:
    """Describe the machine the numbers were measured on."""
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
        platform.processor(),
    )
    mpi = subprocess.run([_mpirun(), "--version"], capture_output=True, text=True).stdout.splitlines()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi": mpi[0] if mpi else None,
    }


def machine_label(described: dict | None) -> str:
    """A `machine()` description in a few words: the CPU and its cores."""
    return "not recorded" if described is None else f"{described['cpu']}, {described['cores']} cores"


def code_version() -> dict:
    """The commit the benchmarked code is at, and whether the work tree differed from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "crossbow_mpi"))}


def _mpirun() -> str:
    beside_python = Path(sys.executable).parent / "mpirun"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpirun")
    if not found:
        raise BenchmarkError("no mpirun beside the Python interpreter or on PATH")
    return found


Wrap = Callable[[list[str]], list[str]]
"""Rewrites an mpirun command line (`mpirun -n R --oversubscribe python ARGS`), e.g. to launch on other hosts."""


def mpirun(
    ranks: int,
    args: list[str],
    timeout: float,
    env: dict | None = None,
    flags: tuple[str, ...] = (),
    wrap: Wrap | None = None,
) -> str:
    """Run `python ARGS` on `ranks` MPI ranks (mpirun `flags` besides) from the repository root, the command
    rewritten by `wrap`; return stdout; raise if it fails or hangs."""
    launch = [_mpirun(), *flags, "-n", str(ranks), "--oversubscribe", sys.executable, *args]
    command = ["timeout", "--kill-after=10", str(math.ceil(timeout)), *(wrap(launch) if wrap else launch)]
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            env={**os.environ, **MPI_ENV, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout + 30,
        )
    except subprocess.TimeoutExpired as err:
        raise BenchmarkError(f"{' '.join(args)} on {ranks} ranks hung past {timeout:.0f} s", hung=True) from err
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        if done.returncode == TIMED_OUT:
            raise BenchmarkError(f"{' '.join(args)} on {ranks} ranks hung past {timeout:.0f} s:\n{tail}", hung=True)
        raise BenchmarkError(f"{' '.join(args)} on {ranks} ranks exited {done.returncode}:\n{tail}", done.returncode)
    return done.stdout


def run_worker(
    name: str, ranks: int, settings: dict, timeout: float, wrap: Wrap | None = None, env: dict | None = None
) -> dict:
    """Run benchmark `name`'s worker on `ranks` ranks with `settings` (`wrap`, `env`: as `mpirun`'s); return what
    its rank 0 returned."""
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        settings_path, result_path = Path(tmp) / "settings.json", Path(tmp) / "result.json"
        settings_path.write_text(json.dumps(settings))
        args = ["-m", f"benchmarks.{name}", "--worker", str(settings_path), str(result_path)]
        mpirun(ranks, args, timeout, env, wrap=wrap)
        return json.loads(result_path.read_text())


def train(
    trainer: str, ranks: int, flags: dict, timeout: float, attempts: int = 2, wrap: Wrap | None = None, env=None
) -> dict:
    """Run a training CLI (`crossbow` or `ddp`) with `--KEY VALUE` flags in a fresh run directory; return what
    its metrics.jsonl says: target reached, time and epochs to it, final accuracy, median training samples/s and
    each evaluation's [epoch, samples/s], the adaptive batch sizes' changes (`batch_sizes`), eager-SGD's median
    wait per round, with `compile: True` (both trainers take it) the seconds of the compiling first step and, for
    an asynchronous algorithm, each rank's (group's) updates over the run.

    A job that crashes (not one that diverges or hangs) is run again, up to `attempts` times in all, so that one
    transient crash (gloo has aborted at exit) does not cost a whole benchmark; the result counts the crashes
    and keeps the end of each one's output. A hang is a defect to fix, not retried: it would cost its timeout
    again."""
    from crossbow_mpi.train import EXIT_DIVERGED

    crashes = []
    while True:
        try:
            records = _train_once(trainer, ranks, flags, timeout, wrap, env)
            break
        except BenchmarkError as err:
            if err.returncode == EXIT_DIVERGED:
                return {"reached": False, "tta_s": None, "epochs": None, "diverged": True}
            if err.hung:
                raise
            crashes.append(str(err)[-500:])
            if len(crashes) >= attempts:
                raise
            log(f"  crashed, running it again: {crashes[-1]}")
    summary = records[-1]
    evaluations = [record for record in records if "test_accuracy" in record]
    asynchronous = [record["async_updates"] for record in evaluations if "async_updates" in record]
    return {
        "reached": summary["reached"],
        "tta_s": summary["time_to_target_s"],
        "epochs": summary["epochs"] if summary["reached"] else None,
        "epochs_run": summary["epochs"],
        "final_accuracy": summary["final_test_accuracy"],
        "final_loss": summary.get("final_test_loss"),
        "time_limited": summary.get("time_limited", False),
        **({"compile_s": summary["compile_s"]} if "compile_s" in summary else {}),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in evaluations),
        "trajectory": [[r.get("epoch"), r["samples_per_s"]] for r in evaluations],
        "optimizer": [record for record in records if record.get("event") == "optimizer"],
        **({"updates": [sum(counts) for counts in zip(*asynchronous, strict=True)]} if asynchronous else {}),
        **batch_sizes(adapted_batch_sizes(records)),
        **({"crashes": crashes} if crashes else {}),
        **({"comm_bytes_per_sample": summary["comm_bytes"] / summary["samples"]} if "comm_bytes" in summary else {}),
        **({"eager_wait_ms": wait} if (wait := median_of(evaluations, "eager_wait_ms")) is not None else {}),
    }


def median_of(records: list[dict], key: str) -> float | None:
    """The median of `key` over the records that have a value for it; None when none has."""
    values = [record[key] for record in records if record.get(key) is not None]
    return statistics.median(values) if values else None


def adapted_batch_sizes(records: list[dict]) -> list[list]:
    """Each adaptive batch-size change of a run as [seconds, [size per rank]]."""
    from crossbow_mpi.report import batch_size_changes

    return [[change["time_s"], change["changes"]["batch_size"][1]] for change in batch_size_changes(records)]


def batch_sizes(changes: list[list], every_s: float = 1.0) -> dict:
    """The number of batch-size `changes` ([seconds, sizes], in order) and the sizes in force every `every_s`
    seconds from the first change to the last, which keep a point small where the sizes move at every step."""
    if not changes:
        return {}
    times = [seconds for seconds, _ in changes]
    grid = [times[0] + k * every_s for k in range(int((times[-1] - times[0]) / every_s) + 1)]
    sampled = [[at, changes[bisect.bisect_right(times, at) - 1][1]] for at in grid]
    return {"batch_changes": len(changes), "batch_sizes": sampled + ([changes[-1]] if grid[-1] < times[-1] else [])}


def _train_once(
    trainer: str, ranks: int, flags: dict, timeout: float, wrap: Wrap | None = None, env: dict | None = None
) -> list[dict]:
    """Run the training CLI once in a fresh run directory; return its metrics.jsonl records."""
    if trainer in ("ddp", "torchft"):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="bench-run-") as run_dir:
        args = ["-m", TRAINERS[trainer], "--run-dir", run_dir]
        for key, value in flags.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        mpirun(ranks, args, timeout, env, wrap=wrap)
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def seeded(trainer: str, ranks: int, flags: dict, timeout: float) -> Callable[[int], dict]:
    """Return a run for `interleave`: `train` with `flags` and seed rep + 1, so that repetition r of every variant
    uses the same seed."""
    return lambda rep: train(trainer, ranks, {**flags, "seed": rep + 1}, timeout)


class PointStore:
    """A benchmark's finished training runs, one JSON record a line, kept across invocations.

    A record is keyed by the benchmark, the phase, the trainer, the ranks, the full flag set and the seed, and keeps
    the result with the commit, machine, date, load average and wall time it was measured at. `train` answers a
    stored run from the store; it starts a new one only while the budget can hold it (by the longest run of its phase
    so far, before any by its timeout), and once one does not fit it starts no later one either, so that the next
    invocation continues in the same order."""

    def __init__(
        self,
        path: Path,
        benchmark: str,
        budget_s: float | None = None,
        runner: Callable[..., dict] = train,
        clock: Callable[[], float] = time.monotonic,
        phases: frozenset[str] | None = None,
    ):
        """`phases`: where a new run may start (None: anywhere); a run of another phase is answered from the store
        only, without spending the budget's turn."""
        self.path, self.benchmark, self.runner, self.clock = path, benchmark, runner, clock
        self.deadline = math.inf if budget_s is None else clock() + budget_s
        self.exhausted = False
        self.phases = phases
        self.asked: set[str] = set()
        """Every phase a run was asked of: what --phases may name."""
        self.code = code_version()
        lines = path.read_text().splitlines() if path.exists() else []
        self.records = {self._key(record): record for record in map(json.loads, lines)}

    @staticmethod
    def _key(point: dict) -> str:
        fields = ("benchmark", "phase", "trainer", "ranks", "flags", "seed")
        return json.dumps([point[name] for name in fields], sort_keys=True)

    def train(
        self,
        phase: str,
        trainer: str,
        ranks: int,
        flags: dict,
        seed: int,
        timeout: float,
        limit: dict | None = None,
        launch: dict | None = None,
    ) -> dict | None:
        """The result of `train` with `flags`, `seed` and the flags of `limit` (a pruning limit, not part of the
        key), launched with the runner's keywords `launch` (`train`'s `wrap` and `env`; not part of the key): the
        stored one, else a new run's, else None when the budget is spent or `phases` leaves `phase` out."""
        point = {"benchmark": self.benchmark, "phase": phase, "trainer": trainer, "ranks": ranks}
        point |= {"flags": flags, "seed": seed}
        key = self._key(point)
        self.asked.add(phase)
        if key not in self.records:
            if self.phases is not None and phase not in self.phases:
                return None
            walls = [record["wall_s"] for record in self.records.values() if record["phase"] == phase]
            if self.exhausted or self.clock() + max(walls, default=timeout) > self.deadline:
                self.exhausted = True
                return None
            self.records[key] = self._measure(point, limit or {}, timeout, launch or {})
        record = self.records[key]
        measured = {name: record[name] for name in ("date", "code", "load_average", "wall_s")}
        measured["machine"] = record.get("machine")
        return {**record["result"], **({"limit": record["limit"]} if record["limit"] else {}), "measured": measured}

    def _measure(self, point: dict, limit: dict, timeout: float, launch: dict) -> dict:
        """Run one point, append its record to the store's file and return the record."""
        date, load_before, started = datetime.datetime.now(datetime.UTC), os.getloadavg(), self.clock()
        flags = {**point["flags"], **limit, "seed": point["seed"]}
        result = self.runner(point["trainer"], point["ranks"], flags, timeout, **launch)
        record = {
            **point,
            "limit": limit,
            "result": result,
            "date": date.isoformat(timespec="seconds"),
            "code": self.code,
            "machine": machine(),
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
            "wall_s": self.clock() - started,
        }
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        return record

    def seeded(
        self,
        phase: str,
        trainer: str,
        ranks: int,
        flags: dict,
        timeout: float,
        first_seed: int = 1,
        launch: dict | None = None,
    ) -> Callable[[int], dict | None]:
        """Return a run for `interleave`: repetition r trains `flags` with seed first_seed + r (`launch`: as
        `train`'s)."""
        return lambda rep: self.train(phase, trainer, ranks, flags, first_seed + rep, timeout, launch=launch)

    def provenance(self) -> dict:
        """The store's file, how many runs it holds, and the commits, machines (with their runs; records older than
        the field: "not recorded") and dates they were measured at."""
        records = self.records.values()
        dates = sorted(record["date"] for record in records)
        machines = collections.Counter(machine_label(record.get("machine")) for record in records)
        return {
            "file": repo_path(self.path),
            "runs": len(records),
            "commits": sorted({record["code"]["commit"] or "-" for record in records}),
            "machines": dict(sorted(machines.items())),
            "dates": [dates[0], dates[-1]] if dates else [],
        }


class Pruner:
    """Stop a tuning run once it can no longer win its race: pass it the training flag `flag` (a limit) at the best
    value of the result's `key` among the race's earlier runs, stored ones included, so that a benchmark run in
    chunks prunes as one long run does."""

    def __init__(self, store: PointStore, phase: str, key: str, flag: str):
        self.store, self.phase, self.key, self.flag = store, phase, key, flag
        self.best: dict = {}

    def seeded(self, race, trainer: str, ranks: int, flags: dict, timeout: float) -> Callable[[int], dict | None]:
        """Return a run for `interleave` that trains `flags` within its race's limit and records its result."""

        def run(rep: int) -> dict | None:
            limit = {self.flag: self.best[race]} if race in self.best else {}
            result = self.store.train(self.phase, trainer, ranks, flags, rep + 1, timeout, limit)
            if result is not None and result[self.key] is not None:
                self.best[race] = min(self.best.get(race, math.inf), result[self.key])
            return result

        return run


def progress(phase: str, runs: list[dict], expected: int) -> list[str]:
    """What a phase lacks, for Report.missing: ["PHASE n/N runs"] while it has fewer runs than expected."""
    return [f"{phase} {len(runs)}/{expected} runs"] if len(runs) < expected else []


def train_row(runs: list[dict], variant: str) -> dict:
    """Summarise one variant's `train` runs: how many reached the target, and the medians of the time and epochs
    to it, of the final accuracy and of samples/s (diverged runs have neither of the last two)."""
    mine = [run for run in runs if run["variant"] == variant]
    return {
        "reached": f"{sum(run['reached'] for run in mine)}/{len(mine)}",
        "tta_s": median([run["tta_s"] for run in mine]),
        "epochs": median([run["epochs"] for run in mine]),
        "accuracy": median_of(mine, "final_accuracy"),
        "samples_per_s": median_of(mine, "samples_per_s"),
    }


def measured(variants: dict[str, object], runs: list[dict]) -> dict[str, object]:
    """The variants that have runs (a point store's budget may have left some out)."""
    names = {run["variant"] for run in runs}
    return {name: variant for name, variant in variants.items() if name in names}


def best_of(variants: dict[str, object], runs: list[dict], race: Callable, key: str) -> dict:
    """Each race's (`race(variant)`) variant with the least median `key` among those with runs (ties, and none
    reaching the target: the most accurate)."""
    best = {}
    for name, variant in measured(variants, runs).items():
        row = train_row(runs, name)
        rank = (row[key] if row[key] is not None else math.inf, -(row["accuracy"] or 0.0))
        if race(variant) not in best or rank < best[race(variant)][0]:
            best[race(variant)] = (rank, variant)
    return {group: variant for group, (_, variant) in best.items()}


def spread(runs: list[dict], variant: str, key: str) -> tuple[float | None, float | None]:
    """Min and max of `key` over one variant's runs; max None when a run has none (did not reach the target)."""
    values = column(runs, variant, key)
    known = [value for value in values if value is not None]
    return (min(known) if known else None), (max(known) if known and len(known) == len(values) else None)


def mnist(test_samples: int):
    """MNIST's training set and the first `test_samples` of its test set (for runs that do not measure evaluation)."""
    from crossbow_mpi.data import ArrayDataset, build_dataset

    train, test = build_dataset("mnist", str(REPO / "datasets" / "mnist"), seed=1)
    return train, ArrayDataset(
        test.inputs[:test_samples], test.targets[:test_samples], test.num_classes, test.mean, test.std
    )


def crossbow_samples_per_s(config, model_fn, train_set, test_set) -> float:
    """Train with crossbow_mpi's Trainer inside this MPI job; return the training samples/s of its last evaluation
    window (evaluations excluded) on every rank."""
    *_, last_evaluation, _summary = crossbow_records(config, model_fn, train_set, test_set)
    return last_evaluation["samples_per_s"]


def crossbow_summary(config, model_fn, train_set, test_set) -> dict:
    """Train with crossbow_mpi's Trainer inside this MPI job; return its summary record on every rank."""
    return crossbow_records(config, model_fn, train_set, test_set)[-1]


def crossbow_records(config, model_fn, train_set, test_set) -> list[dict]:
    """Train with crossbow_mpi's Trainer inside this MPI job, in a fresh run directory shared by the ranks;
    return its metrics records on every rank."""
    from crossbow_mpi import Trainer
    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.runtime import process

    comm = MpiCommunicator(process.mpi().COMM_WORLD)
    run_dir = comm.bcast_json(tempfile.mkdtemp(prefix="bench-run-") if comm.rank == 0 else None)
    Trainer(dataclasses.replace(config, run_dir=run_dir), comm).fit(model_fn, train_set, test_set)
    records = None
    if comm.rank == 0:
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        shutil.rmtree(run_dir)
    return comm.bcast_json(records)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def interleave(variants: dict[str, Callable[[int], dict | None]], reps: int, quiet: bool = False) -> list[dict]:
    """Run repetition r of every variant before repetition r+1 (A B A B …), so that drift in the machine's
    load hits every variant alike; return the runs tagged with their variant and repetition, without those a
    point store's budget left out (None)."""
    runs = []
    for rep in range(reps):
        for variant, run in variants.items():
            result = run(rep)
            if result is None:
                continue
            if not quiet:
                log(f"  {variant} rep {rep}: {json.dumps(result)}")
            runs.append({"variant": variant, "rep": rep, **result})
    return runs


def median(values: list) -> float | None:
    """Median with None (not reached) ranked above every number; None when that is where the median falls."""
    ranked = sorted(math.inf if v is None else v for v in values)
    middle = statistics.median(ranked) if ranked else math.inf
    return None if math.isinf(middle) or math.isnan(middle) else middle


def column(runs: list[dict], variant: str, key: str) -> list:
    """The values of `key` in one variant's runs."""
    return [run[key] for run in runs if run["variant"] == variant]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator
