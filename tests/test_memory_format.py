"""Channels-last flat buffers: conv weights are channels-last views, training equals the NCHW run to rounding,
resuming gives the same bits, and a checkpoint (contiguous tensors) resumes under either format."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crossbow_mpi import Trainer
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.formats import choose_channels_last
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.optimizers import adamw
from crossbow_mpi.runtime import ulfm
from crossbow_mpi.training.checkpoint import list_checkpoints

from helpers import metrics_records, mlp, resume_config
from reference import relative_error


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(16, 10)
    )


def test_channels_last_slots_are_channels_last_views_and_convert_to_the_contiguous_order():
    torch.manual_seed(0)
    model = convnet()
    contiguous, channels_last = FlatLayout(model), FlatLayout(model, channels_last=True)
    z = channels_last.flatten(model)
    assert not torch.equal(z, contiguous.flatten(model)), "the conv weights' elements are reordered"
    assert torch.equal(channels_last.to_logical(z), contiguous.flatten(model))
    assert torch.equal(channels_last.from_logical(contiguous.flatten(model)), z)
    rows = torch.stack([z, 2 * z])
    assert torch.equal(channels_last.to_logical(rows)[1], 2 * contiguous.flatten(model))
    twin = convnet()
    channels_last.bind(twin, z)
    for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        assert mine.dim() != 4 or mine.is_contiguous(memory_format=torch.channels_last)
        assert mine.data_ptr() >= z.data_ptr() and mine.data_ptr() < z.data_ptr() + z.nbytes, "a view of z"


def test_auto_times_channels_last_only_for_models_with_4d_weights():
    batch = (torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,)))
    cpu = torch.device("cpu")
    assert choose_channels_last("auto", mlp, batch, nn.functional.cross_entropy, cpu) is False
    assert choose_channels_last("auto", convnet, batch, nn.functional.cross_entropy, cpu) in (False, True)
    assert choose_channels_last("channels_last", mlp, batch, nn.functional.cross_entropy, cpu) is True


def fit(comm, cfg):
    train = synthetic_dataset((1, 6, 6), 10, 16 * 4 * 2 * comm.size, seed=2)
    test = synthetic_dataset((1, 6, 6), 10, 50, seed=3)
    return Trainer(cfg, comm).fit(convnet, train, test)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_channels_last_training_equals_the_contiguous_run_to_rounding(comm, shared_tmp, algorithm):
    results = {
        memory_format: fit(
            comm, resume_config(shared_tmp / memory_format, algorithm=algorithm, epochs=1, memory_format=memory_format)
        )
        for memory_format in ("contiguous", "channels_last")
    }
    assert results["contiguous"].iterations == results["channels_last"].iterations == 16
    assert relative_error(results["channels_last"].central, results["contiguous"].central) < 1e-5
    for memory_format in results:
        assert metrics_records(comm, shared_tmp / memory_format)[-1]["memory_format"] == memory_format


def interrupt_at_14(comm, run_dir) -> None:
    """Leave the run's checkpoints up to iteration 14, as if it had stopped there."""
    if comm.rank == 0:
        for path in list_checkpoints(str(run_dir)):
            if path.name > "checkpoint-000000014.h5":
                path.unlink()
    comm.barrier()


@pytest.mark.slow
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_channels_last_run_resumes_bit_for_bit_and_its_checkpoint_resumes_contiguous(comm, shared_tmp, optimizer):
    config = {"algorithm": "sma", "epochs": 2, "memory_format": "channels_last", "optimizer": optimizer}
    whole = fit(comm, resume_config(shared_tmp / "whole", **config))
    interrupted = shared_tmp / "interrupted"
    fit(comm, resume_config(interrupted, **config))
    interrupt_at_14(comm, interrupted)
    resumed = fit(comm, resume_config(interrupted, resume=True, **config))
    assert resumed.iterations == whole.iterations and torch.equal(resumed.central, whole.central)

    interrupt_at_14(comm, interrupted)
    other = fit(comm, resume_config(interrupted, resume=True, **{**config, "memory_format": "contiguous"}))
    assert other.iterations == whole.iterations
    # AdamW's normalised steps amplify the formats' rounding (7 % apart after 32 steps uninterrupted, here)
    assert relative_error(other.central, whole.central) < (1e-5 if optimizer == "sgd" else 0.2)


@pytest.mark.slow
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "settings",
    [
        {"algorithm": "eager"},
        {"algorithm": "omnivore"},
        {"algorithm": "elastic"},
        {"algorithm": "sma", "fused_step": True},
    ],
    ids=lambda settings: "-".join(map(str, settings.values())),
)
def test_every_algorithm_and_the_fused_steps_train_channels_last(comm, shared_tmp, settings):
    run_dir = shared_tmp / "run"
    result = fit(comm, resume_config(run_dir, epochs=1, memory_format="channels_last", **settings))
    assert result.iterations > 0 and torch.isfinite(result.central).all()
    assert metrics_records(comm, run_dir)[-1]["memory_format"] == "channels_last"


def test_optimizer_state_is_checkpointed_in_the_weights_contiguous_order():
    torch.manual_seed(0)
    model = convnet()
    layout = FlatLayout(model, channels_last=True)
    learners = Learners(convnet, layout, CentralModel(model, layout), 2)
    learners.use_optimizer(adamw(0.9, 0.999, 1e-8, 0.0))
    learners.params.normal_()
    assert learners.optimizers is not None
    learners.optimizers.state = {"exp_avg": learners.params.clone()}  # a state laid out as the weights are
    state = learners.state_dict()
    num_params = layout.num_params
    assert torch.equal(state["optimizer"]["exp_avg"], state["weights"][:, :num_params])
    assert not torch.equal(state["optimizer"]["exp_avg"], learners.params), "the conv weights are reordered"
    learners.load_state_dict(state, learners.central.z)
    assert torch.equal(learners.optimizers.state["exp_avg"], learners.params)


@pytest.mark.parametrize("shares_z", [False, True])
def test_a_physical_snapshot_restores_a_channels_last_state_as_it_was(shares_z):
    torch.manual_seed(0)
    model = convnet()
    layout = FlatLayout(model, channels_last=True)
    central = CentralModel(model, layout)
    learners = Learners(convnet, layout, central, 2)
    if shares_z:
        learners.share_z(True)
    else:
        learners.use_optimizer(adamw(0.9, 0.999, 1e-8, 0.0))
        learners.optimizers.state = {"exp_avg": torch.randn_like(learners.params)}  # type: ignore[union-attr]
    for tensor in (central.z, central.u, learners.weights):
        tensor.normal_()
    parts = (central, learners)
    before = [ulfm.copy_state(part.state_dict()) for part in parts]  # contiguous order, as a checkpoint's
    kept = [ulfm.copy_state(part.state_dict(physical=True)) for part in parts]
    for tensor in (central.z, central.u, learners.weights):
        tensor.add_(1)
    central.load_state_dict(kept[0], physical=True)
    learners.load_state_dict(kept[1], central.z, physical=True)
    after = [part.state_dict() for part in parts]
    for old, new in zip(before, after, strict=True):
        assert old.keys() == new.keys()
        assert all(torch.equal(old[key], new[key]) for key in old if isinstance(old[key], torch.Tensor))
    assert learners.optimizers is None or torch.equal(
        before[1]["optimizer"]["exp_avg"], after[1]["optimizer"]["exp_avg"]
    )


@pytest.mark.mpi(min_size=1)
def test_auto_resolves_once_per_trainer_and_a_copy_restores_only_into_its_own_layout(comm, shared_tmp, monkeypatch):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=2)
    choices = iter([True, False])
    monkeypatch.setattr("crossbow_mpi.training.trainer.choose_channels_last", lambda *args: next(choices))
    trainer = Trainer(resume_config(shared_tmp, memory_format="auto"), comm)
    first = trainer.start(convnet, train)
    rebuilt = trainer.start(convnet, train)  # as after a rank loss: the layout the copy was taken in
    assert first.layout.order == rebuilt.layout.order == "channels_last"
    first.train_step(0.05)
    rebuilt.load_state_dict(first.detached_snapshot())
    assert torch.equal(rebuilt.central.z, first.central.z)
    contiguous = Trainer(resume_config(shared_tmp, memory_format="contiguous"), comm).start(convnet, train)
    with pytest.raises(ValueError, match="a copy of channels_last flat buffers restores only into the same layout"):
        contiguous.load_state_dict(first.detached_snapshot())
    contiguous.load_state_dict(first.state_dict())  # a checkpoint's contiguous tensors restore under either layout
    assert torch.equal(contiguous.central.z, first.layout.to_logical(first.central.z))
