"""Shared fixtures; under MPI a failing test aborts the job so that the other ranks cannot hang."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

try:
    from helpers import mpirun_command, world
except ModuleNotFoundError:  # imported as tests.conftest outside pytest (benchmarks/gpu_selftest.py)
    from tests.helpers import mpirun_command, world

__all__ = ["mpirun_command"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("mpi") and world().Get_size() > 1:
        sys.stderr.write(f"\n[rank {world().Get_rank()}] {item.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        world().Abort(1)


@pytest.fixture
def comm():
    """This job's communicator (MPI backend)."""
    from crossbow_mpi.comm import MpiCommunicator

    return MpiCommunicator(world())


@pytest.fixture
def shared_tmp(comm):
    """A temporary directory made by rank 0 and seen by every rank."""
    path = tempfile.mkdtemp(prefix="crossbow-test-") if comm.rank == 0 else None
    path = comm.bcast_json(path)
    yield Path(path)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
