"""Learner engines give the same bits, and `--learners auto` changes k consistently on every rank."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from crossbow_mpi import Config, Trainer
from crossbow_mpi.data import synthetic_dataset
from reference import relative_error, sma_reference


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 10))


def mlp_bn_float64() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10)).double()


@pytest.mark.mpi(min_size=1)
def test_sequential_and_threads_engines_are_bit_identical(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 240 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 40, seed=1)
    results = {}
    for engine in ("sequential", "threads"):
        cfg = Config(run_dir=str(shared_tmp / engine), engine=engine, learners=3, batch_size=8, threads=2,
                     epochs=2, eval_every=0, target_accuracy=0, seed=4, lr=0.05)
        results[engine] = Trainer(cfg, comm).fit(convnet, train, test)
    assert torch.equal(results["sequential"].central, results["threads"].central)


@pytest.mark.mpi(min_size=1)
def test_bf16_autocast_trains_while_z_stays_float32(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * 8 * comm.size, seed=0)
    cfg = Config(run_dir=str(shared_tmp / "bf16"), precision="bf16", learners=2, batch_size=8, epochs=3,
                 eval_every=0, target_accuracy=0, seed=4, lr=0.05)
    result = Trainer(cfg, comm).fit(convnet, train, train)
    assert result.central.dtype == torch.float32 and torch.isfinite(result.central).all()
    assert result.test_accuracy > 0.3


@pytest.mark.mpi(min_size=2)
def test_auto_learners_change_consistently_and_sma_equations_hold(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 4 * comm.size * 60, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 40, seed=1)
    cfg = Config(run_dir=str(shared_tmp / "auto"), learners="auto", autotune_interval=3, max_learners=4,
                 autotune_threshold=0.0, batch_size=4, epochs=1, eval_every=0, target_accuracy=0, seed=9,
                 lr=0.02, weight_decay=0.001)
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)

    records = comm.bcast_json([json.loads(line) for line in (shared_tmp / "auto" / "metrics.jsonl").read_text()
                               .splitlines()] if comm.rank == 0 else None)
    decisions = [r for r in records if r.get("event") == "autotune"]
    assert decisions and decisions[0]["decision"] == "add" and decisions[0]["learners"] == 2
    assert all(r["decision"] in ("add", "remove", "stop") for r in decisions)
    assert records[-1]["event"] == "summary" and records[-1]["learners"] == result.learners
    assert comm.allgather_json(result.learners) == [result.learners] * comm.size

    learners_per_step, k = [], 1
    changes = {r["iteration"]: r["learners"] for r in decisions}
    for iteration in range(result.iterations):
        learners_per_step.append(k)
        k = changes.get(iteration + 1, k)
    reference = sma_reference(mlp_bn_float64, cfg, train, comm.size, learners_per_step)
    assert relative_error(result.central, reference) < 1e-6
