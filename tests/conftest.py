"""Shared fixtures; under MPI a failing test aborts the job so that the other ranks cannot hang."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MNIST_DIR = REPO / "datasets" / "mnist"


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("mpi") and _world().Get_size() > 1:
        sys.stderr.write(f"\n[rank {_world().Get_rank()}] {item.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        _world().Abort(1)


@pytest.fixture
def comm():
    """This job's communicator (MPI backend)."""
    from crossbow_mpi.comm import MpiCommunicator

    return MpiCommunicator(_world())


def self_comm():
    """A communicator of this process alone (MPI backend), for a single-process run inside any test."""
    from crossbow_mpi.comm import MpiCommunicator

    return MpiCommunicator(_world().Split(_world().Get_rank()))


@pytest.fixture
def shared_tmp(comm):
    """A temporary directory made by rank 0 and seen by every rank."""
    path = tempfile.mkdtemp(prefix="crossbow-test-") if comm.rank == 0 else None
    path = comm.bcast_json(path)
    yield Path(path)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def mpirun_command(ranks: int) -> list[str]:
    """Return an mpirun prefix for `ranks` processes that may oversubscribe this machine's cores."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    assert mpirun, "no mpirun on PATH"
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    extra = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    return [mpirun, "-n", str(ranks), *extra]


def run_job(ranks: int, args: list[str], timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `python -m crossbow_mpi.train ARGS` on `ranks` ranks; fail the test on a hang."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    cmd = mpirun_command(ranks) + [sys.executable, "-m", "crossbow_mpi.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def run_tool(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (a single-process tool) in the repository; fail the test on a hang."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def assert_user_error(done: subprocess.CompletedProcess, module: str, message: str) -> None:
    """Assert that a tool exited with code 2 and one line on stderr, `MODULE: error: ...MESSAGE...`."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{module}: error: ") and message in lines[0], lines[0]
