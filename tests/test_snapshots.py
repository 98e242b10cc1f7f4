"""Snapshots in memory, run-time hyper-parameters, and checkpoints that reshard to another number of ranks or
learners."""

from __future__ import annotations

import dataclasses
import json
import shutil

import h5py
import numpy as np
import pytest
import torch

from crossbow_mpi import ConfigError, Trainer
from crossbow_mpi.data import ArrayDataset
from crossbow_mpi.runtime import ulfm
from crossbow_mpi.training.checkpoint import checkpoint_path, list_checkpoints
from crossbow_mpi.training.hooks import Checkpoints, Controllers, Tuning
from crossbow_mpi.training.records import MetricsLog, Progress

from helpers import BATCH, SNAPSHOT_SAMPLES, HalveLrAt, snapshot_config, snapshot_datasets, snapshot_mlp


class RecordingDataset(ArrayDataset):
    """An ArrayDataset that records every sample index it hands out in a training batch (not those of the start
    check, one sample at a time)."""

    def __init__(self, data: ArrayDataset):
        super().__init__(data.inputs, data.targets, num_classes=data.num_classes)
        self.taken: list[int] = []

    def get_batch(self, indices):
        if len(indices) == BATCH:
            self.taken += indices.tolist()
        return super().get_batch(indices)


def state_bits(run) -> list[torch.Tensor]:
    return [run.central.z.clone(), run.central.u.clone(), *run.learners.state_dict().values()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
@pytest.mark.parametrize("kept", ["state_dict", "detached_snapshot"])
def test_restoring_a_snapshot_replays_the_same_bits(comm, shared_tmp, algorithm, kept):
    train, _ = snapshot_datasets()
    run = Trainer(snapshot_config(shared_tmp, algorithm=algorithm), comm).start(snapshot_mlp, train)
    for _ in range(3):
        run.train_step(0.05)
    snapshot = getattr(run, kept)()
    runs = []
    for _ in range(2):
        run.load_state_dict(snapshot)
        for _ in range(20):
            run.train_step(0.05)
        runs.append((state_bits(run), run.state.to_dict(), torch.rand(3)))
    (first, first_state, first_rng), (second, second_state, second_rng) = runs
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert first_state == second_state and first_state["iteration"] == 23
    assert torch.equal(first_rng, second_rng)
    assert not torch.equal(first[0], snapshot["central"]["z"]), "the 20 steps changed nothing"
    assert ("physical" in snapshot) == (kept == "detached_snapshot")


def same_state(a, b) -> bool:
    """Tell whether two snapshots hold the same values, tensor for tensor."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm": "sma"},
        {"algorithm": "ssgd", "optimizer": "adamw"},
        {"algorithm": "sma", "optimizer": "adamw"},
        {"algorithm": "sma", "sync_dtype": "int8"},  # the wire's residuals change in place
    ],
)
def test_a_detached_snapshot_shares_nothing_that_training_changes(comm, shared_tmp, overrides):
    train, _ = snapshot_datasets()
    cfg = snapshot_config(shared_tmp, **overrides)
    run = Trainer(cfg, comm).start(snapshot_mlp, train)
    for _ in range(3):
        run.train_step(0.05)
    detached, copied = run.detached_snapshot(), ulfm.copy_state(run.snapshot(physical=True))
    recycled = run.detached_snapshot(ulfm.copy_state(detached))
    for _ in range(3):
        run.train_step(0.05)
    assert same_state(detached, copied), "a step changed a part of the snapshot that was not copied"
    assert same_state(recycled, copied), "a step changed a part of the snapshot copied into a dropped one"
    assert not same_state(run.snapshot(physical=True)["central"], copied["central"]), "the 3 steps changed nothing"


@pytest.mark.mpi(min_size=1)
def test_a_controller_changes_hyperparameters_which_are_recorded_and_checkpointed(comm, shared_tmp):
    train, test = snapshot_datasets()
    plain = Trainer(snapshot_config(shared_tmp / "plain"), comm).fit(snapshot_mlp, train, test)
    controlled = Trainer(snapshot_config(shared_tmp / "controlled"), comm).fit(
        snapshot_mlp, train, test, controllers=[HalveLrAt(5)]
    )
    assert not torch.equal(plain.central, controlled.central)
    if comm.rank == 0:
        records = [json.loads(line) for line in (shared_tmp / "controlled" / "metrics.jsonl").read_text().splitlines()]
        changes = [r for r in records if r.get("event") == "hyperparams"]
        assert changes == [
            {
                "event": "hyperparams",
                "iteration": 5,
                "time_s": changes[0]["time_s"],
                "changes": {"lr": [0.05, 0.025], "momentum": [0.9, 0.5]},
            }
        ]
        with h5py.File(list_checkpoints(str(shared_tmp / "controlled"))[-1]) as f:
            assert json.loads(f["ranks/0"].attrs["hyperparams"])["lr"] == 0.025
    comm.barrier()
    unchanged = Trainer(snapshot_config(shared_tmp / "unchanged"), comm).fit(
        snapshot_mlp, train, test, controllers=[lambda run, step: {"lr": 0.05}]
    )
    assert torch.equal(plain.central, unchanged.central)


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_of_format_1_stops_with_one_line_naming_the_format(comm, shared_tmp):
    if comm.rank == 0:
        with h5py.File(checkpoint_path(str(shared_tmp), 7), "w") as f:
            f.attrs["format_version"] = 1
            f.attrs["complete"] = True
    comm.barrier()
    train, test = snapshot_datasets()
    with pytest.raises(ConfigError, match=r"no valid checkpoint .*format version 1 \(expected 2\)") as caught:
        Trainer(snapshot_config(shared_tmp, resume=True), comm).fit(snapshot_mlp, train, test)
    assert "\n" not in str(caught.value)


CHECKPOINT_AT = 20
"""Iteration of the checkpoint every reshard resumes from: 20 steps of 2 ranks × 2 learners × 4 samples."""


def restore(scope, cfg, train):
    """Build a run on `scope` and restore the newest checkpoint into it, as `fit` does."""
    run = Trainer(cfg, scope).start(snapshot_mlp, train)
    metrics, progress = MetricsLog(cfg.run_dir, False), Progress(0, False)
    tuning = Tuning(cfg, scope, run, torch.device("cpu"), 1, metrics, progress)
    Checkpoints(cfg, scope, tuning, Controllers([], metrics)).restore(run)
    return run


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("ranks, learners", [(1, 2), (4, 2), (2, 3), (2, 1)])
def test_resume_reshards_to_other_ranks_and_learners(comm, shared_tmp, ranks, learners):
    """Train at -n 2, k = 2 to a checkpoint, then resume on `ranks` ranks with `learners` learners each."""
    train, test = snapshot_datasets()
    first = comm.split(comm.rank < 2, comm.rank)
    before = RecordingDataset(train)
    origin = shared_tmp / "origin"
    epochs = CHECKPOINT_AT * 2 * 2 * BATCH / SNAPSHOT_SAMPLES
    taken_before = None
    if comm.rank < 2:
        Trainer(snapshot_config(origin, epochs=epochs), first).fit(snapshot_mlp, before, test)
        taken_before = [i for rank in first.allgather_json(before.taken) for i in rank]
    taken_before = comm.bcast_json(taken_before)
    run_dir = shared_tmp / "resumed"
    if comm.rank == 0:
        shutil.copytree(origin, run_dir)
    comm.barrier()
    scope = comm.split(comm.rank < ranks, comm.rank)
    if comm.rank < ranks:
        cfg = snapshot_config(run_dir, learners=learners, resume=True)
        run = restore(scope, cfg, train)
        saved = checkpoint_path(str(origin), CHECKPOINT_AT)
        with h5py.File(saved) as f:
            z = torch.from_numpy(f["central/z"][...])
            held = f[f"ranks/{scope.rank}/weights"][...] if scope.rank < 2 else None
        assert torch.equal(run.central.z, z)
        assert run.learners.k == learners and run.state.iteration == CHECKPOINT_AT
        weights = run.learners.state_dict()["weights"]
        for j in range(learners):
            if held is not None and j < len(held):
                assert torch.equal(weights[j], torch.from_numpy(held[j]))
            else:
                assert torch.equal(weights[j], z) and not run.learners.momentum[j].any()

        after = RecordingDataset(train)
        Trainer(cfg, scope).fit(snapshot_mlp, after, test)
        epoch = taken_before + [i for rank in scope.allgather_json(after.taken) for i in rank]
        assert len(epoch) == len(set(epoch)), "a sample was trained on twice in the epoch"
        assert SNAPSHOT_SAMPLES - len(epoch) < ranks * learners * BATCH, "samples of the epoch were skipped"

        reaching = snapshot_config(
            shared_tmp / f"reach-{ranks}-{learners}", learners=learners, epochs=6, target_accuracy=0.45
        )
        if scope.rank == 0:
            shutil.copytree(origin, reaching.run_dir)
        scope.barrier()
        result = Trainer(dataclasses.replace(reaching, resume=True), scope).fit(snapshot_mlp, train, test)
        assert result.reached and result.iterations > CHECKPOINT_AT
    comm.barrier()
