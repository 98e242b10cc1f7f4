"""A new user's model: frozen parameters, non-float buffers and tied weights, against plain PyTorch SGD."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import ConfigError, Trainer
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.learners import CentralModel, Learners

from helpers import BATCH, STEPS, datasets, run_config
from reference import relative_error, sgd_reference

FEATURES = 36


class FrozenFeatures(nn.Module):
    """A frozen, randomly initialised projection of randomly permuted inputs (the permutation is an int64 buffer
    drawn at construction), then a trainable classifier."""

    def __init__(self):
        super().__init__()
        self.register_buffer("order", torch.randperm(FEATURES))
        self.project = nn.Linear(FEATURES, 32).requires_grad_(False)
        self.classify = nn.Linear(32, 10)

    def forward(self, x):
        return self.classify(torch.tanh(self.project(x.flatten(1)[:, self.order])))


class Counting(nn.Module):
    """Counts its training forward passes in an int64 buffer, and (with `draws`) draws a new index table from the
    global generator at each one."""

    def __init__(self, draws: bool = True):
        super().__init__()
        self.draws = draws
        self.layers = nn.Sequential(
            nn.Flatten(), nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10)
        )
        self.register_buffer("passes", torch.zeros((), dtype=torch.int64))
        self.register_buffer("draw", torch.zeros(4, dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.passes += 1
            if self.draws:
                self.draw.copy_(torch.randint(0, 1000, (4,)))
        return self.layers(x)


class Tied(nn.Module):
    """A decoder that reuses its encoder's weight (tied weights)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 16)
        self.encode = nn.Linear(16, 16, bias=False)
        self.decode = nn.Linear(16, 16)
        self.decode.weight = self.encode.weight
        self.classify = nn.Linear(16, 10)

    def forward(self, x):
        return self.classify(torch.tanh(self.decode(torch.tanh(self.encode(torch.tanh(self.embed(x.flatten(1))))))))


def recording(model_cls, instances: list):
    """A model_fn that keeps every instance it makes: z's module first, then the learners'."""

    def model_fn():
        instances.append(model_cls())
        return instances[-1]

    return model_fn


def accuracy(model: nn.Module, test) -> float:
    inputs, targets = test.get_batch(torch.arange(len(test)))
    with torch.no_grad():
        return float((model.eval()(inputs).argmax(1) == targets).float().mean())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners", [1, 2])
def test_frozen_layer_and_constructed_int_buffer_train_like_plain_sgd(comm, shared_tmp, learners):
    train, test = datasets(comm.size, learners)
    cfg = run_config(shared_tmp, algorithm="ssgd", learners=learners)
    result = Trainer(cfg, comm).fit(FrozenFeatures, train, test)
    assert result.iterations == STEPS
    reference = sgd_reference(FrozenFeatures, cfg, train, learners * comm.size * BATCH, STEPS)
    trainable = parameters_to_vector(p for p in reference.parameters() if p.requires_grad).detach()
    assert relative_error(result.central, trainable) < 1e-5
    assert result.test_accuracy == pytest.approx(accuracy(reference, test), abs=1e-6)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd", "eager"])
def test_non_float_buffers_are_learner_0s_on_every_learner_and_z(comm, shared_tmp, algorithm):
    train, test = datasets(comm.size, 3)
    instances: list[nn.Module] = []
    cfg = run_config(shared_tmp, algorithm=algorithm, learners=3, eval_every=10**9)
    if comm.size > 1:  # the draws differ between ranks: refused at the first evaluation, naming the buffer
        with pytest.raises(ConfigError, match="buffers or frozen parameters draw differ between ranks"):
            Trainer(cfg, comm).fit(recording(Counting, instances), train, test)
        return
    result = Trainer(cfg, comm).fit(recording(Counting, instances), train, test)
    _central, *learners = instances
    assert len(learners) == 3
    for module in instances:
        assert int(module.passes) == result.iterations
        assert int(module.layers[2].num_batches_tracked) == result.iterations
        assert torch.equal(module.draw, learners[0].draw)


@pytest.mark.mpi(min_size=2)
def test_counters_stay_equal_on_every_rank(comm, shared_tmp):
    train, test = datasets(comm.size, 2)
    instances: list[nn.Module] = []
    cfg = run_config(shared_tmp, algorithm="eager", learners=2, eval_every=4 * 2 * comm.size * BATCH)
    result = Trainer(cfg, comm).fit(recording(lambda: Counting(draws=False), instances), train, test)
    passes = comm.allgather_json([int(m.passes) for m in instances])
    assert all(p == [result.iterations] * 3 for p in passes)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners", [1, 2])
def test_tied_weights_train_like_plain_sgd(comm, shared_tmp, learners):
    train, test = datasets(comm.size, learners)
    cfg = run_config(shared_tmp, algorithm="ssgd", learners=learners)
    instances: list[nn.Module] = []
    result = Trainer(cfg, comm).fit(recording(Tied, instances), train, test)
    reference = sgd_reference(Tied, cfg, train, learners * comm.size * BATCH, STEPS)
    assert relative_error(result.central, parameters_to_vector(reference.parameters()).detach()) < 1e-5
    for module in instances:
        assert module.decode.weight is module.encode.weight


def test_learners_added_later_start_with_zs_frozen_parameters_and_buffers():
    torch.manual_seed(0)
    module = FrozenFeatures()
    layout = FlatLayout(module)
    assert layout.frozen == ["project.weight", "project.bias"] and layout.non_float_buffers == ["order"]
    central = CentralModel(module, layout)
    learners = Learners(FrozenFeatures, layout, central, 1)
    learners.resize(3, central.z)
    for learner in learners.modules:
        for name, value in layout.extra_state(module).items():
            assert torch.equal(layout.extra_state(learner)[name], value), name


@pytest.mark.mpi(min_size=2)
def test_zs_extra_state_is_rank_0s(comm):
    torch.manual_seed(comm.rank)
    module = FrozenFeatures()
    layout = FlatLayout(module)
    central = CentralModel(module, layout)
    central.broadcast_extra_state(comm)
    for name, value in layout.extra_state(module).items():
        gathered = comm.allgather_bytes(value.numpy().tobytes())
        assert all(g == gathered[0] for g in gathered), name
    central.check_extra_state(comm)
