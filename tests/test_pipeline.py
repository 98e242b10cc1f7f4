"""Pipeline stages against single-process references, at any number of ranks (-n 1, 2, 4): a case runs where its
stages divide the ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crossbow_mpi import Config, Trainer
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.stages import split_model

from reference import float_buffers, load_state, relative_error, sgd_reference, sma_reference

STEPS = 12
BATCH = 4


def deep_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12), nn.Linear(12, 10)
    )


def mlp_bn_float64() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10)
    ).double()


def needs_stages(comm, stages: int) -> None:
    if comm.size % stages:
        pytest.skip(f"{stages} stages do not divide {comm.size} ranks")


def datasets(pipelines: int, learners: int):
    train = synthetic_dataset((1, 6, 6), 10, STEPS * pipelines * learners * BATCH, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 30, seed=1)
    return train, test


def run_config(tmp, **overrides) -> Config:
    values = dict(
        run_dir=str(tmp / "run"),
        batch_size=BATCH,
        epochs=1,
        eval_every=0,
        target_accuracy=0,
        seed=7,
        lr=0.05,
        momentum=0.9,
        weight_decay=0.001,
    )
    values.update(overrides)
    return Config(**values)


def stage_state(model: nn.Module, stages: int, stage: int) -> torch.Tensor:
    """The state vector (parameters, then float buffers) of one stage of a whole model."""
    stage_model = nn.Sequential(*split_model(model, stages)[stage])
    return torch.cat([t.detach().reshape(-1) for t in [*stage_model.parameters(), *float_buffers(stage_model)]])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("learners,micro_batches", [(1, 4), (2, 3)])
def test_pipeline_ssgd_equals_single_process_sgd(comm, shared_tmp, stages, schedule, learners, micro_batches):
    needs_stages(comm, stages)
    pipelines = comm.size // stages
    train, test = datasets(pipelines, learners)
    cfg = run_config(
        shared_tmp,
        algorithm="ssgd",
        learners=learners,
        pipeline_stages=stages,
        micro_batches=micro_batches,
        schedule=schedule,
    )
    result = Trainer(cfg, comm).fit(deep_mlp, train, test)
    assert result.iterations == STEPS
    model = sgd_reference(deep_mlp, cfg, train, learners * pipelines * BATCH, STEPS)
    stage = comm.rank % stages
    assert relative_error(result.central, stage_state(model, stages, stage)) < 1e-5


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_sma_matches_float64_reference_with_batchnorm(comm, shared_tmp, stages):
    """With one micro-batch BatchNorm sees the learner's whole batch, as in the unsplit model."""
    needs_stages(comm, stages)
    pipelines = comm.size // stages
    train, test = datasets(pipelines, 2)
    cfg = run_config(shared_tmp, algorithm="sma", learners=2, pipeline_stages=stages, schedule="1f1b")
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)
    z = sma_reference(mlp_bn_float64, cfg, train, pipelines, [2] * STEPS)
    model = mlp_bn_float64()
    load_state(model, z, sum(p.numel() for p in model.parameters()))
    assert result.central.dtype == torch.float64
    assert relative_error(result.central, stage_state(model, stages, comm.rank % stages)) < 1e-6
