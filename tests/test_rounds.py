"""Asynchronous rounds (Omnivore's groups, Hogbatch's and elastic averaging's ranks): the server hands out every
position of a round once and applies every update once, a snapshot after a meet holds the counters of the state met
(though a faster group's next update is applied already), a faster group takes more steps, a Hogbatch run takes no
sample twice in an epoch, a slow rank makes fewer updates, Adaptive Hogbatch shrinks the slow rank's batches, and
elastic averaging on equal ranks is synchronous averaging."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from crossbow_mpi import Trainer
from crossbow_mpi.comm.base import wait_sleeping
from crossbow_mpi.transports.model_server import ModelServer

from helpers import (
    BATCH,
    SLOWDOWN,
    STEPS,
    datasets,
    divisors,
    metrics_records,
    mlp_bn_float64,
    rounds_run,
    run_config,
    run_job,
)
from reference import elastic_reference, relative_error


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("late", [False, True])
def test_a_round_hands_out_every_position_once_and_applies_every_update_once(comm, late):
    """Test mode: the held state counts, per sample, the updates that carried it. With `late`, the last group
    starts only once every other group finished the round: it takes only its first step."""
    offset, end, limit = 5, 5 + 40 * comm.size, 60 * comm.size
    for groups in divisors(comm.size):
        group = comm.split(comm.rank // (comm.size // groups), comm.rank)
        server = ModelServer(comm, group, groups)
        server.serve((torch.zeros(limit, dtype=torch.float64),), lambda held, message, params: held[0].add_(message))
        group_steps = [3 + g for g in range(groups)]  # unequal steps: groups of unequal batch sizes
        step = group_steps[server.group_index]
        late_group = late and groups > 1 and server.group_index == groups - 1
        sent = torch.zeros(limit, dtype=torch.float64)
        seen = torch.zeros(limit, dtype=torch.float64)
        position, steps = server.begin_round(offset, end, limit, group_steps), 0
        if late_group:
            wait_sleeping([comm.mpi_comm.Ibarrier()])
        while position is not None:
            update = torch.zeros(limit, dtype=torch.float64)
            if group.rank == 0:
                update[position : position + step] = 1.0
            sent += update
            position = server.exchange(update, seen, (), step)
            steps += 1
        if late and groups > 1 and not late_group:
            wait_sleeping([comm.mpi_comm.Ibarrier()])
        ended = server.end_round()
        held = torch.empty(limit, dtype=torch.float64)
        server.meet((held,))
        server.stop()
        comm.allreduce_sum_(sent)
        assert torch.equal(held, sent), "an update was lost or applied twice"
        assert held[offset:ended].eq(1).all() and held[:offset].eq(0).all() and held[ended:].eq(0).all()
        assert end <= ended < end + max(group_steps), "the round ends at the first step past its end"
        if late_group:
            assert steps == 1, "the late group found its round taken"
        assert server.statistics()["async_updates"] == comm.allgather_json(steps)[:: comm.size // groups]


@pytest.mark.mpi(min_size=2)
def test_the_servers_counters_are_those_of_the_state_met_while_a_faster_group_goes_on(comm):
    """A rollback snapshot holds the counters of the state every rank met with, though a faster group's first
    update of the next round reaches the server's thread before its rank reads them (a survivor of a rank loss
    restored a version one ahead of its z)."""
    server = ModelServer(comm, comm.split(comm.rank, comm.rank), comm.size)
    server.serve((torch.zeros(1, dtype=torch.float64),), lambda held, message, params: held[0].add_(message))
    held, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    assert server.begin_round(0, comm.size, 100, [1] * comm.size) == comm.rank
    assert server.exchange(one.clone(), held, (), 1) is None
    server.end_round()
    server.meet((held,))
    if comm.rank == 0:
        time.sleep(0.5)  # the server's rank is slow to read its counters
    else:
        server.exchange(one.clone(), held, (), 1)  # the next round's first update, at once
    met = server.state_dict()
    server.end_round()
    server.meet((held,))
    server.close()
    assert met == {"version": comm.size, "updates": [1] * comm.size}
    assert server.state_dict() == {"version": 2 * comm.size - 1, "updates": [1] + [2] * (comm.size - 1)}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["hogbatch", "elastic"])
def test_no_sample_is_taken_twice_and_a_slow_rank_makes_fewer_updates(comm, shared_tmp, algorithm):
    result, taken, records, num_samples, largest = rounds_run(comm, shared_tmp, algorithm)
    assert len(taken) == len(set(taken)), "a sample was taken twice in the epoch"
    assert len(taken) > num_samples - comm.size * largest, "the epoch was not taken"
    assert torch.isfinite(result.central).all()
    updates = [sum(r["async_updates"][rank] for r in records) for rank in range(comm.size)]
    assert len(records) >= 2 and all(len(r["async_updates"]) == comm.size for r in records)
    if algorithm == "hogbatch":
        assert sum(sum(r["async_staleness"]) for r in records) == sum(updates)
    if comm.size > 1:
        assert updates[-1] < min(updates[:-1]), f"the rank slower by {SLOWDOWN} made as many updates: {updates}"


@pytest.mark.mpi(min_size=2)
def test_adaptive_hogbatch_shrinks_the_slow_ranks_batches(comm, shared_tmp):
    _, taken, _, _, _ = rounds_run(comm, shared_tmp, adaptive_batch=True, adapt_every=1, batch_min=2, epochs=2)
    assert max(Counter(taken).values()) <= 2, "a sample was taken twice in one of the two epochs"
    changes = [r["changes"]["batch_size"] for r in metrics_records(comm, shared_tmp / "run") if "changes" in r]
    assert changes, "no batch size changed"
    first, last = changes[0][0], changes[-1][1]
    assert last[-1] < first[-1], f"the slow rank's batch size did not shrink: {changes}"
    assert last[0] >= first[0], f"a fast rank's batch size shrank: {changes}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners, local_momentum, base_batch", [(1, False, 0), (2, True, 2 * BATCH)])
def test_elastic_on_equal_ranks_is_synchronous_averaging(comm, shared_tmp, learners, local_momentum, base_batch):
    # --merge-l2 with k = 2: equal update counts leave the weights as they are, as in the artifact
    train, test = datasets(comm.size, learners)
    cfg = run_config(
        shared_tmp,
        algorithm="elastic",
        learners=learners,
        round_samples=comm.size * learners * BATCH,
        eval_every=40,
        local_momentum=local_momentum,
        merge_momentum=0.5,
        base_batch=base_batch,
        merge_l2=learners == 2,
    )
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)
    assert result.iterations == STEPS
    reference = elastic_reference(mlp_bn_float64, cfg, train, comm.size, learners, STEPS)
    assert relative_error(result.central, reference) < 1e-9
    gathered = comm.allgather_bytes(result.central.numpy().tobytes())
    assert all(g == gathered[0] for g in gathered), "the ranks' z differ after the merge"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["hogbatch", "elastic"])
def test_learners_auto_exits_2_with_one_line(tmp_path, algorithm):
    args = ["--run-dir", str(tmp_path / "run"), "--dataset", "synthetic-mnist", "--algorithm", algorithm]
    job = run_job(1, [*args, "--learners", "auto"], timeout=90)
    ours = [line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi:")]
    assert job.returncode == 2 and len(ours) == 1 and "Traceback" not in job.stderr, job.stderr
    assert f"--algorithm {algorithm} needs a fixed number of --learners" in ours[0]
