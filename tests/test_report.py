"""`python -m crossbow_mpi.report` over real run directories, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from crossbow_mpi import Trainer
from crossbow_mpi.report import RunRecords, draw, read_run, settle_epoch, summary_line

from helpers import (
    HalveLrAt,
    assert_user_error,
    run_job,
    run_tool,
    self_comm,
    snapshot_config,
    snapshot_datasets,
    snapshot_mlp,
)

pytestmark = pytest.mark.slow

RUN = [
    "--dataset",
    "synthetic-mnist",
    "--model",
    "mlp",
    "--epochs",
    "0.2",
    "--eval-every",
    "2000",
    "--target-accuracy",
    "0.45",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories of an auto-tuned SMA run, an eager-SGD run, an Adaptive Hogbatch run with a slow rank and an
    Omnivore run with its optimizer (CLI, two ranks), and of a run whose learning rate a controller halves (API, one
    rank)."""
    base = tmp_path_factory.mktemp("runs")
    for name, extra in {
        "auto": ["--learners", "auto", "--autotune-interval", "10"],
        "eager": ["--algorithm", "eager", "--learners", "2"],
        "adaptive": [
            *("--algorithm", "hogbatch", "--learners", "1", "--batch-size", "16,16", "--round-samples", "320"),
            *("--adaptive-batch", "--adapt-every", "1", "--batch-step", "2", "--inject-imbalance", "slow-rank:1:4"),
        ],
        "omnivore": ["--algorithm", "omnivore", "--groups", "auto", "--learners", "1", "--probe-seconds", "0.05"],
    }.items():
        job = run_job(2, ["--run-dir", str(base / name), *RUN, *extra], timeout=180)
        assert job.returncode == 0, job.stderr
    train, test = snapshot_datasets()
    Trainer(snapshot_config(base / "controlled", eval_every=160), self_comm()).fit(
        snapshot_mlp, train, test, controllers=[HalveLrAt(5)]
    )
    return [base / "auto", base / "eager", base / "controlled", base / "adaptive", base / "omnivore"]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_report_writes_a_png_and_a_summary_of_each_run(runs, tmp_path):
    out = tmp_path / "report.png"
    done = run_tool("crossbow_mpi.report", *map(str, runs), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)
    for run_dir in runs:
        last = [r for r in records(run_dir) if "test_accuracy" in r][-1]
        assert f"{run_dir.name}: " in done.stdout
        assert f"final test accuracy {last['test_accuracy']:.4f} at {last['time_s']:.1f} s" in done.stdout
    summary = next(r for r in records(runs[1]) if r.get("event") == "summary")
    if summary["reached"]:
        assert f"target 45.00% reached in {summary['time_to_target_s']:.1f} s" in done.stdout
    else:
        assert "target 45.00% not reached" in done.stdout


def test_every_panel_is_labelled_and_the_legend_names_each_run_once(runs):
    loaded = [read_run(str(run_dir)) for run_dir in runs]
    figure = draw(loaded)
    titles = [ax.get_title() for ax in figure.axes]
    assert all(ax.get_xlabel() and ax.get_ylabel() and ax.get_title() for ax in figure.axes)
    assert [t.get_text() for t in figure.legends[0].get_texts()] == [run.label for run in loaded]
    assert any(title.startswith("eager-SGD") for title in titles)
    assert "2 rank(s) × auto learners" in loaded[0].label and "eager, solo" in loaded[1].label
    panel = dict(zip(titles, figure.axes, strict=True))
    learners = panel["Learners per rank"].lines[0].get_ydata()
    assert len(set(learners)) > 1, "the auto-tuner's changes are drawn"
    changes = panel["Learning rate and hyper-parameter changes"].texts
    assert any("lr 0.05→0.025" in text.get_text() for text in changes)
    [adaptive] = [ax for title, ax in panel.items() if title.startswith("Adaptive batch sizes per rank")]
    batch_sizes = [line.get_ydata() for line in adaptive.lines[::2]]
    assert len(batch_sizes) == 2 and batch_sizes[1][-1] < 16, "the slow rank's batch size shrinks"
    changes = [r for r in records(runs[3]) if r.get("event") == "hyperparams"]
    assert all(len(c["measured"]["shares"]) == 2 and len(c["changes"]["batch_size"][1]) == 2 for c in changes)
    [optimizer] = [ax for title, ax in panel.items() if title.startswith("Omnivore's optimizer")]
    searched = [r for r in records(runs[4]) if r.get("event") == "optimizer"]
    probes = [r for r in searched if r["decision"] == "probe"]
    assert len(optimizer.lines) == len(searched), "one mark per probe, one line per decision"
    choice = next(r for r in searched if r["decision"] == "choice")
    setting = f"{choice['groups']}/{choice['momentum']:g}/{choice['lr']:g}"
    assert any(t.get_text() == f"choice: g/μ/η {setting}" for t in optimizer.texts) and len(probes) >= 4
    assert not any(title.startswith("eager-SGD") for title in (ax.get_title() for ax in draw(loaded[:1]).axes))


def bad_input(runs, tmp_path, case: str) -> list[str]:
    """Return report's arguments for a user mistake."""
    out = ["--out", str(tmp_path / "report.png")]
    if case == "missing dir":
        return [str(tmp_path / "nowhere"), *out]
    if case == "no metrics":
        return [str(tmp_path), *out]
    if case == "empty metrics":
        (tmp_path / "metrics.jsonl").write_text("")
        return [str(runs[0]), str(tmp_path), *out]
    if case == "no evaluation":
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "preempted", "iteration": 3, "time_s": 1}) + "\n")
        return [str(tmp_path), *out]
    if case == "not json":
        (tmp_path / "metrics.jsonl").write_text(json.dumps(records(runs[0])[0]) + '\n{"time_s": 1,\n')
        return [str(tmp_path), *out]
    if case == "unwritable out":
        return [str(runs[0]), "--out", str(tmp_path / "no-such-dir" / "report.png")]
    assert case == "no out"
    return [str(runs[0])]


ERRORS = {
    "missing dir": "no such run directory",
    "no metrics": "metrics.jsonl: missing",
    "empty metrics": "no evaluation records (empty file)",
    "no evaluation": "no evaluation records",
    "not json": "line 2 is not JSON",
    "unwritable out": "--out",
    "no out": "required: --out",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_exits_2_with_one_line(runs, tmp_path, case):
    done = run_tool("crossbow_mpi.report", *bad_input(runs, tmp_path, case))
    assert_user_error(done, "crossbow_mpi.report", ERRORS[case])
    assert not (tmp_path / "report.png").exists()


def test_settle_epoch_is_where_samples_per_s_first_reach_nine_tenths_of_the_settled():
    throughput = [(0.1, 100.0), (0.2, 850.0), (0.3, 1000.0), (0.4, 950.0), (0.5, 1050.0)]
    assert settle_epoch(throughput) == 0.3
    assert settle_epoch(throughput[:1]) is None
    evaluations = [
        {"epoch": e, "samples_per_s": r, "test_accuracy": 0.5, "time_s": e, "iteration": 1} for e, r in throughput
    ]
    change = {"event": "hyperparams", "time_s": 0.1, "changes": {"batch_size": [[16, 16], [48, 1]]}}
    adaptive = RunRecords("adaptive", {}, evaluations, [change])
    assert "90 % of settled samples/s reached at epoch 0.300" in summary_line(adaptive)
    assert "settled" not in summary_line(RunRecords("fixed", {}, evaluations, []))
