"""Pipeline stages against single-process references, at any number of ranks (-n 1, 2, 4): a case runs where its
stages divide the ranks."""

from __future__ import annotations

import json

import h5py
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from crossbow_mpi import Trainer
from crossbow_mpi.checkpoint import list_checkpoints
from crossbow_mpi.config import ConfigError
from crossbow_mpi.models import LeNet
from crossbow_mpi.pipeline import schedule_ops
from crossbow_mpi.stages import split_model

from conftest import run_job
from reference import float_buffers, load_state, relative_error, sgd_reference, sma_reference
from test_algorithms import datasets as algorithm_datasets
from test_algorithms import run_config

STEPS = 12
BATCH = 4


def deep_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12), nn.Linear(12, 10)
    )


def mlp_bn_float64() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10)
    ).double()


def needs_stages(comm, stages: int) -> None:
    if comm.size % stages:
        pytest.skip(f"{stages} stages do not divide {comm.size} ranks")


def datasets(pipelines: int, learners: int):
    return algorithm_datasets(pipelines, learners, STEPS)


def stage_state(model: nn.Module, stages: int, stage: int) -> torch.Tensor:
    """The state vector (parameters, then float buffers) of one stage of a whole model."""
    stage_model = nn.Sequential(*split_model(model, stages)[stage])
    return torch.cat([t.detach().reshape(-1) for t in [*stage_model.parameters(), *float_buffers(stage_model)]])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("learners,micro_batches", [(1, 4), (2, 3)])
def test_pipeline_ssgd_equals_single_process_sgd(comm, shared_tmp, stages, schedule, learners, micro_batches):
    needs_stages(comm, stages)
    pipelines = comm.size // stages
    train, test = datasets(pipelines, learners)
    cfg = run_config(
        shared_tmp,
        algorithm="ssgd",
        learners=learners,
        pipeline_stages=stages,
        micro_batches=micro_batches,
        schedule=schedule,
    )
    result = Trainer(cfg, comm).fit(deep_mlp, train, test)
    assert result.iterations == STEPS
    model = sgd_reference(deep_mlp, cfg, train, learners * pipelines * BATCH, STEPS)
    stage = comm.rank % stages
    assert relative_error(result.central, stage_state(model, stages, stage)) < 1e-5


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_sma_matches_float64_reference_with_batchnorm(comm, shared_tmp, stages):
    """With one micro-batch BatchNorm sees the learner's whole batch, as in the unsplit model."""
    needs_stages(comm, stages)
    pipelines = comm.size // stages
    train, test = datasets(pipelines, 2)
    cfg = run_config(shared_tmp, algorithm="sma", learners=2, pipeline_stages=stages, schedule="1f1b")
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)
    z = sma_reference(mlp_bn_float64, cfg, train, pipelines, [2] * STEPS)
    model = mlp_bn_float64()
    load_state(model, z, sum(p.numel() for p in model.parameters()))
    assert result.central.dtype == torch.float64
    assert relative_error(result.central, stage_state(model, stages, comm.rank % stages)) < 1e-6


def mlp_dropout() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 10)
    )


def unsplit(result, comm, model_fn, stages: int) -> nn.Module:
    """Return model_fn() holding the stages' final states of this rank's pipeline."""
    states = comm.allgather_bytes(result.central.numpy().tobytes())
    first = comm.rank - comm.rank % stages
    model = model_fn()
    for stage, modules in enumerate(split_model(model, stages)):
        part = nn.Sequential(*modules)
        state = torch.frombuffer(bytearray(states[first + stage]), dtype=result.central.dtype)
        load_state(part, state, sum(p.numel() for p in part.parameters()))
    return model


@pytest.mark.mpi(min_size=2)
def test_evaluation_runs_the_whole_pipeline_as_the_unsplit_model(comm, shared_tmp):
    """BatchNorm's running statistics and dropout's evaluation mode are those of the unsplit model."""
    needs_stages(comm, 2)
    train, test = datasets(comm.size // 2, 2)
    cfg = run_config(shared_tmp, learners=2, pipeline_stages=2, micro_batches=2)
    result = Trainer(cfg, comm).fit(mlp_dropout, train, test)
    model = unsplit(result, comm, mlp_dropout, 2).eval()
    with torch.no_grad():
        inputs, targets = test.get_batch(torch.arange(len(test)))
        outputs = model(inputs)
    assert int((outputs.argmax(1) == targets).sum()) / len(test) == result.test_accuracy
    records = [json.loads(line) for line in open(shared_tmp / "run" / "metrics.jsonl")]
    test_loss = [r["test_loss"] for r in records if "test_loss" in r][-1]
    assert float(F.cross_entropy(outputs, targets)) == pytest.approx(test_loss, rel=1e-5)

    no_dropout = Trainer(run_config(shared_tmp / "p0", learners=2, pipeline_stages=2, micro_batches=2), comm)
    plain = no_dropout.fit(lambda: _without_dropout(mlp_dropout()), train, test)
    assert not torch.equal(plain.central, result.central), "dropout is active in training"


def _without_dropout(model: nn.Sequential) -> nn.Sequential:
    model[4].p = 0.0
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_pipeline_resume_is_bit_identical(comm, shared_tmp, algorithm):
    needs_stages(comm, 2)
    train, test = datasets(comm.size // 2, 2)

    def fit(run_dir, **overrides):
        cfg = run_config(
            run_dir,
            algorithm=algorithm,
            learners=2,
            pipeline_stages=2,
            micro_batches=2,
            schedule="1f1b",
            epochs=2,
            checkpoint_every=5,
            keep_checkpoints=20,
            **overrides,
        )
        return Trainer(cfg, comm).fit(mlp_dropout, train, test)

    whole = fit(shared_tmp / "whole")
    fit(shared_tmp / "cut")
    if comm.rank == 0:
        for path in list_checkpoints(str(shared_tmp / "cut" / "run")):
            if path.name > "checkpoint-000000010.h5":
                path.unlink()
    comm.barrier()
    resumed = fit(shared_tmp / "cut", resume=True)
    assert resumed.iterations == whole.iterations == 2 * STEPS
    assert torch.equal(resumed.central, whole.central)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "model_fn,message",
    [
        (lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 10), nn.ReLU()), "only 1 modules with trainable"),
        (lambda: _NotSequential(), "cannot be split into stages"),
    ],
)
def test_models_that_cannot_be_split_are_config_errors(comm, shared_tmp, model_fn, message):
    needs_stages(comm, 2)
    train, test = datasets(comm.size // 2, 1)
    with pytest.raises(ConfigError, match=message):
        Trainer(run_config(shared_tmp, learners=1, pipeline_stages=2), comm).fit(model_fn, train, test)


class _NotSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(36, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


@pytest.mark.parametrize(
    "ranks,args,message",
    [
        (2, ["--pipeline-stages", "3"], "--pipeline-stages 3 does not divide the 2 ranks"),
        (1, ["--micro-batches", "5", "--batch-size", "4"], "--micro-batches 5 exceeds the --batch-size 4"),
        (1, ["--pipeline-stages", "2", "--learners", "auto"], "--pipeline-stages needs a fixed number of --learners"),
        (1, ["--schedule", "zigzag"], "--schedule: unknown value"),
    ],
)
def test_bad_pipeline_flags_exit_2_with_one_line(tmp_path, ranks, args, message):
    job = run_job(ranks, ["--run-dir", str(tmp_path / "run"), "--dataset", "synthetic-mnist", *args], timeout=60)
    ours = sorted({line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi:")})
    assert job.returncode == 2 and len(ours) == 1 and "Traceback" not in job.stderr, job.stderr
    assert message in ours[0], ours[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 4), (4, 3), (4, 8)])
def test_schedules_complete_and_1f1b_bounds_the_activations_held(schedule, stages, micro_batches):
    """Play every stage's order against the messages it needs: each forward pass after the previous stage's,
    each backward pass after the next stage's; every stage finishes (no deadlock)."""
    orders = [schedule_ops(schedule, s, stages, micro_batches) for s in range(stages)]
    for order in orders:
        assert sorted(order) == sorted(
            [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
        )
    done: set[tuple[str, int, int]] = set()
    positions = [0] * stages
    while any(p < len(o) for p, o in zip(positions, orders)):
        moved = False
        for s in range(stages):
            if positions[s] == len(orders[s]):
                continue
            op, i = orders[s][positions[s]]
            needs = ("F", i, s - 1) if op == "F" else ("B", i, s + 1)
            ready = (needs[2] < 0 or needs[2] >= stages or needs in done) and (op == "F" or ("F", i, s) in done)
            if ready:
                done.add((op, i, s))
                positions[s] += 1
                moved = True
        assert moved, f"deadlock at {positions}"
    if schedule == "1f1b":
        for s, order in enumerate(orders):
            held = peak = 0
            for op, _ in order:
                held += 1 if op == "F" else -1
                peak = max(peak, held)
            assert peak <= stages - s


def test_cli_trains_a_built_in_model_in_stages_and_checkpoints_each_stage(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--dataset", "synthetic-mnist", "--model", "lenet", "--pipeline-stages", "2", "--micro-batches", "2"]
    args += ["--schedule", "1f1b", "--epochs", "0.002", "--target-accuracy", "0", "--run-dir", str(run_dir)]
    job = run_job(2, args, timeout=120)
    assert job.returncode == 0, job.stderr
    with h5py.File(list_checkpoints(str(run_dir))[-1]) as f:
        assert f.attrs["pipeline_stages"] == 2 and "central" not in f
        sizes = [f[f"stages/{s}/central/z"].shape[0] for s in (0, 1)]
        assert [f[f"ranks/{r}/weights"].shape[1] for r in (0, 1)] == sizes
    lenet = LeNet()
    assert sum(sizes) == sum(p.numel() for p in lenet.parameters())
