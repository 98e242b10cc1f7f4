"""Algorithms against independent single-process references, at any number of ranks (-n 1, 2, 4)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import Trainer

from helpers import BATCH, STEPS, datasets, mlp, mlp_bn_float64, run_config
from reference import relative_error, sgd_reference, sma_reference


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners", [1, 3])
def test_ssgd_equals_single_process_sgd_with_the_aggregate_batch(comm, shared_tmp, learners):
    train, test = datasets(comm.size, learners)
    cfg = run_config(shared_tmp, algorithm="ssgd", learners=learners)
    result = Trainer(cfg, comm).fit(mlp, train, test)
    assert result.iterations == STEPS

    model = sgd_reference(mlp, cfg, train, learners * comm.size * BATCH, STEPS)
    assert relative_error(result.central, parameters_to_vector(model.parameters())) < 1e-5


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "learners, fused_step", [(1, False), (3, False), pytest.param(3, True, marks=pytest.mark.slow)]
)
def test_sma_matches_float64_reference_of_crossbow_equations(comm, shared_tmp, learners, fused_step):
    train, test = datasets(comm.size, learners)
    cfg = run_config(
        shared_tmp, algorithm="sma", learners=learners, lr_steps=(0.5,), lr_gamma=0.5, fused_step=fused_step
    )
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)
    reference = sma_reference(mlp_bn_float64, cfg, train, comm.size, [learners] * STEPS)
    assert result.central.dtype == torch.float64
    assert relative_error(result.central, reference) < 1e-6
    num_params = sum(p.numel() for p in mlp_bn_float64().parameters())
    assert relative_error(result.central[num_params:], reference[num_params:]) < 1e-6, "BatchNorm statistics"


@pytest.mark.mpi(min_size=1)
def test_sma_without_learner_momentum_moves_z_without_central_momentum_as_crossbow_does(comm, shared_tmp):
    train, test = datasets(comm.size, 2)
    results = {}
    for always in (False, True):
        cfg = run_config(
            shared_tmp / str(always), algorithm="sma", learners=2, momentum=0.0, central_momentum_always=always
        )
        results[always] = Trainer(cfg, comm).fit(mlp_bn_float64, train, test).central
        reference = sma_reference(mlp_bn_float64, cfg, train, comm.size, [2] * STEPS)
        assert relative_error(results[always], reference) < 1e-6
    assert relative_error(results[False], results[True]) > 1e-3


@pytest.mark.mpi(min_size=2)
def test_all_ranks_hold_the_same_central_model(comm, shared_tmp):
    train, test = datasets(comm.size, 2)
    result = Trainer(run_config(shared_tmp, learners=2), comm).fit(mlp, train, test)
    gathered = comm.allgather_bytes(result.central.numpy().tobytes())
    assert all(g == gathered[0] for g in gathered)
