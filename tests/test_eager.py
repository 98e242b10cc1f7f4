"""eager-SGD: partial-allreduce rounds conserve every contribution, late ones land later, staleness is bounded,
drains never hang, all ranks keep one model, and a round with every rank's fresh gradient is S-SGD's step."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from crossbow_mpi import Config, Trainer
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.config import EAGER_MODES, ConfigError
from crossbow_mpi.train import parse_config
from crossbow_mpi.transports.partial_allreduce import PartialAllreduce

from helpers import BATCH, REPO, STEPS, datasets, evaluation_records, mlp_bn, run_config

LATE_S = 0.1
"""How long the late rank sleeps before each arrival: far longer than a round among the others."""


def same_on_every_rank(comm, array: np.ndarray) -> bool:
    gathered = comm.allgather_bytes(np.ascontiguousarray(array).tobytes())
    return all(g == gathered[0] for g in gathered)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", EAGER_MODES)
def test_rounds_carry_every_contribution_once_late_ones_later_and_within_the_bound(comm, mode):
    steps, sync_every, late = 10, 4, comm.size - 1
    partial = PartialAllreduce(comm, mode, sync_every, seed=3)
    rounds, histograms = [], []
    for step in range(steps):
        if comm.size > 1 and comm.rank == late:
            time.sleep(LATE_S)
        contribution = torch.zeros(comm.size * steps, dtype=torch.float64)
        contribution[comm.rank * steps + step] = 1
        rounds.append(partial.allreduce_sum_(contribution).total)
        histograms.append(partial.last.staleness)
    if partial.drain():
        rounds.append(partial.allreduce_sum_(torch.full((comm.size * steps,), np.nan, dtype=torch.float64)).total)
        histograms.append(partial.last.staleness)
    assert not partial.drain() and partial.thread is None
    rounds = torch.stack(rounds)
    assert same_on_every_rank(comm, rounds.numpy()) and same_on_every_rank(comm, np.stack(histograms))

    assert torch.equal(rounds.sum(0), torch.ones(comm.size * steps, dtype=torch.float64)), "lost or counted twice"
    assert ((rounds == 0) | (rounds == 1)).all()
    landed = rounds.argmax(0).reshape(comm.size, steps)
    staleness = landed - torch.arange(steps)
    assert staleness.min() >= 0 and staleness.max() <= sync_every - 1
    for number, histogram in enumerate(histograms):
        waited = staleness[landed == number]
        assert histogram.tolist() == np.bincount(waited.numpy(), minlength=sync_every).tolist()

    synchronous, eager = list(range(0, steps, sync_every)), [step for step in range(steps) if step % sync_every]
    assert (staleness[:, synchronous] == 0).all(), "a synchronous round waits for every rank"
    late_waited = staleness[late, eager]
    if comm.size > 1 and mode == "solo":
        assert (late_waited > 0).all() and staleness.max() == sync_every - 1
    if comm.size > 1 and mode == "majority":
        initiated = torch.tensor([partial.initiator(step) == late for step in eager])
        assert torch.equal(late_waited == 0, initiated)


@pytest.mark.mpi(min_size=1)
def test_majority_initiators_are_the_same_on_every_rank(comm):
    partial = PartialAllreduce(comm, "majority", 32, seed=11)
    initiators = np.array([partial.initiator(number) for number in range(200)])
    assert same_on_every_rank(comm, initiators)
    assert set(initiators.tolist()) == set(range(comm.size))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode, sync_every", [("solo", 1), ("majority", 1), ("solo", 32)])
def test_a_round_with_every_fresh_gradient_is_an_ssgd_step_bit_for_bit(comm, shared_tmp, mode, sync_every):
    train, test = datasets(comm.size, 2)
    ssgd = Trainer(run_config(shared_tmp / "ssgd", algorithm="ssgd", learners=2), comm).fit(mlp_bn, train, test)
    cfg = run_config(shared_tmp / "eager", algorithm="eager", eager_mode=mode, eager_sync_every=sync_every, learners=2)
    eager = Trainer(cfg, comm).fit(mlp_bn, train, test)
    records = evaluation_records(comm, shared_tmp / "eager" / "run")
    every_round_full = all(r["eager_fresh_per_round"] == comm.size and len(r["eager_staleness"]) == 1 for r in records)
    assert every_round_full or (sync_every > 1 and comm.size > 1)
    assert (eager.central.numpy().tobytes() == ssgd.central.numpy().tobytes()) == every_round_full


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", EAGER_MODES)
def test_under_imbalance_all_ranks_keep_one_model_and_every_gradient_is_applied_once(comm, shared_tmp, mode):
    learners, sync_every = 2, 4
    train, test = datasets(comm.size, learners)
    cfg = run_config(
        shared_tmp,
        algorithm="eager",
        eager_mode=mode,
        eager_sync_every=sync_every,
        learners=learners,
        inject_imbalance="random:30:1",
        checkpoint_every=6,
        eval_every=7 * learners * comm.size * BATCH,
    )
    result = Trainer(cfg, comm).fit(mlp_bn, train, test)
    assert result.iterations == STEPS
    assert same_on_every_rank(comm, result.central.numpy())

    records = evaluation_records(comm, shared_tmp / "run")
    assert len(records) == 3
    staleness = np.zeros(sync_every, dtype=np.int64)
    for record in records:
        assert len(record["eager_staleness"]) <= sync_every
        staleness[: len(record["eager_staleness"])] += record["eager_staleness"]
        assert 1 <= record["eager_fresh_per_round"] <= comm.size
    assert staleness.sum() == comm.size * STEPS, "every rank's gradient of every step, once"
    assert sum(r["eager_rounds"] for r in records) > STEPS, "the steps' rounds and the drains' before checkpoints"
    assert sum(r["eager_sync_rounds"] for r in records) == 7, "the first round and every 4th after each start"
    if comm.size > 1 and mode == "solo":
        assert staleness[1:].sum() > 0, "the sleeping rank's gradients land in later rounds"
    waits = [record["eager_wait_ms"] for record in records]
    assert all(wait >= 0 for wait in waits)
    if comm.size > 1 and mode == "majority":
        assert np.mean(waits) > 1, "rank 0 waits for an initiator that sleeps 30 ms"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"eager_mode": "lazy"}, "--eager-mode: unknown value 'lazy'"),
        ({"eager_sync_every": 0}, "--eager-sync-every must be positive"),
        ({"learners": "auto"}, "--algorithm eager needs a fixed number of --learners"),
    ],
)
def test_eager_config_mistakes_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config(algorithm="eager", **overrides).validate(ALGORITHMS)


def test_eager_flags():
    cfg = parse_config(["--algorithm", "eager", "--eager-mode", "majority", "--eager-sync-every", "8"])
    cfg.validate(ALGORITHMS)
    assert (cfg.algorithm, cfg.eager_mode, cfg.eager_sync_every) == ("eager", "majority", 8)


@pytest.mark.slow
def test_eager_benchmark_quick_mode_writes_results(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.eager", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "eager.json").read_text())
    assert result["benchmark"] == "eager" and result["quick"] is True
    assert {row["algorithm"] for row in result["rows"]} == {"ssgd", "eager solo, lr / 2"}
    lrs = {variant: flags["lr"] for variant, flags in result["settings"]["variants"].items()}
    assert lrs["random / eager solo, lr / 2"] == lrs["random / ssgd"] / 2
    assert done.stdout.rstrip().splitlines()[-len(result["rows"]) - 2].split() == result["columns"]
