"""User errors stop every rank together, at any number of ranks."""

import pytest
from torch import nn

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.training.trainer import agree


@pytest.mark.mpi(min_size=1)
def test_an_error_on_one_rank_is_raised_on_every_rank(comm):
    def check():
        if comm.rank == comm.size - 1:
            raise ValueError(f"rank {comm.rank} cannot read its data")
        return "fine"

    with pytest.raises(ConfigError, match=f"rank {comm.size - 1} cannot read its data"):
        agree(comm, check)
    assert agree(comm, lambda: comm.rank) == comm.rank


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"learners": 0}, "--learners must be a positive"),
        ({"batch_size": -2}, "--batch-size must be positive"),
        ({"algorithm": "adam"}, "--algorithm: unknown value"),
        ({"model": "vgg"}, "--model: unknown value"),
        ({"engine": "streams", "device": "cpu"}, "--engine streams needs CUDA"),
        ({"comm": "nccl", "device": "cpu"}, "--comm nccl needs CUDA"),
        ({"precision": "fp8"}, "--precision: unknown value"),
    ],
)
def test_invalid_config_raises_on_every_rank(comm, overrides, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(Config(**overrides))


@pytest.mark.mpi(min_size=1)
def test_too_small_training_set_and_missing_checkpoint_are_user_errors(comm, shared_tmp):
    tiny = synthetic_dataset((4,), 2, 3, seed=0)
    trainer = Trainer(Config(run_dir=str(shared_tmp / "a"), batch_size=4), comm)
    with pytest.raises(ConfigError, match="one global step needs"):
        trainer.fit(lambda: nn.Linear(4, 2), tiny, tiny)
    resuming = Trainer(Config(run_dir=str(shared_tmp / "b"), batch_size=1, resume=True), comm)
    with pytest.raises(ConfigError, match="no valid checkpoint"):
        resuming.fit(lambda: nn.Linear(4, 2), synthetic_dataset((4,), 2, 64, seed=0), tiny)
