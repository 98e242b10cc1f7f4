"""Faults inside the harness at any number of ranks: corrupt checkpoints, full disks, inconsistent configs."""

from __future__ import annotations

import dataclasses
import errno
import math
from collections.abc import Callable
from types import SimpleNamespace

import h5py
import pytest
import torch
from torch import nn

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.training import checkpoint
from crossbow_mpi.training.checkpoint import CheckpointError, list_checkpoints
from crossbow_mpi.training.hooks import DivergenceCheck, DivergenceError

from helpers import resume_config, resume_fit


def config(run_dir, **overrides) -> Config:
    return resume_config(run_dir, **{"epochs": 2, "checkpoint_every": 5, "keep_checkpoints": 3, **overrides})


@pytest.mark.mpi(min_size=1)
def test_truncated_and_unfinished_checkpoints_are_skipped(comm, shared_tmp, capsys):
    whole = resume_fit(comm, config(shared_tmp / "whole"))
    run_dir = shared_tmp / "damaged"
    resume_fit(comm, config(run_dir))
    if comm.rank == 0:
        paths = list_checkpoints(str(run_dir))
        assert [p.name for p in paths] == [
            "checkpoint-000000025.h5",
            "checkpoint-000000030.h5",
            "checkpoint-000000032.h5",
        ]
        paths[-1].unlink()
        data = paths[-2].read_bytes()
        paths[-2].write_bytes(data[: len(data) // 2])
        (run_dir / "checkpoint-000000031.h5.tmp").write_bytes(b"half written")
    comm.barrier()
    resumed = resume_fit(comm, config(run_dir, resume=True))
    assert torch.equal(resumed.central, whole.central)
    if comm.rank == 0:
        err = capsys.readouterr().err
        assert "skipped checkpoint-000000030.h5: unreadable" in err and "resumed from checkpoint-000000025.h5" in err


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_of_another_format_version_is_skipped_with_the_reason(comm, shared_tmp, capsys):
    resume_fit(comm, config(shared_tmp, epochs=1))
    if comm.rank == 0:
        with h5py.File(list_checkpoints(str(shared_tmp))[-1], "r+") as f:
            f.attrs["format_version"] = 99
    comm.barrier()
    resume_fit(comm, config(shared_tmp, epochs=1, resume=True))
    if comm.rank == 0:
        assert "skipped checkpoint-000000016.h5: format version 99 (expected 2)" in capsys.readouterr().err


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_of_another_model_is_refused(comm, shared_tmp):
    resume_fit(comm, config(shared_tmp, epochs=1))
    train = synthetic_dataset((1, 6, 6), 10, 96 * comm.size, seed=2)
    other = lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 10))  # noqa: E731
    with pytest.raises(ConfigError, match="holds a different model"):
        Trainer(config(shared_tmp, resume=True), comm).fit(other, train, train)


@pytest.mark.mpi(min_size=1)
def test_a_full_disk_stops_every_rank_with_one_line(comm, shared_tmp, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write", no_space)
    with pytest.raises(CheckpointError, match="No space left on device") as caught:
        resume_fit(comm, config(shared_tmp))
    assert "\n" not in str(caught.value)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_configs_refuse_to_start(comm, shared_tmp):
    cfg = config(shared_tmp)
    if comm.rank == 1:
        cfg = dataclasses.replace(cfg, lr=0.5, seed=6)
    with pytest.raises(ConfigError, match="configurations differ in: lr, seed"):
        Trainer(cfg, comm)


def after_sync(compute) -> Callable[[], float]:
    value = float(compute())
    return lambda: value


def after_round(z: torch.Tensor, batch_size: int | tuple[int, ...] = 64) -> SimpleNamespace:
    """What DivergenceCheck reads of a run after a hogbatch round."""
    return SimpleNamespace(
        state=SimpleNamespace(iteration=7),
        engine=SimpleNamespace(after_sync=after_sync),
        central=SimpleNamespace(z=z),
        algorithm=SimpleNamespace(rounds=True, name="hogbatch"),
        hp=SimpleNamespace(batch_size=batch_size, batch_scaled_lr=False),
    )


@pytest.mark.mpi(min_size=1)
def test_one_ranks_non_finite_copy_of_z_after_a_round_stops_every_rank(comm, shared_tmp):
    """Hogbatch's and Omnivore's ranks pull z from the server at their own pace, so after a round one rank's copy
    can be non-finite while another's is not yet: every rank must raise at the same check (the last rank alone
    raising left the others in the evaluation's collective, a hang)."""
    check, step = DivergenceCheck(comm, str(shared_tmp)), SimpleNamespace(losses=torch.zeros(1))
    check.after_step(after_round(torch.ones(3)), step)
    check.check()
    last = comm.rank == comm.size - 1
    check.after_step(after_round(torch.full((3,), math.inf if last else 1.0)), step)
    with pytest.raises(DivergenceError, match="diverged at iteration 7: the central model became non-finite") as err:
        check.check()
    assert "stepped on batches" not in str(err.value)


@pytest.mark.mpi(min_size=1)
def test_a_hogbatch_divergence_on_tiny_unscaled_batches_says_so(comm, shared_tmp):
    check, step = DivergenceCheck(comm, str(shared_tmp)), SimpleNamespace(losses=torch.zeros(1))
    check.after_step(after_round(torch.full((3,), math.nan), batch_size=(128, 1)), step)
    with pytest.raises(DivergenceError, match="rank 1 stepped on batches of 1, each update applied at the full --lr"):
        check.check()
