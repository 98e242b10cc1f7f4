"""Checkpoints: the HDF5 layout, and resuming gives the same bits as an uninterrupted run."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from crossbow_mpi.config import ConfigError
from crossbow_mpi.training.checkpoint import FORMAT_VERSION, list_checkpoints

from helpers import digest, resume_config, resume_fit


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd", "elastic"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(comm, shared_tmp, algorithm):
    # elastic with rounds of one global step: every rank takes exactly one step per round, so its bits are fixed
    rounds = {"round_samples": 2 * 4 * comm.size} if algorithm == "elastic" else {}
    whole = resume_fit(comm, resume_config(shared_tmp / "whole", algorithm=algorithm, **rounds))
    assert whole.iterations == 48

    interrupted_dir = shared_tmp / "interrupted"
    resume_fit(comm, resume_config(interrupted_dir, algorithm=algorithm, **rounds))
    if comm.rank == 0:
        for path in list_checkpoints(str(interrupted_dir)):
            if path.name > "checkpoint-000000021.h5":
                path.unlink()
    comm.barrier()
    resumed = resume_fit(comm, resume_config(interrupted_dir, algorithm=algorithm, resume=True, **rounds))
    assert resumed.iterations == whole.iterations
    assert torch.equal(resumed.central, whole.central)

    if comm.rank == 0:
        with (
            h5py.File(list_checkpoints(str(shared_tmp / "whole"))[-1]) as a,
            h5py.File(list_checkpoints(str(interrupted_dir))[-1]) as b,
        ):
            names = ["central/z", "central/u", "central/extra"] + [
                f"ranks/{r}/{part}" for r in range(comm.size) for part in ("weights", "momentum")
            ]
            for name in names:
                assert (a[name][...] == b[name][...]).all(), name


@pytest.mark.mpi(min_size=1)
def test_a_resume_that_changes_a_hyperparameter_is_refused_and_one_that_changes_the_epochs_goes_on(comm, shared_tmp):
    resume_fit(comm, resume_config(shared_tmp, epochs=1))
    before = digest(shared_tmp) if comm.rank == 0 else None
    changes = {"lr": 0.1, "sync_dtype": "fp16", "momentum": 0.5, "batch_size": 2, "outer_optimizer": "nesterov"}
    for name, value in changes.items():
        flag = name.replace("_", "-")
        with pytest.raises(ConfigError, match=f"was trained with --{flag} .* a resume continues with the run's"):
            resume_fit(comm, resume_config(shared_tmp, epochs=2, resume=True, **{name: value}))
        assert comm.rank != 0 or digest(shared_tmp) == before, name
    assert resume_fit(comm, resume_config(shared_tmp, epochs=2, resume=True)).iterations == 32


@pytest.mark.mpi(min_size=2)
def test_a_resume_on_fewer_ranks_takes_its_own_batch_size_for_the_runs_per_rank_ones(comm, shared_tmp):
    pair = comm.split(comm.rank < 2, comm.rank)
    if comm.rank < 2:
        resume_fit(pair, resume_config(shared_tmp, epochs=1, batch_size=(4, 2)))
    comm.barrier()
    alone = comm.split(comm.rank == 0, comm.rank)
    if comm.rank == 0:  # the run's sizes are of two ranks: the resume takes this command's, as documented
        assert resume_fit(alone, resume_config(shared_tmp, epochs=2, resume=True)).iterations > 0


@pytest.mark.mpi(min_size=1)
def test_checkpoint_layout(comm, shared_tmp):
    result = resume_fit(comm, resume_config(shared_tmp, epochs=1, keep_checkpoints=2))
    if comm.rank != 0:
        return
    paths = list_checkpoints(str(shared_tmp))
    assert [p.name for p in paths] == ["checkpoint-000000014.h5", "checkpoint-000000016.h5"]
    with h5py.File(paths[-1]) as f:
        assert f.attrs["format_version"] == FORMAT_VERSION and f.attrs["complete"]
        assert f.attrs["world_size"] == comm.size
        assert json.loads(f.attrs["config"])["seed"] == 11
        assert json.loads(f["train"].attrs["state"])["iteration"] == 16
        num_state = result.central.numel()
        assert f["central/z"].shape == (num_state,)
        assert (f["central/z"][...] == result.central.numpy()).all()
        tracked = np.frombuffer(f["central/extra"][...].tobytes(), dtype=np.int64)
        assert tracked.tolist() == [16], "BatchNorm's num_batches_tracked: one forward pass per step"
        assert sorted(f["ranks"]) == [str(r) for r in range(comm.size)]
        for r in range(comm.size):
            assert f[f"ranks/{r}/weights"].shape == (2, num_state)
            assert f[f"ranks/{r}/momentum"].shape[0] == 2
            assert json.loads(f[f"ranks/{r}"].attrs["hyperparams"])["lr"] == 0.05
            assert json.loads(bytes(f[f"ranks/{r}/rng"][...]))["torch"]
    assert not list(shared_tmp.glob("*.tmp"))
