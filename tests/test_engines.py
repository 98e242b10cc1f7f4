"""Learner engines give the same bits, and `--learners auto` changes k consistently on every rank."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

from crossbow_mpi import Config, Trainer
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.data.prefetch import BatchPrefetcher, to_device
from crossbow_mpi.data.sampler import GlobalSampler, fetch_batch
from crossbow_mpi.replicas.engines import ENGINES
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.state import HyperParams

from helpers import self_comm
from reference import relative_error, sma_reference


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 10))


def mlp_bn_float64() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10)).double()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "extra",
    [{}, {"algorithm": "ssgd", "clip_grad_norm": 0.5}, {"clip_grad_norm": 0.5}, {"optimizer": "adamw"}],
)
def test_sequential_and_threads_engines_are_bit_identical(comm, shared_tmp, extra):
    """The threads engine's step runs on its workers with the learners' threads (each worker stepping its learners'
    rows, or the first all of them), the sequential engine's on the calling thread with all: the reductions (the
    sums over learners, the gradient norms of S-SGD's sum and SMA's rows) give the same bits."""
    train = synthetic_dataset((1, 6, 6), 10, 240 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 40, seed=1)
    results = {}
    for engine in ("sequential", "threads"):
        cfg = Config(
            **extra,
            run_dir=str(shared_tmp / engine),
            engine=engine,
            learners=3,
            batch_size=8,
            threads=2,
            epochs=2,
            eval_every=0,
            target_accuracy=0,
            seed=4,
            lr=0.05,
        )
        results[engine] = Trainer(cfg, comm).fit(convnet, train, test)
    assert torch.equal(results["sequential"].central, results["threads"].central)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_a_step_learner_by_learner_then_sync_is_the_step_of_all_learners_at_once(comm, algorithm):
    """What the stream engine runs (each learner's `local_step` on its stream, then `sync`) gives `step`'s bits."""
    states = []
    for by_learner in (False, True):
        torch.manual_seed(0)
        module = mlp_bn_float64()
        layout = FlatLayout(module)
        central = CentralModel(module, layout)
        learners = Learners(mlp_bn_float64, layout, central, 3)
        hp = HyperParams.from_config(Config(algorithm=algorithm, learners=3, weight_decay=0.01))
        step = ALGORITHMS[algorithm](hp, comm, central, learners)
        for iteration in range(3):
            generator = torch.Generator().manual_seed(comm.rank * 100 + iteration)
            learners.grads.copy_(torch.randn(learners.grads.shape, generator=generator, dtype=torch.float64))
            learners.buffers.add_(torch.rand(learners.buffers.shape, generator=generator, dtype=torch.float64))
            if by_learner:
                step.allocate_message()
                for j in range(learners.k):
                    step.local_step(slice(j, j + 1), 0.1)
                step.sync(0.1)
            else:
                step.step(0.1)
        states.append([central.z, central.u, *learners.state_dict().values()])
    for at_once, by_learner in zip(*states, strict=True):
        assert torch.equal(at_once, by_learner)


@pytest.mark.mpi(min_size=1)
def test_prefetcher_gives_each_learner_its_sampler_batch(comm):
    data = synthetic_dataset((1, 6, 6), 10, 96 * comm.size, seed=0)
    sampler = GlobalSampler(len(data), 5, comm.rank, comm.size)
    prefetcher = BatchPrefetcher(data, sampler, torch.device("cpu"), torch.float64)
    prefetcher.prefetch(1, 0, 3, 4)
    batches = prefetcher.batches(1, 0, 3, 4)
    assert len(batches) == 3
    for batch, row in zip(batches, sampler.indices(1, 0, 3, 4), strict=True):
        expected = to_device(fetch_batch(data, row), torch.device("cpu"), torch.float64)
        assert batch[0].dtype == torch.float64
        assert all(torch.equal(a, b) for a, b in zip(batch, expected, strict=True))


@pytest.mark.mpi(min_size=1)
def test_bf16_autocast_trains_while_z_stays_float32(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * 8 * comm.size, seed=0)
    cfg = Config(
        run_dir=str(shared_tmp / "bf16"),
        precision="bf16",
        learners=2,
        batch_size=8,
        epochs=3,
        eval_every=0,
        target_accuracy=0,
        seed=4,
        lr=0.05,
    )
    result = Trainer(cfg, comm).fit(convnet, train, train)
    assert result.central.dtype == torch.float32 and torch.isfinite(result.central).all()
    assert result.test_accuracy > 0.3


@pytest.mark.mpi(min_size=2)
def test_auto_learners_change_consistently_and_sma_equations_hold(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 4 * comm.size * 60, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 40, seed=1)
    cfg = Config(
        run_dir=str(shared_tmp / "auto"),
        learners="auto",
        autotune_interval=3,
        max_learners=4,
        autotune_threshold=0.0,
        batch_size=4,
        epochs=1,
        eval_every=0,
        target_accuracy=0,
        seed=9,
        lr=0.02,
        weight_decay=0.001,
    )
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)

    records = comm.bcast_json(
        [json.loads(line) for line in (shared_tmp / "auto" / "metrics.jsonl").read_text().splitlines()]
        if comm.rank == 0
        else None
    )
    decisions = [r for r in records if r.get("event") == "autotune"]
    assert decisions and decisions[0]["decision"] == "add" and decisions[0]["learners"] == 2
    assert all(r["decision"] in ("add", "remove", "stop") for r in decisions)
    assert records[-1]["event"] == "summary" and records[-1]["learners"] == result.learners
    assert comm.allgather_json(result.learners) == [result.learners] * comm.size

    learners_per_step, k = [], 1
    changes = {r["iteration"]: r["learners"] for r in decisions}
    for iteration in range(result.iterations):
        learners_per_step.append(k)
        k = changes.get(iteration + 1, k)
    reference = sma_reference(mlp_bn_float64, cfg, train, comm.size, learners_per_step)
    assert relative_error(result.central, reference) < 1e-6


@pytest.mark.mpi(min_size=1)
def test_the_threads_engine_runs_a_lone_learner_on_the_calling_thread(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    cfg = Config(run_dir=str(shared_tmp / "one"), engine="threads", learners=1, batch_size=8, threads=2, seed=4)
    run = Trainer(cfg, comm).start(convnet, train)
    run.train_step(0.05)
    assert not run.engine.workers, "a worker thread ran the only learner"
    run.resize(2)
    run.train_step(0.05)
    assert len(run.engine.workers) == 2
    run.engine.close()


@pytest.mark.mpi(min_size=1)
def test_the_threads_engines_calling_thread_computes_on_one_thread_and_its_workers_step(comm, shared_tmp):
    """A thread that ran an op on 2 threads leaves its OpenMP team spinning on a core the learners need: the calling
    thread fetches the batches on one thread, each learner's worker runs its row's `local_step`, and learner 0's
    runs `sync` and the check after it, all with the learners' threads."""
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    cfg = Config(run_dir=str(shared_tmp / "two"), engine="threads", learners=2, batch_size=8, threads=2, seed=4)
    run = Trainer(cfg, comm).start(convnet, train)
    seen: dict[str, list] = {}

    def spy(name, call):
        def spied(*args):
            seen.setdefault(name, []).append((threading.get_ident(), torch.get_num_threads(), *args[:1]))
            return call(*args)

        return spied

    run.prefetcher.batches = spy("batches", run.prefetcher.batches)
    run.algorithm.local_step = spy("local_step", run.algorithm.local_step)
    run.algorithm.sync = spy("sync", run.algorithm.sync)
    learner_step = run.engine.learner_step
    run.engine.learner_step = lambda ls, j, b: spy(f"learner {j}", learner_step)(ls, j, b)
    run.train_step(0.05)
    run.engine.after_sync(spy("check", run.central.z.sum))()
    run.engine.close()
    workers = [seen[f"learner {j}"][0][0] for j in range(2)]
    assert [call[:2] for call in seen["batches"]] == [(threading.get_ident(), 1)]
    assert sorted(seen["local_step"], key=lambda call: call[2].start) == [
        (workers[0], 1, slice(0, 1)),
        (workers[1], 1, slice(1, 2)),
    ]
    assert [call[:2] for call in seen["sync"] + seen["check"]] == [(workers[0], 1)] * 2
    assert len({threading.get_ident(), *workers}) == 3 and torch.get_num_threads() == 2


def test_the_threads_engine_runs_more_learners_than_threads_in_one_worker_per_thread(monkeypatch):
    """k = 4 learners on 2 threads run on 2 worker threads, 2 learners each in turn (not 4 busy threads on 2
    cores), with the sequential engine's gradients and losses."""
    torch.manual_seed(0)
    module = mlp_bn_float64()
    layout = FlatLayout(module)
    learners = Learners(mlp_bn_float64, layout, CentralModel(module, layout), 4)
    batches = [(torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 10, (4,))) for _ in range(4)]
    sequential = ENGINES["sequential"](nn.functional.cross_entropy, threads=2)
    expected = sequential.compute_gradients(learners, batches), learners.grads.clone()
    engine = ENGINES["threads"](nn.functional.cross_entropy, threads=2)
    ran: dict[int, int] = {}
    step = engine.learner_step
    monkeypatch.setattr(
        engine, "learner_step", lambda ls, j, b: (ran.setdefault(j, threading.get_ident()), step(ls, j, b))[1]
    )
    losses = engine.compute_gradients(learners, batches)
    engine.close()
    assert ran[0] == ran[1] and ran[2] == ran[3] and threading.get_ident() not in ran.values()
    assert torch.equal(losses, expected[0]) and torch.equal(learners.grads, expected[1])


class TiedAndUnused(nn.Module):
    """A model with a tied weight (one slot, used twice) and a trainable parameter the loss never reaches."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 3)
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.head(torch.tanh(self.embed(torch.tanh(self.embed(x)))))


def test_learners_take_fresh_gradients_into_their_rows_and_keep_none():
    torch.manual_seed(0)
    model = TiedAndUnused()
    layout = FlatLayout(model)
    learners = Learners(TiedAndUnused, layout, CentralModel(model, layout), 2)
    learners.grads.fill_(float("nan"))  # whatever a row held before is overwritten
    engine = ENGINES["threads"](nn.functional.cross_entropy, threads=2)
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(2)]
    engine.compute_gradients(learners, batches)
    engine.close()
    for j, (inputs, targets) in enumerate(batches):
        twin = TiedAndUnused()
        layout.load(twin, learners.weights[j], layout.extra_state_bytes(model))
        nn.functional.cross_entropy(twin(inputs), targets).backward()
        expected = [torch.zeros_like(p) if p.grad is None else p.grad for p in layout.trainable(twin)]
        assert torch.equal(learners.grads[j], torch.cat([g.reshape(-1) for g in expected]))
        assert all(p.grad is None for p in learners.modules[j].parameters()), "a learner kept autograd's gradients"
    unused = next(s for s in layout.param_slots if s.name == "unused")
    assert not learners.grads[:, unused.offset : unused.offset + unused.numel].any(), "the unused slot is not zero"


def test_s_sgd_learners_are_z_and_stage_their_gradients_where_autograd_leaves_them():
    """S-SGD's learners compute on z's own tensors with their own BatchNorm statistics, their gradients land in the
    sync message rows, one learner's row is the message; built afterwards, SMA gives each learner its own copy."""
    torch.manual_seed(0)
    module = mlp_bn_float64()
    layout = FlatLayout(module)
    central = CentralModel(module, layout)
    learners = Learners(mlp_bn_float64, layout, central, 2)
    hp = HyperParams.from_config(Config(algorithm="ssgd", learners=2))
    ssgd = ALGORITHMS["ssgd"](hp, self_comm(), central, learners)
    z_params = [view.data_ptr() for view in layout.param_views(central.z)]
    for j, learner in enumerate(learners.modules):
        assert [p.data_ptr() for p in layout.trainable(learner)] == z_params
        assert learner[2].running_mean.data_ptr() == learners.buffers[j].data_ptr(), "statistics are the learner's"
    unallocated = learners.weights.shape[1] + learners.momentum.shape[1]
    assert unallocated == layout.num_state - layout.num_params, "the learners hold their float buffers alone"
    engine = ENGINES["sequential"](nn.functional.cross_entropy, threads=1)
    batches = [(torch.randn(8, 1, 6, 6, dtype=torch.float64), torch.randint(0, 10, (8,))) for _ in range(2)]
    engine.compute_gradients(learners, batches)
    gradients = learners.grads.clone()
    engine.local_step(ssgd, 0.1)
    assert ssgd.staged is learners.staging and torch.equal(ssgd.staged[:, : layout.num_params], gradients)
    z = central.z.clone()
    engine.sync(ssgd, 0.1)
    assert not torch.equal(central.z, z), "the step moved z"
    weights = learners.state_dict()["weights"]
    assert torch.equal(weights, central.z.expand_as(weights)), "every learner is z after the sync"

    learners.resize(1, central.z)
    engine.compute_gradients(learners, batches[:1])
    engine.local_step(ssgd, 0.1)
    assert ssgd.message.data_ptr() == ssgd.staged.data_ptr(), "one learner's row is the message"
    engine.sync(ssgd, 0.1)
    weights = learners.state_dict()["weights"]

    ALGORITHMS["sma"](hp, self_comm(), central, learners)
    assert not learners.shares_z and torch.equal(learners.weights[0], central.z)
    learners.params.add_(1.0)
    assert torch.equal(layout.trainable(learners.modules[0])[0].reshape(-1)[:3], learners.params[0, :3])
    assert torch.equal(central.z, weights[0]), "a learner of its own leaves z alone"


def test_engines_set_the_thread_count_only_when_it_changes(monkeypatch):
    """A call of torch.set_num_threads, even with the current count, slowed the next forward and backward pass by
    50–140 µs (LeNet, b = 16): a step with an unchanged count makes none."""
    torch.manual_seed(0)
    module = mlp_bn_float64()
    layout = FlatLayout(module)
    learners = Learners(mlp_bn_float64, layout, CentralModel(module, layout), 1)
    engine = ENGINES["sequential"](nn.functional.cross_entropy, threads=torch.get_num_threads())
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    engine.compute_gradients(learners, [(torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 10, (4,)))])
    assert calls == []
