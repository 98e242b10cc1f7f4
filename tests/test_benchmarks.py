"""Every benchmark's quick mode runs and writes well-formed results (never checks speeds)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

COLUMNS = {
    "tta": {"layout", "phase", "role", "system", "k", "alpha", "b", "lr", "reached", "tta_s", "min", "max"}
    | {"epochs", "samples_per_s", "vs_ddp_best", "vs_ddp_same"},
    "stat_efficiency": {"algorithm", "aggregate", "k", "b", "lr", "alpha", "reached", "epochs", "accuracy", "tta_s"},
    "throughput": {"layout", "system", "samples_per_s", "vs_ddp"},
    "sync_cost": {
        "ranks",
        "model",
        "floats",
        "sma_step_us",
        "fused_step_us",
        "allreduce_us",
        "ratio",
        "memory_ratio",
        "peer_ratio",
    },
    "overhead": {"threads", "b", "crossbow_samples_per_s", "pytorch_samples_per_s", "crossbow_vs_pytorch"},
    "hw_limit": {
        "model",
        "config",
        "flops_per_sample",
        "samples_per_s",
        "achieved_gflops",
        "matmul_gflops",
        "fraction",
    },
    "hybrid": {"model", "variant", "reached", "tta_s", "samples_per_s", "vs_dp"},
    "omnivore": {"imbalance", "algorithm", "reached", "tta_s", "speedup", "groups", "momentum", "lr"},
    "hetero": {
        "imbalance",
        "algorithm",
        "reached",
        "tta_s",
        "accuracy",
        "samples_per_s",
        "speedup",
        "update_balance",
    },
}
RECORD_KEYS = {
    "benchmark",
    "question",
    "quick",
    "reps",
    "date",
    "wall_s",
    "command",
    "machine",
    "load_average",
    "settings",
    "columns",
    "rows",
    "runs",
    "files",
    "code",
}


@pytest.mark.parametrize("name", COLUMNS)
def test_quick_mode_writes_results(name, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert RECORD_KEYS <= result.keys()
    assert result["benchmark"] == name and result["quick"] is True and result["runs"]
    assert result["rows"] and all(COLUMNS[name] <= row.keys() for row in result["rows"])
    assert COLUMNS[name] <= set(result["columns"])
    table = done.stdout.rstrip().splitlines()[-len(result["rows"]) - 2 :]
    assert table[0].split() == result["columns"], "the table is not the last thing printed"
    if name == "stat_efficiency":
        assert (tmp_path / "stat_efficiency.png").stat().st_size > 0
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.report",
            "--results",
            str(tmp_path),
            "--output",
            str(tmp_path / "RESULTS.md"),
        ],
        cwd=REPO,
        timeout=60,
        check=True,
    )
    rendered = (tmp_path / "RESULTS.md").read_text()
    assert f"## {name}" in rendered and "| " + " | ".join(result["columns"]) + " |" in rendered


def fake_jobs(monkeypatch, outcomes: list[int]):
    """Make harness.mpirun exit with each of `outcomes` in turn, writing a run's metrics when it exits 0."""
    from benchmarks import harness

    calls = []

    def mpirun(ranks, args, timeout, env=None):
        calls.append(args)
        code = outcomes[len(calls) - 1]
        if code:
            raise harness.BenchmarkError(f"exited {code}: terminate called", code)
        run_dir = args[args.index("--run-dir") + 1]
        records = [
            {"test_accuracy": 0.99, "samples_per_s": 100.0},
            {
                "event": "summary",
                "reached": True,
                "time_to_accuracy_s": 5.0,
                "epochs": 1.0,
                "final_test_accuracy": 0.99,
            },
        ]
        with open(f"{run_dir}/metrics.jsonl", "w") as fh:
            fh.writelines(json.dumps(record) + "\n" for record in records)
        return ""

    monkeypatch.setattr(harness, "mpirun", mpirun)
    return harness, calls


def test_a_crashed_training_job_runs_again_and_the_crash_is_kept(monkeypatch):
    harness, calls = fake_jobs(monkeypatch, [134, 0])
    result = harness.train("ddp", 2, {"seed": 1}, timeout=10)
    assert len(calls) == 2 and result["reached"] and result["tta_s"] == 5.0
    assert len(result["crashes"]) == 1 and "terminate called" in result["crashes"][0]


def test_a_job_that_crashes_every_time_fails_the_benchmark_and_divergence_is_a_result(monkeypatch):
    harness, calls = fake_jobs(monkeypatch, [134, 134])
    with pytest.raises(harness.BenchmarkError, match="terminate called"):
        harness.train("ddp", 2, {"seed": 1}, timeout=10)
    from crossbow_mpi.train import EXIT_DIVERGED

    harness, calls = fake_jobs(monkeypatch, [EXIT_DIVERGED])
    assert harness.train("crossbow", 2, {"seed": 1}, timeout=10)["diverged"] and len(calls) == 1
