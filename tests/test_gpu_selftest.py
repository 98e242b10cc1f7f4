"""The GPU self-test's verdict: PASS only when every part ran, every GPU test ran and passed, and MNIST reached 99 %."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_selftest import pytest_counts, verdict

from helpers import REPO


def pytest_run(ranks=1, select="not two_ranks", **changes) -> dict:
    return {
        "ranks": ranks,
        "select": select,
        "exit_code": 0,
        "passed": 12,
        "failed": 0,
        "errors": 0,
        "skipped": 0,
        "deselected": 1,
        "problems": [],
        **changes,
    }


def passing_results() -> dict:
    return {
        "tests": [pytest_run(), pytest_run(2, "two_ranks", passed=1, deselected=13)],
        "sync_cost": [{"MiB": 1}],
        "throughput": [{"b": 16}],
        "mnist_to_99": {"reached": True, "time_to_accuracy_s": 41.5, "epochs": 3.0, "test_accuracy": 0.9912},
    }


def test_everything_passing_is_a_pass_naming_the_counts_and_the_time():
    assert verdict(passing_results()) == (
        True,
        "tests passed (12 on 1 rank(s) and 1 on 2 rank(s)); LeNet/MNIST reached 99 % in 41.5 s",
    )


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            {"sync_cost": {"error": "ConfigError: CuPy with NCCL is not installed"}},
            "1 part(s) raised an error; first sync_cost: ConfigError: CuPy with NCCL is not installed",
        ),
        ({"tests": {"error": "RuntimeError: pytest-mpi is not installed"}}, "first tests: RuntimeError: pytest-mpi"),
        (
            {
                "tests": [
                    pytest_run(skipped=13, passed=0, problems=["SKIPPED [13] tests/gpu/test_gpu.py: no CUDA device"])
                ]
            },
            "tests/gpu on 1 rank(s) (-k 'not two_ranks'): 13 skipped (a skip on a GPU is a failure); SKIPPED [13]",
        ),
        ({"tests": [pytest_run(failed=1, passed=11)]}, "1 failed"),
        ({"tests": [pytest_run(errors=2)]}, "2 errors"),
        (
            {"tests": [pytest_run(2, "two_ranks", exit_code=134, passed=0)]},
            "2 rank(s) (-k 'two_ranks'): exit code 134 with 0 passed",
        ),
        ({"tests": [pytest_run(passed=0, deselected=14, exit_code=5)]}, "exit code 5 with 0 passed"),
        (
            {"mnist_to_99": {"reached": False, "time_to_accuracy_s": None, "epochs": 10.0, "test_accuracy": 0.9871}},
            "LeNet/MNIST did not reach 99 % in 10 epochs (best 0.9871)",
        ),
    ],
)
def test_any_error_failure_skip_or_missed_target_is_a_fail_naming_it(change, reason):
    passed, why = verdict({**passing_results(), **change})
    assert not passed and reason in why


def test_pytest_counts_read_the_final_summary_line():
    output = (
        "=== MPI Information ===\nSKIPPED [1] tests/gpu/test_gpu.py:60: needs more ranks than GPUs\n"
        "1 failed, 11 passed, 1 skipped, 1 deselected, 2 errors in 41.20s\n"
    )
    assert pytest_counts(output) == {"passed": 11, "failed": 1, "errors": 2, "skipped": 1, "deselected": 1}
    assert pytest_counts("no summary") == {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "deselected": 0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_without_a_gpu_the_self_test_exits_non_zero_and_its_last_line_says_fail(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_selftest", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout.splitlines()[-1] == "gpu_selftest: FAIL: torch sees no CUDA device"
