"""The communicator contract, through the MPI backend, at any number of ranks."""

import time

import pytest
import torch

from crossbow_mpi.comm import MpiCommunicator, build_communicator
from crossbow_mpi.comm.base import StopAgreement


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_allreduce_sums_in_place_and_broadcast_copies_root(comm, dtype):
    tensor = torch.arange(10, dtype=dtype) + comm.rank
    same = tensor.data_ptr()
    assert comm.allreduce_sum_(tensor) is tensor and tensor.data_ptr() == same
    assert torch.equal(tensor, (torch.arange(10) * comm.size + sum(range(comm.size))).to(dtype))
    mine = torch.full((7,), float(comm.rank), dtype=dtype)
    comm.broadcast_(mine, root=comm.size - 1)
    assert torch.equal(mine, torch.full((7,), float(comm.size - 1), dtype=dtype))


@pytest.mark.mpi(min_size=1)
def test_control_messages_travel_as_bytes_and_json(comm):
    assert comm.allgather_bytes(b"x" * comm.rank) == [b"x" * r for r in range(comm.size)]
    assert comm.bcast_json({"a": [1, 2]} if comm.rank == 0 else None) == {"a": [1, 2]}
    assert comm.allgather_json(comm.rank) == list(range(comm.size))
    parts = [bytes([r]) * (r + 1) for r in range(comm.size)] if comm.rank == 0 else None
    assert comm.scatter_bytes(parts) == bytes([comm.rank]) * (comm.rank + 1)
    assert comm.allreduce_sum_numbers([1.0, comm.rank]) == [comm.size, sum(range(comm.size))]


@pytest.mark.mpi(min_size=1)
def test_auto_on_a_cpu_uses_mpi(comm):
    assert isinstance(build_communicator(comm.mpi_comm, "auto", torch.device("cpu")), MpiCommunicator)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("lag", [0, 3])
def test_every_rank_stops_at_the_same_step_lag_steps_after_any_rank_asked(comm, lag):
    asked_at = {comm.size - 1: 5}  # only the last rank receives a signal, before its step 5
    step = 0
    stopping = StopAgreement(comm.mpi_comm, lag, lambda: step >= asked_at.get(comm.rank, 10**9))
    outcomes = []
    for step in range(12):
        outcomes.append(stopping.poll())
    stopping.close()
    assert outcomes == [False] * (5 + lag) + [True] * (12 - 5 - lag)


@pytest.mark.mpi(min_size=2)
def test_stop_votes_let_a_fast_rank_run_ahead_of_a_slow_one(comm):
    stopping = StopAgreement(comm.mpi_comm, 4, lambda: False)
    started = time.monotonic()
    for _ in range(4):
        if comm.rank == 0:
            time.sleep(0.5)
        assert not stopping.poll()
    ahead = time.monotonic() - started
    stopping.close()
    if comm.rank != 0:
        assert ahead < 0.5, "a rank waited for the slow rank's votes before their outcome was due"
