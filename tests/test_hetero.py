"""Heterogeneous ranks: per-rank batch sizes, devices and threads; S-SGD averages unequal batches by samples."""

from __future__ import annotations

import json
from types import SimpleNamespace

import h5py
import pytest
import torch
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.algorithms.elastic import normalised_l2
from crossbow_mpi.config import per_rank
from crossbow_mpi.control.adaptive_batch import AdaptiveBatch, BatchPolicy, adapt
from crossbow_mpi.control.lr_schedule import learning_rate
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.data.sampler import GlobalSampler
from crossbow_mpi.runtime import process
from crossbow_mpi.train import parse_config
from crossbow_mpi.training.checkpoint import list_checkpoints

from helpers import BATCH, datasets, metrics_records, mlp, mlp_bn, run_config, run_job, self_comm
from reference import relative_error, sgd_reference

STEPS = 12
SIZES = (3, 5, 2, 6)
"""Batch sizes of ranks 0..3 (the first P of them at P ranks)."""


def test_batch_size_and_threads_take_one_value_or_one_per_rank():
    config = parse_config(["--batch-size", "64,64,8,8", "--threads", "2,1,1,1", "--device", "cuda,cpu,cpu,cpu"])
    config.validate(ALGORITHMS)
    assert config.batch_size == (64, 64, 8, 8) and config.threads == (2, 1, 1, 1)
    assert per_rank(config, "device", 4) == ("cuda", "cpu", "cpu", "cpu")
    assert per_rank(config, "batch_size", 4)[2] == 8
    assert parse_config(["--batch-size", "16"]).batch_size == 16
    assert per_rank(parse_config(["--batch-size", "16"]), "batch_size", 3) == (16, 16, 16)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "8,0"], "--batch-size must be positive"),
        (["--batch-size", "8,x"], "--batch-size: invalid value"),
        (["--threads", "1,-1"], "--threads must not be negative"),
        (["--device", "mixed,cpu"], "--device: unknown value 'mixed'"),
        (["--device", "cpu,gpu"], "--device: unknown value 'gpu'"),
        (["--batch-size", "8,4", "--pipeline-stages", "2"], "one --batch-size for every rank"),
        (["--batch-scaled-lr", "--algorithm", "elastic"], "--batch-scaled-lr applies to --algorithm hogbatch"),
    ],
)
def test_bad_per_rank_values_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv).validate(ALGORITHMS)


def test_a_per_rank_list_of_the_wrong_length_is_a_config_error():
    with pytest.raises(ConfigError, match="--batch-size lists 3 values, one per rank, but there are 4 ranks"):
        per_rank(Config(batch_size=(1, 2, 3)), "batch_size", 4)


@pytest.mark.slow
def test_a_per_rank_list_of_the_wrong_length_exits_2_with_one_line(tmp_path):
    args = ["--run-dir", str(tmp_path / "run"), "--dataset", "synthetic-mnist", "--batch-size", "8,8,8"]
    job = run_job(2, args, timeout=90)
    ours = {line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi:")}
    assert job.returncode == 2 and len(ours) == 1 and "Traceback" not in job.stderr, job.stderr
    assert "--batch-size lists 3 values" in job.stderr


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)


def test_mixed_puts_the_first_local_ranks_on_gpus_and_the_rest_on_cpu(monkeypatch):
    fake_gpus(monkeypatch, 2)
    placed = [process.select_device("mixed", local_rank) for local_rank in range(4)]
    assert placed == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu"), torch.device("cpu")]


def test_mixed_without_a_gpu_is_a_config_error(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="--device mixed: no CUDA device"):
        process.select_device("mixed", 0)


def test_unequal_batch_sizes_cut_disjoint_rank_major_slices():
    sizes = SIZES
    samplers = [GlobalSampler(200, 5, rank, len(sizes)) for rank in range(len(sizes))]
    order = samplers[0].permutation(0)
    offset, seen = 0, []
    for k in (1, 2, 2, 1, 3):
        assert samplers[0].step_size(k, sizes) == k * sum(sizes)
        start = offset
        for rank, sampler in enumerate(samplers):
            rows = sampler.indices(0, offset, k, sizes)
            assert rows.shape == (k, sizes[rank])
            assert torch.equal(rows.reshape(-1), order[start : start + k * sizes[rank]])
            start += k * sizes[rank]
            seen.append(rows.reshape(-1))
        offset += k * sum(sizes)
    seen = torch.cat(seen).tolist()
    assert len(seen) == len(set(seen)) == 9 * sum(sizes)


def test_equal_batch_sizes_per_rank_give_the_single_values_indices():
    for rank in range(3):
        sampler = GlobalSampler(100, 2, rank, 3)
        assert torch.equal(sampler.indices(0, 12, 2, (4, 4, 4)), sampler.indices(0, 12, 2, 4))


class Recording:
    """A dataset that records the indices of every training batch it gives."""

    def __init__(self, dataset):
        self.dataset, self.used = dataset, []

    def __len__(self):
        return len(self.dataset)

    def get_batch(self, indices):
        self.used.append(indices.clone())
        return self.dataset.get_batch(indices)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners", [1, 3])
def test_ssgd_with_unequal_batches_equals_single_process_sgd_on_the_union_batch(comm, shared_tmp, learners):
    sizes = SIZES[: comm.size]
    aggregate = learners * sum(sizes)
    train = Recording(synthetic_dataset((1, 6, 6), 10, STEPS * aggregate, seed=0))
    test = synthetic_dataset((1, 6, 6), 10, 30, seed=1)
    cfg = run_config(shared_tmp, algorithm="ssgd", learners=learners, batch_size=sizes, engine="sequential")
    trainer = Trainer(cfg, comm)
    result = trainer.fit(mlp, train, test)
    assert result.iterations == STEPS

    model = sgd_reference(mlp, cfg, train.dataset, aggregate, STEPS)
    assert relative_error(result.central, parameters_to_vector(model.parameters())) < 1e-5
    training = [i for i in train.used if len(i) == sizes[comm.rank]][: STEPS * learners]
    used = [i for rank in comm.allgather_json(torch.cat(training).tolist()) for i in rank]
    assert sorted(used) == list(range(STEPS * aggregate)), "every sample of the epoch once"


def test_adapt_grows_the_faster_ranks_batches_and_shrinks_the_slower_within_bounds():
    policy = BatchPolicy(every=5, smallest=2, largest=9, step=2)
    assert adapt(policy, [0.4, 0.4, 0.2], (8, 4, 6)) == (9, 6, 4)
    assert adapt(policy, [0.2, 0.5, 0.3], (3, 9, 2)) == (2, 9, 2)
    assert adapt(policy, [0.5, 0.5], (4, 6)) == (4, 6)


def test_adapt_with_hold_settles_where_the_artifacts_rule_swings():
    swinging = BatchPolicy(every=1, smallest=1, largest=1024, step=32)
    holding = BatchPolicy(every=1, smallest=1, largest=1024, step=32, hold=True)
    # rank 1 takes twice rank 0's time per sample: at (64, 64) it makes a third of the updates
    assert adapt(swinging, [2 / 3, 1 / 3], (64, 64)) == (96, 32)
    # hold predicts (0.4, 0.6) at (96, 32) and (6/11, 5/11) at (80, 48): the halved step balances better
    assert adapt(holding, [2 / 3, 1 / 3], (64, 64)) == (80, 48)
    # at (96, 32) the steps take 96 and 64: the full step back would predict (2/3, 1/3), a step of 8 (10/21, 11/21)
    assert adapt(swinging, [0.4, 0.6], (96, 32)) == (64, 64)
    assert adapt(holding, [0.4, 0.6], (96, 32)) == (88, 40)
    assert adapt(holding, [0.6, 0.4], (64, 64)) == (80, 48), "rank 1 1.5x slower: (96, 32) overshoots, 16 does not"
    assert adapt(holding, [0.4, 0.4, 0.2], (8, 4, 6)) == (10, 6, 4), "32 to 4 overshoot, 2 balances best"
    finer = BatchPolicy(every=1, smallest=2, largest=9, step=2, hold=True)
    assert adapt(finer, [0.4, 0.4, 0.2], (8, 4, 6)) == (9, 6, 4)
    assert adapt(holding, [0.5, 0.5], (64, 64)) == (64, 64)


@pytest.mark.parametrize("slowdown", [1.5, 2, 4])
def test_adapt_with_hold_reaches_the_balanced_step_time_and_stays(slowdown):
    policy = BatchPolicy(every=1, smallest=1, largest=1024, step=32, hold=True)
    seconds_per_sample, sizes, history = (1.0, slowdown), (64, 64), []
    for _ in range(8):
        rates = [1 / (size * seconds) for size, seconds in zip(sizes, seconds_per_sample, strict=True)]
        sizes = adapt(policy, [rate / sum(rates) for rate in rates], sizes)
        history.append(sizes)
    balanced = 128 / (1 + 1 / slowdown)  # the step time with both ranks busy all the time
    step_time = max(size * seconds for size, seconds in zip(sizes, seconds_per_sample, strict=True))
    assert step_time <= 1.02 * balanced and sum(sizes) == 128, history
    assert history[3:] == [sizes] * 5, f"settled within 4 windows: {history}"


def test_adaptive_batch_keeps_the_sizes_during_the_warm_up():
    run = SimpleNamespace(epoch_progress=0.25, algorithm=SimpleNamespace(rounds=True))
    controller = AdaptiveBatch(BatchPolicy(every=1, smallest=1, largest=64, step=32, fixed_until=0.5), scope=None)
    assert controller(run, SimpleNamespace(compute_s=1.0, updates=3)) is None
    assert (controller.steps, controller.history) == (0, []), "nothing measured before the warm-up ends"


def test_merge_l2_moves_the_most_and_fewest_updates_weights_by_a_tenth_as_heterogpu():
    assert normalised_l2([6.0, 2.0, 2.0]) == pytest.approx([6.6, 1.8, 2.0])
    assert normalised_l2([3.0, 3.0]) == [3.0, 3.0]


def test_warm_up_starts_at_warmup_start_and_decay_follows_heterogpu():
    cfg = parse_config(["--lr", "0.1", "--warmup-epochs", "2", "--warmup-start", "0.01", "--lr-decay", "0.5"])
    assert learning_rate(0.1, cfg, 0.0)[0] == pytest.approx(0.001)
    assert learning_rate(0.1, cfg, 1.0)[0] == pytest.approx(0.1 * (0.01 + 0.99 / 2))
    assert learning_rate(0.1, cfg, 4.0)[0] == pytest.approx(0.1 / (1 + 0.5 * 2))


@pytest.mark.parametrize(
    "flags, message",
    [(["--warmup-start", "0"], "--warmup-start must be in"), (["--lr-decay", "-1"], "--lr-decay must not be negative")],
)
def test_bad_schedule_flags_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(flags).validate(ALGORITHMS)


def test_batch_min_above_batch_max_is_a_config_error():
    with pytest.raises(ConfigError, match="--batch-min 9 exceeds --batch-max 8"):
        parse_config(["--adaptive-batch", "--batch-min", "9", "--batch-max", "8"]).validate(ALGORITHMS)


def test_hogbatchs_batch_scaled_step_is_eta_b_over_b_base_bit_for_bit(tmp_path):
    """One rank, B = 2b: every update scaled by 1/2 (exact in floating point), with momentum and weight decay, is
    the run at half the learning rate, bit for bit; the default (s = 1) is not."""
    train, test = datasets(1, 1)
    central = {}
    for name, flags in {
        "scaled": {"batch_scaled_lr": True, "base_batch": 2 * BATCH, "lr": 0.1},
        "half": {"lr": 0.05},
        "unscaled": {"base_batch": 2 * BATCH, "lr": 0.1},
    }.items():
        cfg = run_config(tmp_path / name, algorithm="hogbatch", learners=1, comm="mpi", **flags)
        central[name] = Trainer(cfg, self_comm()).fit(mlp_bn, train, test).central
    assert torch.equal(central["scaled"], central["half"])
    assert not torch.equal(central["unscaled"], central["half"])


@pytest.mark.mpi(min_size=1)
def test_adaptive_batch_gives_a_slow_rank_a_smaller_batch_and_the_faster_ones_larger(comm):
    slow = comm.size - 1
    run = SimpleNamespace(
        sampler=GlobalSampler(1000, 1, comm.rank, comm.size),
        hp=SimpleNamespace(batch_size=16),
        state=SimpleNamespace(iteration=3),
        algorithm=SimpleNamespace(rounds=False),
        epoch_progress=0.5,
    )
    controller = AdaptiveBatch(BatchPolicy(every=3, smallest=4, largest=32, step=4, fixed_until=0.5), comm)
    step = SimpleNamespace(compute_s=1.0 if comm.rank == slow and comm.size > 1 else 0.25, updates=1)
    assert controller(run, step) is None and controller(run, step) is None
    changes = controller(run, step)
    if comm.size == 1:
        assert changes is None, "one rank makes every update"
        return
    assert changes["batch_size"] == (20,) * slow + (12,)
    assert changes["measured"]["shares"] == controller.history[0]["shares"]
    assert controller.history[0]["shares"][slow] == pytest.approx(1 / (4 * slow + 1))


@pytest.mark.mpi(min_size=1)
def test_adaptive_batch_changes_every_ranks_sizes_alike_during_a_run(comm, shared_tmp):
    train = Recording(synthetic_dataset((1, 6, 6), 10, 2000, seed=0))
    test = synthetic_dataset((1, 6, 6), 10, 30, seed=1)
    cfg = run_config(
        shared_tmp,
        algorithm="ssgd",
        learners=1,
        batch_size=16,
        engine="sequential",
        adaptive_batch=True,
        adapt_every=2,
        batch_min=4,
        batch_max=32,
        batch_step=4,
        inject_imbalance=f"slow-rank:{comm.size - 1}:8" if comm.size > 1 else "",
    )
    result = Trainer(cfg, comm).fit(mlp, train, test)
    records = [json.loads(line) for line in (shared_tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    changes = [r["changes"]["batch_size"] for r in records if r.get("event") == "hyperparams"]
    assert (changes == []) == (comm.size == 1), changes
    assert all(4 <= b <= 32 for _, sizes in changes for b in sizes)
    training = [i for i in train.used if len(i) != 1][: result.iterations]
    used = [i for rank in comm.allgather_json(torch.cat(training).tolist()) for i in rank]
    assert len(used) == len(set(used)) > 2000 - comm.size * 32, "no sample twice, the epoch used up to one step"


@pytest.mark.slow
@pytest.mark.mpi(min_size=2)
def test_a_resumed_run_continues_the_adaptive_window_where_its_checkpoint_left_it(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 2000, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 30, seed=1)
    values = dict(algorithm="ssgd", learners=1, batch_size=16, adaptive_batch=True, adapt_every=5, batch_min=1)
    values.update(batch_max=64, batch_step=1, inject_imbalance=f"slow-rank:{comm.size - 1}:8", keep_checkpoints=50)
    Trainer(run_config(shared_tmp, checkpoint_every=3, **values), comm).fit(mlp, train, test)
    run_dir = shared_tmp / "run"
    if comm.rank == 0:
        for path in list_checkpoints(str(run_dir)):
            if path.name > "checkpoint-000000012.h5":
                path.unlink()
        with h5py.File(run_dir / "checkpoint-000000012.h5") as f:
            saved = [json.loads(f[f"ranks/{r}"].attrs["controllers"]) for r in range(comm.size)]
        assert all(state["steps"] == 12 % 5 and state["seconds"] > 0 for [state] in saved), saved
    comm.barrier()
    before = len(metrics_records(comm, run_dir))
    Trainer(run_config(shared_tmp, checkpoint_every=3, resume=True, **values), comm).fit(mlp, train, test)
    resumed = metrics_records(comm, run_dir)[before:]
    changed = [r["iteration"] for r in resumed if r.get("event") == "hyperparams"]
    assert changed and all(iteration % 5 == 0 for iteration in changed), f"windows restarted at resume: {changed}"


@pytest.mark.mpi(min_size=1)
def test_a_snapshot_keeps_per_rank_batch_sizes_unless_the_ranks_are_fewer_or_more(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 400, seed=0)
    run = Trainer(run_config(shared_tmp, learners=1, batch_size=8), comm).start(mlp, train)
    snapshot = run.state_dict()
    adapted = [4 + r for r in range(comm.size)]  # as JSON reads a tuple back
    run.load_state_dict({**snapshot, "hyperparams": {**snapshot["hyperparams"], "batch_size": adapted}})
    assert run.hp.batch_size == (tuple(adapted) if comm.size > 1 else (4,))
    assert run.sampler.indices(0, 0, 1, run.hp.batch_size).shape == (1, 4 + comm.rank)
    run.load_state_dict({**snapshot, "hyperparams": {**snapshot["hyperparams"], "batch_size": adapted * 2}})
    assert run.hp.batch_size == (tuple(adapted) if comm.size > 1 else (4,)), "sizes of another job size: kept"
