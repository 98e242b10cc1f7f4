"""Pipeline stages against single-process references, at any number of ranks (-n 1, 2, 4): a case runs where its
stages divide the ranks."""

from __future__ import annotations

import dataclasses
import json

import h5py
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import Trainer
from crossbow_mpi.config import ConfigError
from crossbow_mpi.data import build_dataset
from crossbow_mpi.models import LeNet
from crossbow_mpi.parallel.partition import param_cut, split_model, time_cut
from crossbow_mpi.parallel.pipeline import ACTIVATION, Transfer, schedule_ops, schedule_steps
from crossbow_mpi.training.checkpoint import list_checkpoints
from crossbow_mpi.training.hooks import evaluate_model

from helpers import datasets as algorithm_datasets
from helpers import deep_mlp, needs_stages, run_config, run_job, run_tool, self_comm
from reference import relative_error, sgd_reference, sma_reference

STEPS = 12
BATCH = 4


def mlp_bn_float64() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10)
    ).double()


def datasets(pipelines: int, learners: int):
    return algorithm_datasets(pipelines, learners, STEPS)


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
    assert relative_error(result.central, parameters_to_vector(model.parameters()).detach()) < 1e-5


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
    assert result.central.dtype == torch.float64
    assert relative_error(result.central, z) < 1e-6


def mlp_dropout() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 10)
    )


@pytest.mark.mpi(min_size=2)
def test_fit_result_holds_the_whole_model_that_evaluation_ran(comm, shared_tmp):
    """Every rank's result is the whole unsplit model, BatchNorm's counter (of stage 1) included, and scores as the
    pipeline's evaluation did: BatchNorm's running statistics and dropout's evaluation mode are the unsplit model's."""
    needs_stages(comm, 2)
    train, test = datasets(comm.size // 2, 2)
    cfg = run_config(shared_tmp, learners=2, pipeline_stages=2, micro_batches=2)
    result = Trainer(cfg, comm).fit(mlp_dropout, train, test)
    assert len(set(comm.allgather_bytes(result.central.numpy().tobytes()))) == 1
    model = mlp_dropout()
    model.load_state_dict(result.state_dict())
    assert model.state_dict()["2.num_batches_tracked"] > 0
    model.eval()
    with torch.no_grad():
        inputs, targets = test.get_batch(torch.arange(len(test)))
        outputs = model(inputs)
    assert int((outputs.argmax(1) == targets).sum()) / len(test) == result.test_accuracy
    records = [json.loads(line) for line in (shared_tmp / "run" / "metrics.jsonl").read_text().splitlines()]
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
    _drop_checkpoints_after(comm, shared_tmp / "cut" / "run", 10)
    resumed = fit(shared_tmp / "cut", resume=True)
    assert resumed.iterations == whole.iterations == 2 * STEPS
    assert torch.equal(resumed.central, whole.central)


def _drop_checkpoints_after(comm, run_dir, iteration: int) -> None:
    """Delete the run's checkpoints after `iteration` (on rank 0), as if the job had stopped there."""
    if comm.rank == 0:
        for path in list_checkpoints(str(run_dir)):
            if path.name > f"checkpoint-{iteration:09d}.h5":
                path.unlink()
    comm.barrier()


def convs_then_dense() -> nn.Module:
    """Convolutions on an upsampled image (few parameters, most of the compute), then a dense layer (the reverse):
    cut in two by parameters after the convolutions ([3]), by time between them ([2])."""
    return nn.Sequential(
        *(nn.Upsample(scale_factor=4), nn.Conv2d(1, 32, 3, padding=1), nn.Tanh()),
        *(nn.Conv2d(32, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 32, 3, padding=1), nn.Tanh()),
        *(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(1152, 64), nn.Tanh(), nn.Linear(64, 10)),
    )


def test_a_cut_by_time_balances_compute_and_a_cut_is_checked():
    model, threads = convs_then_dense(), torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a loaded two-core machine time mostly the other jobs
    try:
        assert param_cut(model, 2) == [3] and time_cut(model, 2, torch.randn(2, 1, 6, 6)) == [2]
    finally:
        torch.set_num_threads(threads)
    assert [len(stage) for stage in split_model(model, 2, [2])] == [5, 7]
    for cut in ([5], [0], [1, 2]):
        with pytest.raises(ValueError, match="does not split the model's 5 units into 2 stages"):
            split_model(model, 2, cut)


def test_a_burst_of_load_slows_a_round_of_the_time_cut_not_one_unit(monkeypatch):
    """The first three passes timed take 10 ms more, as under a burst of load from another process: timed one unit
    after another, unit 0 would cost 11.6 ms by its median and the cut would be [1]."""
    from crossbow_mpi.parallel import partition

    costs_s, units, timed = [1.6e-3, 2.9e-3, 2.9e-3, 0.4e-3, 0.3e-3], {}, []

    def seconds(run) -> float:
        timed.append(units.setdefault(run, len(units)))
        return costs_s[timed[-1]] + (10e-3 if len(timed) <= 3 else 0.0)

    monkeypatch.setattr(partition, "_seconds", seconds)
    assert time_cut(convs_then_dense(), 2, torch.randn(2, 1, 6, 6)) == [2]
    assert timed == list(range(5)) * 5, "each round times every unit once, in order"


@pytest.mark.mpi(min_size=2)
def test_a_time_cut_is_checkpointed_and_a_resume_takes_it(comm, shared_tmp):
    needs_stages(comm, 2)
    train, test = datasets(comm.size // 2, 1)

    def fit(**overrides):
        cfg = run_config(
            shared_tmp, learners=1, pipeline_stages=2, micro_batches=2, checkpoint_every=5, keep_checkpoints=20
        )
        return Trainer(dataclasses.replace(cfg, lr=0.01, **overrides), comm).fit(convs_then_dense, train, test)

    whole = fit(cut="time")
    _drop_checkpoints_after(comm, shared_tmp / "run", 10)
    newest = list_checkpoints(str(shared_tmp / "run"))[-1]
    with h5py.File(newest) as f:
        cut = json.loads(f.attrs["pipeline_cut"])
    assert cut in ([1], [2], [3])  # [2] unless the machine's load upset the timing
    resumed = fit(resume=True)  # --cut params: the checkpoint's cut wins
    assert torch.equal(resumed.central, whole.central)

    _drop_checkpoints_after(comm, shared_tmp / "run", 10)
    if comm.rank == 0:
        with h5py.File(newest, "r+") as f:
            f.attrs["pipeline_cut"] = json.dumps([3] if cut == [2] else [2])
    comm.barrier()
    with pytest.raises(ConfigError, match="holds a different model"):  # another cut's stages: refused
        fit(resume=True)


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


@pytest.mark.slow
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
def test_schedules_progress_under_rendezvous_sends_and_1f1b_bounds_the_activations_held(
    schedule, stages, micro_batches
):
    """Every stage finishes its steps where each send completes only when its receive is posted (NCCL); with each
    group's transfers one by one instead, 1f1b deadlocks (a stage sends an activation while the next stage sends
    it a gradient)."""
    orders = [schedule_steps(schedule, s, stages, micro_batches) for s in range(stages)]
    for s, order in enumerate(orders):
        passes = [step for step in order if not isinstance(step[0], Transfer)]
        assert passes == schedule_ops(schedule, s, stages, micro_batches)
        assert sorted(passes) == sorted(
            [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
        )
    assert play(orders) == [len(order) for order in orders]
    one_by_one = [[part for step in order for part in _one_by_one(step)] for order in orders]
    deadlocks = play(one_by_one) != [len(order) for order in one_by_one]
    assert deadlocks == (schedule == "1f1b" and micro_batches > 1)
    if schedule == "1f1b":
        for s in range(stages):
            held = peak = 0
            for op, _ in schedule_ops(schedule, s, stages, micro_batches):
                held += 1 if op == "F" else -1
                peak = max(peak, held)
            assert peak <= stages - s


def _one_by_one(step: tuple) -> list[tuple]:
    return [(transfer,) for transfer in step] if isinstance(step[0], Transfer) else [step]


def play(orders: list[list[tuple]]) -> list[int]:
    """Play the stages' steps (`schedule_steps`) with rendezvous sends and return how far each stage got: a
    communication step is posted once the previous stage has reached the step that sends the activation it
    receives (the NCCL link sends an activation's shape ahead over MPI), and it completes once each of its
    transfers has met its mirror, the next message on that channel, in the neighbour's posted step."""
    positions, started, matched = [0] * len(orders), [False] * len(orders), [set() for _ in orders]

    def current(s: int) -> tuple:
        return orders[s][positions[s]] if 0 <= s < len(orders) and positions[s] < len(orders[s]) else ()

    def group(s: int) -> tuple:
        return current(s) if current(s) and isinstance(current(s)[0], Transfer) else ()

    moved = True
    while moved:
        moved = False
        for s in range(len(orders)):
            receives = [t for t in group(s) if t == Transfer("recv", ACTIVATION, t.micro)]
            started[s] |= all(Transfer("send", ACTIVATION, t.micro) in group(s - 1) for t in receives)
        for s in range(len(orders)):
            if not current(s):
                continue
            if group(s):
                for t in [t for t in group(s) if t not in matched[s]] if started[s] else []:
                    peer = s + t.direction
                    waiting = [u for u in group(peer) if u not in matched[peer]] if started[peer] else []
                    channel = [u for u in waiting if u.tag == t.tag and u.op != t.op]
                    assert len(channel) <= 1 and all(u.micro == t.micro for u in channel), f"out of order: {t}"
                    if channel:
                        matched[s].add(t)
                        matched[peer].add(channel[0])
                if len(matched[s]) < len(group(s)):
                    continue
            positions[s] += 1
            started[s], matched[s], moved = False, set(), True
    return positions


@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory):
    """The run directory of a two-stage CLI run of LeNet, cut by time."""
    run_dir = tmp_path_factory.mktemp("run")
    args = ["--dataset", "synthetic-mnist", "--model", "lenet", "--pipeline-stages", "2", "--micro-batches", "2"]
    args += ["--schedule", "1f1b", "--epochs", "0.002", "--target-accuracy", "0", "--run-dir", str(run_dir)]
    args += ["--cut", "time"]
    job = run_job(2, args, timeout=120)
    assert job.returncode == 0, job.stderr
    return run_dir


@pytest.mark.slow
def test_cli_trains_a_built_in_model_in_stages_and_checkpoints_each_stage(lenet_run):
    with h5py.File(list_checkpoints(str(lenet_run))[-1]) as f:
        assert f.attrs["pipeline_stages"] == 2 and "central" not in f and len(json.loads(f.attrs["pipeline_cut"])) == 1
        sizes = [f[f"stages/{s}/central/z"].shape[0] for s in (0, 1)]
        assert [f[f"ranks/{r}/weights"].shape[1] for r in (0, 1)] == sizes
    lenet = LeNet()
    assert sum(sizes) == sum(p.numel() for p in lenet.parameters())


@pytest.mark.slow
def test_export_of_a_pipeline_run_writes_the_whole_model(lenet_run, tmp_path):
    out = tmp_path / "model.safetensors"
    done = run_tool("crossbow_mpi.export", str(lenet_run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    model = LeNet()
    model.load_state_dict(load_file(out))
    config = json.loads((lenet_run / "config.json").read_text())
    _, test = build_dataset(config["dataset"], config["data_dir"], config["seed"])
    tested = evaluate_model(model, test, self_comm(), F.cross_entropy)
    accuracy, loss = tested["test_accuracy"], tested["test_loss"]
    records = [json.loads(line) for line in (lenet_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "test_loss" in r][-1]
    assert accuracy == last["test_accuracy"] and loss == pytest.approx(last["test_loss"], rel=1e-5)
