"""What several test files share: paths, subprocess runners, small models, datasets and configurations, and readers
of a run's records. (The fixtures are in conftest.py; the single-process references in reference.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from crossbow_mpi import Config, Trainer
from crossbow_mpi.data import ArrayDataset, synthetic_dataset

REPO = Path(__file__).resolve().parent.parent
MNIST_DIR = REPO / "datasets" / "mnist"

# -- MPI and subprocesses


def world():
    """MPI.COMM_WORLD (mpi4py is imported only when a test needs it)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def self_comm():
    """A communicator of this process alone (MPI backend), for a single-process run inside any test."""
    from crossbow_mpi.comm import MpiCommunicator

    return MpiCommunicator(world().Split(world().Get_rank()))


def mpirun_command(ranks: int) -> list[str]:
    """Return an mpirun prefix for `ranks` processes that may oversubscribe this machine's cores."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    assert mpirun, "no mpirun on PATH"
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    extra = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    return [mpirun, "-n", str(ranks), *extra]


def run_job(ranks: int, args: list[str], timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `python -m crossbow_mpi.train ARGS` on `ranks` ranks; fail the test on a hang."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    cmd = [*mpirun_command(ranks), sys.executable, "-m", "crossbow_mpi.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def digest(directory: Path) -> dict[str, str]:
    """Return every file under `directory` by relative path, with its SHA-256."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def run_tool(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (a single-process tool) in the repository; fail the test on a hang."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def assert_user_error(done: subprocess.CompletedProcess, module: str, message: str) -> None:
    """Assert that a tool exited with code 2 and one line on stderr, `MODULE: error: ...MESSAGE...`."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{module}: error: ") and message in lines[0], lines[0]


def divisors(size: int) -> list[int]:
    return [groups for groups in range(1, size + 1) if size % groups == 0]


def needs_stages(comm, stages: int) -> None:
    """Skip the test where `stages` pipeline stages do not divide the job's ranks."""
    if comm.size % stages:
        pytest.skip(f"{stages} stages do not divide {comm.size} ranks")


# -- runs of STEPS steps of BATCH samples per learner on 6x6 synthetic images (the algorithms' tests)

STEPS = 20
BATCH = 4


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 10))


def mlp_bn() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10))


def mlp_bn_float64() -> nn.Module:
    return mlp_bn().double()


def deep_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12), nn.Linear(12, 10)
    )


def datasets(world_size: int, learners: int, steps: int = STEPS):
    """A training set of exactly `steps` global steps (one epoch) and a test set of 30 samples."""
    train = synthetic_dataset((1, 6, 6), 10, steps * world_size * learners * BATCH, seed=0)
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


def lockstep(comm, learners: int) -> int:
    """Return the samples of one global step: as rounds, every group takes exactly one step in each."""
    return comm.size * learners * BATCH


# -- a run's records


def metrics_records(comm, run_dir) -> list[dict]:
    """Return every record of the run's metrics.jsonl (read on rank 0) on every rank."""
    text = (run_dir / "metrics.jsonl").read_text() if comm.rank == 0 else None
    return [json.loads(line) for line in comm.bcast_json(text).splitlines()]


def evaluation_records(comm, run_dir) -> list[dict]:
    return [record for record in metrics_records(comm, run_dir) if "test_accuracy" in record]


# -- asynchronous rounds: one epoch, rank P-1 slower, unequal batches


class RecordingDataset(ArrayDataset):
    """Record the indices of every batch of more than one sample (not the start's one-sample checks)."""

    def __init__(self, dataset: ArrayDataset):
        super().__init__(dataset.inputs, dataset.targets, num_classes=dataset.num_classes)
        self.taken: list[int] = []

    def get_batch(self, indices):
        if len(indices) > 1:
            self.taken += indices.tolist()
        return super().get_batch(indices)


SLOWDOWN = 16
"""How much slower `rounds_run`'s last rank computes: a step of the tests' small MLP takes about a millisecond, so
that a smaller factor can hide in the exchanges' latency when 4 ranks share 2 cores."""


def rounds_run(comm, shared_tmp, algorithm="hogbatch", **overrides):
    """Train for one epoch, rank P-1 slower by SLOWDOWN and the ranks' batch sizes unequal; return the result, every
    sample index every rank took, the evaluation records, the training set's size and the largest batch size."""
    train, test = datasets(comm.size, 2)
    train = RecordingDataset(train)
    slow = {"inject_imbalance": f"slow-rank:{comm.size - 1}:{SLOWDOWN}"} if comm.size > 1 else {}
    sizes = tuple(BATCH + 2 * (r % 2) for r in range(comm.size))
    cfg = run_config(
        shared_tmp,
        algorithm=algorithm,
        learners=1,
        batch_size=sizes,
        momentum=0.0,
        eval_every=len(train) // 2,
        round_samples=len(train) // 4,
        **slow,
        **overrides,
    )
    result = Trainer(cfg, comm).fit(mlp_bn, train, test)
    taken = [index for rank in comm.allgather_json(train.taken) for index in rank]
    return result, taken, evaluation_records(comm, shared_tmp / "run"), len(train), max(sizes)


# -- snapshots, controllers and reports: one epoch of SNAPSHOT_SAMPLES samples, 2 learners, dropout

SNAPSHOT_SAMPLES = 768


def snapshot_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10)
    )


def snapshot_datasets():
    data = synthetic_dataset((1, 6, 6), 10, SNAPSHOT_SAMPLES + 200, seed=2)
    train = ArrayDataset(data.inputs[:SNAPSHOT_SAMPLES], data.targets[:SNAPSHOT_SAMPLES], num_classes=10)
    test = ArrayDataset(data.inputs[SNAPSHOT_SAMPLES:], data.targets[SNAPSHOT_SAMPLES:], num_classes=10)
    return train, test


def snapshot_config(run_dir, **overrides) -> Config:
    values = dict(
        run_dir=str(run_dir),
        learners=2,
        batch_size=BATCH,
        epochs=1,
        eval_every=0,
        target_accuracy=0,
        checkpoint_every=0,
        keep_checkpoints=20,
        seed=3,
        lr=0.05,
        threads=1,
        engine="sequential",
    )
    values.update(overrides)
    return Config(**values)


class HalveLrAt:
    """A controller that halves the learning rate and sets momentum 0.5 once, at an iteration."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def __call__(self, run, step):
        if run.state.iteration == self.iteration:
            return {"lr": run.hp.lr / 2, "momentum": 0.5}
        return None


# -- checkpoints and resuming: 3 epochs of 16 global steps, a checkpoint every 7


def resume_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def resume_config(run_dir, **overrides) -> Config:
    values = dict(
        run_dir=str(run_dir),
        learners=2,
        batch_size=4,
        epochs=3,
        eval_every=200,
        target_accuracy=0,
        checkpoint_every=7,
        keep_checkpoints=20,
        seed=11,
        lr=0.05,
        lr_steps=(2.0,),
    )
    values.update(overrides)
    return Config(**values)


def resume_fit(comm, cfg):
    train = synthetic_dataset((1, 6, 6), 10, 16 * 4 * 2 * comm.size, seed=2)
    test = synthetic_dataset((1, 6, 6), 10, 50, seed=3)
    return Trainer(cfg, comm).fit(resume_model, train, test)


def resume_between_syncs(comm, tmp, local: dict):
    """Return the `resume_fit` results of a whole run and of one resumed from its checkpoint after iteration 21 (with
    `sync_every` 5: 4 syncs and 1 local step), with the config `local`, and the resumed run's directory."""
    from crossbow_mpi.training.checkpoint import list_checkpoints

    whole = resume_fit(comm, resume_config(tmp / "whole", **local))
    interrupted = tmp / "interrupted"
    resume_fit(comm, resume_config(interrupted, **local))
    if comm.rank == 0:
        for path in list_checkpoints(str(interrupted)):
            if path.name > "checkpoint-000000021.h5":
                path.unlink()
    comm.barrier()
    return whole, resume_fit(comm, resume_config(interrupted, resume=True, **local)), interrupted
