"""Exporting a trained model: `python -m crossbow_mpi.export` after a CLI run, and `FitResult.model()`."""

from __future__ import annotations

import json
import shutil

import h5py
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from crossbow_mpi import Config, Trainer
from crossbow_mpi.data import build_dataset, dataset_names, dataset_shape, synthetic_dataset
from crossbow_mpi.data.datasets import SHAPES
from crossbow_mpi.models import build_model
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.training.checkpoint import list_checkpoints
from crossbow_mpi.training.hooks import evaluate_model

from helpers import REPO, assert_user_error, mlp_bn_float64, run_job, run_tool, self_comm

RUN = [
    "--dataset",
    "synthetic-mnist",
    "--model",
    "mlp",
    "--epochs",
    "0.2",
    "--eval-every",
    "4000",
    "--target-accuracy",
    "0",
    "--learners",
    "2",
    "--checkpoint-every",
    "100",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory of a short two-rank CLI run, with checkpoints at iterations 100 and at the end."""
    run_dir = tmp_path_factory.mktemp("run")
    job = run_job(2, ["--run-dir", str(run_dir), *RUN], timeout=180)
    assert job.returncode == 0, job.stderr
    return run_dir


@pytest.mark.slow
def test_exported_model_loads_into_a_fresh_model_and_scores_the_last_evaluation(trained, tmp_path):
    out = tmp_path / "model.safetensors"
    done = run_tool("crossbow_mpi.export", str(trained), "--out", str(out))
    assert done.returncode == 0, done.stderr
    config = json.loads((trained / "config.json").read_text())
    _, test_set = build_dataset(config["dataset"], config["data_dir"], config["seed"])
    model = build_model(config["model"], test_set.input_shape, test_set.num_classes)
    model.load_state_dict(load_file(out))
    accuracy = evaluate_model(model, test_set, self_comm(), F.cross_entropy)["test_accuracy"]
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "test_accuracy" in r][-1]
    assert accuracy == last["test_accuracy"]


@pytest.mark.slow
def test_an_older_checkpoint_exports_its_own_z(trained, tmp_path):
    older = trained / "checkpoint-000000100.h5"
    out = tmp_path / "older.safetensors"
    done = run_tool("crossbow_mpi.export", str(trained), "--checkpoint", str(older), "--out", str(out))
    assert done.returncode == 0, done.stderr
    model = build_model("mlp", *dataset_shape("synthetic-mnist"))
    model.load_state_dict(load_file(out))
    with h5py.File(older) as f:
        z = torch.from_numpy(f["central/z"][...])
    assert torch.equal(FlatLayout(model).flatten(model), z)


def damaged_run(trained, tmp_path, case: str):
    """Return export's arguments for a user mistake."""
    if case == "missing run dir":
        return [str(tmp_path / "nowhere"), "--out", str(tmp_path / "m.safetensors")]
    if case == "not a run dir":
        return [str(tmp_path), "--out", str(tmp_path / "m.safetensors")]
    if case == "no checkpoint":
        shutil.copy(trained / "config.json", tmp_path / "config.json")
        return [str(tmp_path), "--out", str(tmp_path / "m.safetensors")]
    if case == "another model":
        config = json.loads((trained / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "model": "lenet"}))
        shutil.copy(trained / "checkpoint-000000100.h5", tmp_path)
        return [str(tmp_path), "--out", str(tmp_path / "m.safetensors")]
    if case == "not a checkpoint":
        return [str(trained), "--checkpoint", str(trained / "config.json"), "--out", str(tmp_path / "m.safetensors")]
    if case == "unwritable out":
        return [str(trained), "--out", str(tmp_path / "no-such-dir" / "m.safetensors")]
    assert case == "no out"
    return [str(trained)]


ERRORS = {
    "missing run dir": "no such run directory",
    "not a run dir": "config.json: missing",
    "no checkpoint": "no valid checkpoint",
    "another model": "holds another model",
    "not a checkpoint": "unreadable",
    "unwritable out": "--out",
    "no out": "required: --out",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_exits_2_with_one_line(trained, tmp_path, case):
    done = run_tool("crossbow_mpi.export", *damaged_run(trained, tmp_path, case))
    assert_user_error(done, "crossbow_mpi.export", ERRORS[case])
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_dataset_shape_matches_the_loaded_dataset(name):
    data_dir = REPO / "datasets" / name
    if not data_dir.is_dir():
        pytest.skip(f"no {data_dir}")
    train, test = build_dataset(name, str(data_dir), seed=0)
    assert dataset_shape(name) == (train.input_shape, train.num_classes) == (test.input_shape, test.num_classes)


def test_every_dataset_has_a_shape():
    assert sorted([*SHAPES, "text"]) == dataset_names()  # text's shape follows --seq-len
    assert dataset_shape("text", seq_len=32) == ((32,), 256)


@pytest.mark.mpi(min_size=1)
def test_fit_result_model_holds_z_with_its_buffers(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 30, seed=1)
    config = Config(
        run_dir=str(shared_tmp / "run"), batch_size=4, epochs=1, eval_every=0, target_accuracy=0, learners=2, lr=0.05
    )
    result = Trainer(config, comm).fit(mlp_bn_float64, train, test)
    model = result.model()
    layout = FlatLayout(model)
    assert torch.equal(layout.flatten(model), result.central)
    with h5py.File(list_checkpoints(config.run_dir)[-1]) as f:
        assert layout.extra_state_bytes(model) == f["central/extra"][...].tobytes()
    assert model.state_dict()["2.num_batches_tracked"] > 0
    fresh = mlp_bn_float64()
    fresh.load_state_dict(result.state_dict())
    assert evaluate_model(fresh, test, comm, F.cross_entropy)["test_accuracy"] == result.test_accuracy
