"""The communicator contract, through the MPI backend, at any number of ranks, on the world and on split scopes
(as mpi4py's own tests run each test on COMM_WORLD, COMM_SELF and duplicates)."""

import time

import pytest
import torch

from crossbow_mpi.comm import MpiCommunicator, build_communicator
from crossbow_mpi.comm.base import LaggedVote

SCOPES = ["world", "halves", "reversed", "self"]


@pytest.fixture(params=SCOPES)
def scope(request, comm):
    """A scope of the world: itself, its two halves, its ranks in reverse order, or this rank alone."""
    if request.param == "world":
        return comm
    if request.param == "halves":
        return comm.split(comm.rank < comm.size // 2, comm.rank)
    if request.param == "reversed":
        return comm.split(0, comm.size - comm.rank)
    return comm.split(comm.rank)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_allreduce_sums_in_place_and_broadcast_copies_root(scope, dtype):
    tensor = torch.arange(10, dtype=dtype) + scope.rank
    same = tensor.data_ptr()
    reduction = scope.allreduce_sum_(tensor)
    assert reduction.total is tensor and tensor.data_ptr() == same and reduction.contributions == scope.size
    assert torch.equal(tensor, (torch.arange(10) * scope.size + sum(range(scope.size))).to(dtype))
    mine = torch.full((7,), float(scope.rank), dtype=dtype)
    scope.broadcast_(mine, root=scope.size - 1)
    assert torch.equal(mine, torch.full((7,), float(scope.size - 1), dtype=dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunk_bytes", [None, 40])
def test_two_ranks_sum_by_their_exchange_with_the_bits_of_mpis_allreduce(comm, monkeypatch, chunk_bytes):
    from crossbow_mpi.comm import mpi

    if chunk_bytes is not None:
        monkeypatch.setattr(mpi, "PAIR_CHUNK_BYTES", chunk_bytes)  # 10 float32 or 5 float64 a chunk, the last one short
    pair = MpiCommunicator(comm.mpi_comm.Split(comm.rank // 2, comm.size - comm.rank), pair=True)  # reversed pairs
    for n, dtype in [(103, torch.float32), (1001, torch.float32), (7, torch.float64), (0, torch.float32)]:
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank), dtype=dtype) * 1e3
        expected = tensor.clone()
        if pair.size == 2:
            pair.mpi_comm.Allreduce(comm.mpi().IN_PLACE, expected.numpy())
        pair.allreduce_sum_(tensor)
        assert tensor.dtype == dtype and torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))
    assert pair.size == 1 or pair._pair_rooms, "the pair's sum did not take its exchange"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pair", [True, False])
def test_a_started_sum_has_the_bits_of_mpis_allreduce(comm, pair):
    scope = MpiCommunicator(comm.mpi_comm.Split(comm.rank // 2, comm.size - comm.rank), pair=pair)
    for n in (0, 7, 1001):
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank)) * 1e3
        expected = tensor.clone()
        scope.mpi_comm.Allreduce(comm.mpi().IN_PLACE, expected.numpy())
        pending = scope.iallreduce_sum_(tensor)
        scope.allreduce_sum_(torch.ones(3))  # a blocking sum while it is in flight keeps to its own messages
        pending.wait()
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))
    assert len(pending.requests) == (2 if pair and scope.size == 2 else 1), "the pair's sum did not take its exchange"


@pytest.mark.mpi(min_size=2)
def test_two_ranks_that_share_memory_keep_mpis_allreduce(comm):
    pair = comm.split(comm.rank // 2, comm.rank)
    pair.allreduce_sum_(torch.ones(10))
    assert not pair._pairs() and not pair._pair_rooms


@pytest.mark.mpi(min_size=1)
def test_control_messages_travel_as_bytes_and_json(scope):
    assert scope.allgather_bytes(b"x" * scope.rank) == [b"x" * r for r in range(scope.size)]
    gathered = scope.gather_bytes(b"y" * scope.rank, root=scope.size - 1)
    assert gathered == ([b"y" * r for r in range(scope.size)] if scope.rank == scope.size - 1 else None)
    assert scope.bcast_json({"a": [1, 2]} if scope.rank == 0 else None) == {"a": [1, 2]}
    assert scope.allgather_json(scope.rank) == list(range(scope.size))
    parts = [bytes([r]) * (r + 1) for r in range(scope.size)] if scope.rank == 0 else None
    assert scope.scatter_bytes(parts) == bytes([scope.rank]) * (scope.rank + 1)
    assert scope.allreduce_sum_numbers([1.0, scope.rank]) == [scope.size, sum(range(scope.size))]


@pytest.mark.mpi(min_size=1)
def test_named_tensors_travel_as_a_layout_and_raw_bytes(scope):
    root = scope.size - 1
    sent = {
        "step": torch.tensor(7, dtype=torch.int64),
        "m": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "none": torch.empty(0, 4),
    }
    got = scope.bcast_tensors(sent if scope.rank == root else {"other": torch.ones(3)}, root=root)
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


@pytest.mark.mpi(min_size=2)
def test_split_scopes_hold_the_ranks_they_name(comm):
    halves = comm.split(comm.rank < comm.size // 2, comm.rank)
    members = halves.allgather_json(comm.rank)
    assert members == sorted(r for r in range(comm.size) if (r < comm.size // 2) == (comm.rank < comm.size // 2))
    assert comm.split(0, comm.size - comm.rank).allgather_json(comm.rank) == list(reversed(range(comm.size)))


@pytest.mark.mpi(min_size=1)
def test_auto_on_a_cpu_uses_mpi(comm):
    assert isinstance(build_communicator(comm.mpi_comm, "auto", torch.device("cpu")), MpiCommunicator)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("lag", [0, 3])
def test_every_rank_stops_at_the_same_step_lag_steps_after_any_rank_asked(scope, lag):
    comm = scope
    asked_at = {comm.size - 1: 5}  # only the last rank receives a signal, before its step 5
    step = 0
    stopping = LaggedVote(comm, lag, lambda: step >= asked_at.get(comm.rank, 10**9))
    outcomes = []
    while step < 12:  # the vote reads `step`
        outcomes.append(stopping.poll())
        step += 1
    stopping.close()
    assert outcomes == [False] * (5 + lag) + [True] * (12 - 5 - lag)


@pytest.mark.mpi(min_size=2)
def test_stop_votes_let_a_fast_rank_run_ahead_of_a_slow_one(comm):
    stopping = LaggedVote(comm, 4, lambda: False)
    started = time.monotonic()
    for _ in range(4):
        if comm.rank == 0:
            time.sleep(0.5)
        assert not stopping.poll()
    ahead = time.monotonic() - started
    stopping.close()
    if comm.rank != 0:
        assert ahead < 0.5, "a rank waited for the slow rank's votes before their outcome was due"


@pytest.mark.mpi(min_size=1)
def test_a_watchdog_closes_without_waiting_out_its_interval(comm):
    from crossbow_mpi.runtime.watchdog import MAX_INTERVAL_S, Watchdog

    watchdog = Watchdog(comm, timeout=300)
    assert watchdog.interval == MAX_INTERVAL_S
    time.sleep(0.2)
    started = time.monotonic()
    watchdog.close()
    assert time.monotonic() - started < MAX_INTERVAL_S / 2, "closing waited for the next heartbeat"


@pytest.mark.mpi(min_size=2)
def test_a_closed_watchdog_leaves_no_heartbeat_in_flight(comm):
    """Open MPI gives a freed communicator's id to the next one made: a heartbeat still in flight when the watchdog
    freed its channel would arrive on that one."""
    from crossbow_mpi.runtime.watchdog import Watchdog

    watchdog = Watchdog(comm, timeout=20)
    if comm.rank != 0:
        time.sleep(2.5 * watchdog.interval)  # rank 0 closes first; the others go on sending heartbeats
    watchdog.close()
    comm.barrier()
    after = [comm.mpi_comm.Dup() for _ in range(4)]
    time.sleep(0.5)
    leaked = [c.Iprobe(source=comm.mpi().ANY_SOURCE, tag=comm.mpi().ANY_TAG) for c in after]
    for c in after:
        c.Free()
    assert not any(leaked), "a heartbeat of the closed watchdog arrived on a communicator made after it"
