"""Command line: `python -m crossbow_mpi.report RUN_DIR [RUN_DIR ...] --out report.png` draws runs side by side from
their metrics.jsonl (and config.json for the legend), and prints each run's time to target and final accuracy."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crossbow_mpi.config import ArgumentParser, ConfigError
from crossbow_mpi.train import EXIT_USER_ERROR
from crossbow_mpi.training.checkpoint import refuse_overwrite

EAGER_FRESH = "eager_fresh_per_round"


@dataclass
class RunRecords:
    """One run directory's records."""

    label: str
    """Legend entry: the directory's name, its algorithm and key settings."""
    config: dict
    """config.json (empty when absent)."""
    evaluations: list[dict]
    """Evaluation records, in order."""
    events: list[dict]
    """Records with an `event` key (autotune, hyperparams, summary, preempted)."""

    def of(self, event: str) -> list[dict]:
        return [r for r in self.events if r["event"] == event]

    def time_to_target(self) -> float | None:
        """Seconds to the first evaluation that reached the config's target accuracy or loss (as the trainer
        counts)."""
        target, target_loss = self.config.get("target_accuracy", 0), self.config.get("target_loss")
        return next(
            (
                r["time_s"]
                for r in self.evaluations
                if (r["test_accuracy"] is not None and r["test_accuracy"] >= target > 0)
                or (target_loss is not None and r["test_loss"] <= target_loss)
            ),
            None,
        )


def read_run(run_dir: str) -> RunRecords:
    """Read a run directory's records; ConfigError when they are missing, empty or malformed."""
    directory = Path(run_dir)
    if not directory.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    path = directory / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (not a crossbow_mpi run directory?)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: unreadable ({err})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}: line {number} is not JSON") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: line {number} is not a JSON object")
        records.append(record)
    evaluations = [r for r in records if "event" not in r and "test_accuracy" in r]
    if not evaluations:
        raise ConfigError(f"{path}: no evaluation records" + ("" if records else " (empty file)"))
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{config_path}: unreadable ({err})") from None
    events = [r for r in records if "event" in r]
    return RunRecords(_label(directory.resolve().name, config, events), config, evaluations, events)


def _label(name: str, config: dict, events: list[dict]) -> str:
    if not config:
        return name
    ranks = next((r["world_size"] for r in events if r["event"] == "summary"), "?")
    extra = f", {config['eager_mode']}" if config["algorithm"] == "eager" else ""
    return (
        f"{name}: {config['algorithm']}{extra}, {config['model']}/{config['dataset']}, {ranks} rank(s) × "
        f"{config['learners']} learners, batch {config['batch_size']}, lr {config['lr']:g}"
    )


def summary_line(run: RunRecords) -> str:
    """One line: final accuracy, when and after how much training, and the time to the target."""
    last = run.evaluations[-1]
    target, target_loss = run.config.get("target_accuracy", 0), run.config.get("target_loss")
    targets = " or ".join(
        ([f"{target:.2%}"] if target > 0 else []) + ([f"test loss {target_loss:g}"] if target_loss is not None else [])
    )
    reached = run.time_to_target()
    if not targets:
        outcome = "no target"
    elif reached is None:
        outcome = f"target {targets} not reached"
    else:
        outcome = f"target {targets} reached in {reached:.1f} s"
    unfinished = "" if run.of("summary") else "; no summary record (stopped early or still running)"
    settled = settle_epoch(_throughput(run)) if _batch_changes(run) else None
    settling = "" if settled is None else f"; 90 % of settled samples/s reached at epoch {settled:.3f}"
    accuracy = last["test_accuracy"]
    final = f"test loss {last['test_loss']:.4f}" if accuracy is None else f"test accuracy {accuracy:.4f}"
    return (
        f"{run.label}\n    final {final} at {last['time_s']:.1f} s, epoch "
        f"{last['epoch']:.2f}, iteration {last['iteration']}; {outcome}{settling}{unfinished}"
    )


def settle_epoch(throughput: list[tuple[float, float]]) -> float | None:
    """The first epoch at which samples/s reaches 90 % of its settled value, the median over the second half of
    the (epoch, samples/s) evaluations; None with fewer than two."""
    if len(throughput) < 2:
        return None
    settled = statistics.median(rate for _, rate in throughput[len(throughput) // 2 :])
    return next(epoch for epoch, rate in throughput if rate >= 0.9 * settled)


def _throughput(run: RunRecords) -> list[tuple[float, float]]:
    return [(r["epoch"], r["samples_per_s"]) for r in run.evaluations]


def _panels(runs: list[RunRecords]) -> list[tuple[str, str, str, Callable]]:
    """Return (title, x label, y label, draw(ax, run, color)) for every panel some run has data for."""
    panels = [
        ("Test accuracy over time", "training time (s)", "test accuracy", _series("time_s", "test_accuracy")),
        ("Test accuracy per epoch", "epoch", "test accuracy", _series("epoch", "test_accuracy")),
        ("Training loss", "epoch", "mean training loss since the last evaluation", _series("epoch", "train_loss")),
        ("Test loss over time (dashed: the loss target)", "training time (s)", "test loss", _draw_test_loss),
        ("Throughput", "training time (s)", "samples/s (all ranks)", _series("time_s", "samples_per_s")),
        ("Learners per rank", "training time (s)", "learners per rank", _draw_learners),
        ("Learning rate and hyper-parameter changes", "training time (s)", "learning rate", _draw_hyperparams),
    ]
    if any(run.of("optimizer") for run in runs):
        panels.append(
            (
                "Omnivore's optimizer: probe scores (dots, labelled g/μ/η, with --algorithm auto\nthe algorithm first; "
                "x: diverged) and decisions (lines)",
                "probe, in search order",
                "mean training loss over the probe's last steps",
                _draw_optimizer,
            )
        )
    if any(_batch_changes(run) for run in runs):
        panels.append(
            (
                "Adaptive batch sizes per rank (solid, labelled by rank)\nand each rank's update share p_i (dotted)",
                "training time (s)",
                "batch size per learner; p_i × 100",
                _draw_batches,
            )
        )
        panels.append(
            (
                "Throughput while the batch sizes adapt (dotted: 90 % of settled samples/s reached)",
                "epoch",
                "samples/s (all ranks)",
                _draw_settling,
            )
        )
    if any(EAGER_FRESH in r for run in runs for r in run.evaluations):
        panels.append(
            (
                "eager-SGD: fresh contributions per round (solid),\nsynchronous share of rounds (dashed)",
                "training time (s)",
                "per round",
                _draw_eager,
            )
        )
    return panels


def _series(x: str, y: str):
    def draw(ax, run: RunRecords, color) -> None:
        points = [(r[x], r[y]) for r in run.evaluations if r.get(y) is not None]  # no accuracy for some models
        ax.plot([p for p, _ in points], [v for _, v in points], color=color, marker=".")

    return draw


def _draw_test_loss(ax, run: RunRecords, color) -> None:
    _series("time_s", "test_loss")(ax, run, color)
    if run.config.get("target_loss") is not None:
        ax.axhline(run.config["target_loss"], color=color, linestyle="--")


def _step(ax, points: list[tuple[float, float]], color) -> None:
    """Draw a value that holds from each (time, value) until the next."""
    points = sorted(points)
    ax.step([t for t, _ in points], [v for _, v in points], where="post", color=color)


def _draw_learners(ax, run: RunRecords, color) -> None:
    _step(ax, [(r["time_s"], r["learners"]) for r in run.evaluations + run.of("autotune")], color)


def _draw_hyperparams(ax, run: RunRecords, color) -> None:
    changes = [(c["time_s"], c["changes"]["lr"][1]) for c in run.of("hyperparams") if "lr" in c["changes"]]
    _step(ax, [(r["time_s"], r["lr"]) for r in run.evaluations] + changes, color)
    per_rank = _batch_changes(run)  # drawn in their own panel
    for change in (c for c in run.of("hyperparams") if c not in per_rank):
        text = ", ".join(f"{name} {_value(old)}→{_value(new)}" for name, (old, new) in change["changes"].items())
        _mark(ax, change["time_s"], text, color, ":")


def _mark(ax, x: float, text: str, color, linestyle: str) -> None:
    """Draw a vertical line at x with `text` along it, from the top."""
    ax.axvline(x, color=color, linestyle=linestyle)
    ax.annotate(
        text, (x, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7, color=color
    )


def _value(value) -> str:
    """Format a hyper-parameter: a number, or one per rank."""
    return ",".join(map(_value, value)) if isinstance(value, (list, tuple)) else f"{value:g}"


def batch_size_changes(records: list[dict]) -> list[dict]:
    """The `hyperparams` records among `records` that change the batch size per rank (adaptive batches), in order."""
    changes = [r for r in records if r.get("event") == "hyperparams"]
    return [c for c in changes if isinstance(c["changes"].get("batch_size", [0, 0])[1], list)]


def _batch_changes(run: RunRecords) -> list[dict]:
    return batch_size_changes(run.events)


def _draw_batches(ax, run: RunRecords, color) -> None:
    """Draw each rank's batch size (solid; rank r's marker is its number) and its measured share p_i × 100
    (dotted) after every adaptive change."""
    changes = _batch_changes(run)
    if not changes:
        return
    first = changes[0]
    for rank in range(len(first["changes"]["batch_size"][0])):
        points = [(first["time_s"], first["changes"]["batch_size"][0][rank])]
        points += [(c["time_s"], c["changes"]["batch_size"][1][rank]) for c in changes]
        _step(ax, points, color)
        ax.annotate(str(rank), points[-1], color=color, fontsize=8)
        shares = [(c["time_s"], 100 * c["measured"]["shares"][rank]) for c in changes if "measured" in c]
        ax.plot([t for t, _ in shares], [p for _, p in shares], color=color, linestyle=":", marker=".")


def _draw_settling(ax, run: RunRecords, color) -> None:
    """Draw samples/s per epoch and mark where it first reaches 90 % of its settled value."""
    throughput = _throughput(run)
    ax.plot([epoch for epoch, _ in throughput], [rate for _, rate in throughput], color=color, marker=".")
    settled = settle_epoch(throughput)
    if settled is not None:
        ax.axvline(settled, color=color, linestyle=":")


def _draw_optimizer(ax, run: RunRecords, color) -> None:
    """Draw the optimizer's probes in search order and a vertical line, labelled with its choice, after each
    decision (the cold start's choice and every re-tune)."""
    probes = 0
    finite = [p["score"] for p in run.of("optimizer") if p["decision"] == "probe" and p["score"] is not None]
    top = max(finite, default=1.0)
    for record in run.of("optimizer"):
        setting = f"{record['groups']}/{record['momentum']:g}/{record['lr']:g}"
        algorithm = f"{record['algorithm']} " if run.config.get("algorithm") == "auto" else ""
        if record["decision"] == "probe":
            diverged = record["score"] is None
            ax.plot(probes, top if diverged else record["score"], color=color, marker="x" if diverged else ".")
            ax.annotate(algorithm + setting, (probes, top if diverged else record["score"]), fontsize=6, color=color)
            probes += 1
        else:
            _mark(ax, probes - 0.5, f"{record['decision']}: {algorithm}g/μ/η {setting}", color, "--")


def _draw_eager(ax, run: RunRecords, color) -> None:
    rows = [r for r in run.evaluations if EAGER_FRESH in r]
    times = [r["time_s"] for r in rows]
    ax.plot(times, [r[EAGER_FRESH] for r in rows], color=color, marker=".")
    ax.plot(times, [r["eager_sync_rounds"] / max(r["eager_rounds"], 1) for r in rows], color=color, linestyle="--")


def draw(runs: list[RunRecords]):
    """Return a matplotlib figure with one panel per quantity and one line (colour) per run."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("matplotlib is not installed (pip install 'crossbow_mpi[report]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(runs)
    columns = 3
    rows = -(-len(panels) // columns)
    legend_height = 0.25 * len(runs) + 0.2
    height = 4.2 * rows + legend_height
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, height), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, xlabel, ylabel, draw_run) in zip(axes.flat, panels, strict=False):
        for index, run in enumerate(runs):
            draw_run(ax, run, colors[index % len(colors)])
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    handles = [plt.Line2D([], [], color=colors[i % len(colors)]) for i in range(len(runs))]
    figure.legend(handles, [run.label for run in runs], loc="lower center", ncol=1, fontsize=9)
    figure.tight_layout(rect=(0, legend_height / height, 1, 1))
    return figure


def report(run_dirs: list[str], out: str) -> list[str]:
    """Draw the runs into `out` (PNG); return each run's summary line."""
    refuse_overwrite(out)
    runs = [read_run(run_dir) for run_dir in run_dirs]
    figure = draw(runs)
    try:
        figure.savefig(out, dpi=100, format="png")  # to `out` exactly: without a suffix matplotlib adds .png
    except (OSError, ValueError) as err:
        raise ConfigError(f"--out {out}: {getattr(err, 'strerror', None) or err}") from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
    return [summary_line(run) for run in runs]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m crossbow_mpi.report",
        allow_abbrev=False,
        description="Draw runs side by side and print their time to target and final accuracy.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl)")
    parser.add_argument("--out", metavar="FILE", required=True, help="the image to write (PNG)")
    try:
        args = parser.parse_args(argv)
        lines = report(args.run_dirs, args.out)
    except ConfigError as err:
        print(f"crossbow_mpi.report: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
