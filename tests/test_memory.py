"""Memory at the minimum: learners that share z hold no parameter columns or momenta, activations are measured, and
the summary reports each rank's bytes by part."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crossbow_mpi import Config, Trainer
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.replicas.engines import ENGINES
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.footprint import ActivationMeter, bytes_per_learner, footprint
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.optimizers import adamw
from crossbow_mpi.replicas.state import HyperParams

from helpers import metrics_records, mlp_bn, self_comm


def test_the_activation_meter_counts_what_backward_needs_and_neither_weights_nor_batch():
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 10))
    inputs = torch.randn(8, 1, 6, 6)
    meter = ActivationMeter()
    with meter.watch(model, inputs):
        loss = model(inputs).square().sum()
    # tanh saves its output, which the second layer saves too (one storage); square saves the logits
    assert meter.bytes == (8 * 16 + 8 * 10) * 4
    loss.backward()
    with meter.watch(model, inputs):
        model(torch.randn(32, 1, 6, 6)).sum()
    assert meter.bytes == (8 * 16 + 8 * 10) * 4, "measured once"


@pytest.mark.parametrize(("algorithm", "shares"), [("ssgd", True), ("sma", False)])
def test_learners_that_share_z_hold_their_buffers_alone_and_the_footprint_adds_up(algorithm, shares):
    torch.manual_seed(0)
    module = mlp_bn()
    layout = FlatLayout(module)
    central = CentralModel(module, layout)
    learners = Learners(mlp_bn, layout, central, 3)
    hp = HyperParams.from_config(Config(algorithm=algorithm, learners=3))
    steps = ALGORITHMS[algorithm](hp, self_comm(), central, learners)
    engine = ENGINES["sequential"](nn.functional.cross_entropy, threads=1)
    batches = [(torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,))) for _ in range(3)]
    engine.compute_gradients(learners, batches)
    engine.local_step(steps, 0.1)
    engine.sync(steps, 0.1)
    n, buffers = layout.num_params, layout.num_state - layout.num_params
    parts = footprint(central, learners, steps, engine.activations.bytes, concurrent=1, batch_bytes=0)
    assert parts["learner_weights"] == 3 * (buffers if shares else layout.num_state) * 4
    assert parts["learner_momenta"] == (0 if shares else 3 * n * 4)
    assert parts["learner_grads"] == 3 * (layout.num_state + 1) * 4
    assert parts["message"] == 0, "both stage in the gradient rows; the message is the first staged row"
    assert parts["activations_peak"] == engine.activations.bytes > 0
    assert parts["total"] == sum(v for name, v in parts.items() if name != "total")
    row = (0 if shares else n) * 2 + buffers + layout.num_state + 1
    assert bytes_per_learner(learners, engine.activations.bytes) == row * 4 + engine.activations.bytes


def test_sma_with_another_optimizer_holds_no_momentum_and_stages_its_corrections_in_rows_of_their_own():
    """AdamW's state replaces the momentum; its step reads the gradient after the correction is taken from the
    weights it then changes."""
    torch.manual_seed(0)
    module = mlp_bn()
    layout = FlatLayout(module)
    central = CentralModel(module, layout)
    learners = Learners(mlp_bn, layout, central, 2)
    sma = ALGORITHMS["sma"](HyperParams.from_config(Config(learners=2)), self_comm(), central, learners)
    learners.use_optimizer(adamw(0.9, 0.999, 1e-8, 0.0))
    engine = ENGINES["sequential"](nn.functional.cross_entropy, threads=1)
    engine.compute_gradients(learners, [(torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,))) for _ in range(2)])
    gradients = learners.grads.clone()
    engine.local_step(sma, 0.1)
    assert torch.equal(learners.grads, gradients) and sma.staged is not learners.staging
    parts = footprint(central, learners, sma, None, concurrent=1, batch_bytes=0)
    assert parts["message"] == 2 * (layout.num_state + 1) * 4 and parts["learner_momenta"] == 0
    assert not learners.state_dict()["momentum"].any()


@pytest.mark.mpi(min_size=1)
def test_the_summary_reports_every_ranks_bytes_by_part(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 32 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 20, seed=1)
    cfg = Config(
        run_dir=str(shared_tmp / "mem"), algorithm="ssgd", learners=2, batch_size=4, seed=3, eval_every=0, epochs=1
    )
    Trainer(cfg, comm).fit(mlp_bn, train, test)
    summary = metrics_records(comm, shared_tmp / "mem")[-1]
    assert summary["event"] == "summary" and len(summary["memory_bytes"]) == comm.size
    for parts in summary["memory_bytes"]:
        assert parts["learner_momenta"] == 0 and parts["activations_peak"] > 0
        assert parts["prefetch"] == 2 * 4 * (36 * 4 + 8), "a step's two batches of float32 inputs and int64 labels"
        assert parts["total"] == sum(v for name, v in parts.items() if name != "total")
