"""`--tensorboard`: evaluation records as TensorBoard scalars beside metrics.jsonl, and a one-line error without
the package."""

from __future__ import annotations

import json
import os

import pytest

from crossbow_mpi import Trainer
from crossbow_mpi.training.records import TENSORBOARD_DIR

from helpers import run_job, snapshot_config, snapshot_datasets, snapshot_mlp

SCALARS = (
    "test_accuracy",
    "test_loss",
    "target_loss",
    "train_loss",
    "samples_per_s",
    "learners",
    "lr",
    "epoch",
    "time_s",
)


@pytest.mark.slow
def test_without_the_package_the_run_stops_at_start_with_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "site" / "tensorboard"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('tensorboard is blocked for this test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")])))
    job = run_job(
        2,
        ["--run-dir", str(tmp_path / "run"), "--dataset", "synthetic-mnist", "--model", "mlp", "--tensorboard"],
        timeout=120,
    )
    assert job.returncode == 2
    errors = [line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi: error:")]
    assert errors == [
        "crossbow_mpi: error: --tensorboard needs the tensorboard package: pip install 'crossbow_mpi[tensorboard]'"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi(min_size=1)
def test_evaluation_records_are_written_as_scalars(comm, shared_tmp):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    train, test = snapshot_datasets()
    run_dir = shared_tmp / "run"
    config = snapshot_config(run_dir, eval_every=160, tensorboard=True, target_loss=1e-9)  # the target, beside the loss
    Trainer(config, comm).fit(snapshot_mlp, train, test)
    if comm.rank == 0:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evaluations = [r for r in records if "event" not in r]
        assert len(evaluations) > 1
        events = accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR))
        events.Reload()
        assert set(SCALARS) <= set(events.Tags()["scalars"])
        for name in SCALARS:
            written = [(e.step, e.value) for e in events.Scalars(name)]
            assert written == [(r["iteration"], pytest.approx(r[name], rel=1e-6)) for r in evaluations]
    comm.barrier()
