"""`--algorithm auto`: timed probes of sma, ssgd, eager and omnivore from one snapshot, successive halving between
them, training to the end with the choice, re-checks among the algorithms, a resume that keeps the choice and the
optimizer's time share (bad input: in test_omnivore)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from types import SimpleNamespace

import h5py
import pytest
import torch

from crossbow_mpi import Trainer
from crossbow_mpi.control.omnivore_search import AUTO_ALGORITHMS, OmnivoreOptimizer, dominates, grid
from crossbow_mpi.training.checkpoint import list_checkpoints

from helpers import STEPS, datasets, lockstep, metrics_records, mlp_bn, run_config


def auto_run(comm, shared_tmp, **overrides) -> tuple:
    """Train with `--algorithm auto`; return the result and every metrics record."""
    train, test = datasets(comm.size, 1)
    values = dict(algorithm="auto", learners=1, probe_seconds=0.01, round_samples=lockstep(comm, 1))
    cfg = run_config(shared_tmp, **{**values, **overrides})
    started = time.perf_counter()
    result = Trainer(cfg, comm).fit(mlp_bn, train, test)
    wall_s = time.perf_counter() - started
    records = metrics_records(comm, shared_tmp / "run")
    assert records[-1]["time_s"] <= comm.bcast_json(wall_s), "the search's seconds count once"
    return result, records


def probed(comm) -> set[str]:
    """Return the algorithms auto probes: with one rank eager-SGD is S-SGD; Omnivore needs two groups or more."""
    fits = {"eager": comm.size > 1, "omnivore": comm.size % 2 == 0}
    return {name for name in AUTO_ALGORITHMS if fits.get(name, True)}


@pytest.mark.mpi(min_size=1)
def test_auto_probes_every_algorithm_then_trains_to_the_end_with_the_best(comm, shared_tmp):
    threads = threading.active_count()
    result, records = auto_run(comm, shared_tmp)
    assert result.iterations == STEPS, "training starts from the snapshot the probes started from"
    probes = [r for r in records if r.get("decision") == "probe"]
    [choice] = [r for r in records if r.get("decision") == "choice"]
    assert {p["algorithm"] for p in probes} == probed(comm) and choice["probes"] == len(probes)
    assert all(p["groups"] > 1 for p in probes if p["algorithm"] == "omnivore")
    selectable = [p for p in probes if p["groups"] not in choice["excluded_groups"]]
    best = min(selectable, key=lambda p: float("inf") if p["score"] is None else p["score"])
    keys = ("algorithm", "groups", "momentum", "lr", "score")
    assert {k: choice[k] for k in keys} == {k: best[k] for k in keys}
    [survivor] = probed(comm) - set(choice["eliminated"])
    late = survivor == "omnivore" and choice["excluded_groups"]  # its groups missed the speedup after winning
    assert survivor == choice["algorithm"] or late, "halving leaves one algorithm, the choice's"
    summary = records[-1]
    assert summary["event"] == "summary" and summary["algorithm"] == choice["algorithm"]
    assert summary["optimizer_s"] == choice["search_s"] and 0 < summary["optimizer_share"] <= 1
    assert threading.active_count() == threads, "the transports switched away from left no thread"


@pytest.mark.slow
@pytest.mark.mpi(min_size=1)
def test_auto_rechecks_every_algorithm_every_optimizer_epoch(comm, shared_tmp):
    _, records = auto_run(comm, shared_tmp, optimizer_epoch=1e-6)  # due at once: a vote STOP_LAG steps on
    records = [r for r in records if r.get("event") == "optimizer"]
    decisions = [i for i, r in enumerate(records) if r["decision"] != "probe"]
    assert [records[i]["decision"] for i in decisions[:2]] == ["choice", "retune"]
    for before, after in itertools.pairwise(decisions):
        current, probes = records[before], records[before + 1 : after]
        assert {p["algorithm"] for p in probes} == probed(comm)
        own = {(p["momentum"], p["lr"]) for p in probes if p["algorithm"] == current["algorithm"]}
        points = grid(current["momentum"], current["lr"], [])
        diverged = [(p["momentum"], p["lr"]) for p in probes if p["score"] is None]
        assert {point for point in points if not dominates(point, diverged)} <= own <= set(points), "the pruned grid"


@pytest.mark.mpi(min_size=1)
def test_a_resumed_auto_run_keeps_its_choice(comm, shared_tmp):
    first, records = auto_run(comm, shared_tmp, checkpoint_every=5, eval_every=0)
    [choice] = [r for r in records if r.get("decision") == "choice"]
    saved = None
    if comm.rank == 0:
        with h5py.File(list_checkpoints(shared_tmp / "run")[-1]) as f:
            saved = {"choice": json.loads(f["train"].attrs["choice"]), "z": f["central/z"][...].tolist()}
    saved = comm.bcast_json(saved)
    assert saved["choice"] == {k: choice[k] for k in ("algorithm", "groups")}

    train, test = datasets(comm.size, 1)
    resumed = run_config(
        shared_tmp,
        algorithm="auto",
        learners=1,
        probe_seconds=0.01,
        round_samples=lockstep(comm, 1),
        epochs=2,
        resume=True,
    )
    result = Trainer(resumed, comm).fit(mlp_bn, train, test)
    records = metrics_records(comm, shared_tmp / "run")
    assert [r["decision"] for r in records if r.get("event") == "optimizer"].count("choice") == 1, "no new search"
    assert records[-1]["algorithm"] == choice["algorithm"] and records[-1]["optimizer_s"] == choice["search_s"]
    assert result.iterations > first.iterations and torch.isfinite(result.central).all()


class FakeAuto(OmnivoreOptimizer):
    """`--algorithm auto`'s cold start over a table of probe scores {(algorithm, g, μ, η): score} (5 elsewhere) and
    seconds per sample {g: seconds} (1 elsewhere), with `--lr` 0.1."""

    def __init__(self, world_size, results, speeds=()):
        self.results, self.speeds, self.auto, self.buffer = results, dict(speeds), True, 1.0
        self.probes, self.excluded, self.eliminated = [], set(), {}
        self.config, self.world = SimpleNamespace(lr=0.1), SimpleNamespace(size=world_size)

    def probe(self, snapshot, algorithm, groups, momentum, lr):
        score = self.results.get((algorithm, groups, momentum, lr), 5.0)
        record = {"algorithm": algorithm, "groups": groups, "momentum": momentum, "lr": lr, "score": score}
        self.probes.append({**record, "s_per_sample": self.speeds.get(groups, 1.0)})
        return self.probes[-1]

    def count(self, algorithm):
        return sum(p["algorithm"] == algorithm for p in self.probes)


def test_successive_halving_drops_the_worse_half_each_rung_then_finishes_the_winners_search():
    scores = {("sma", 1, 0.9, 0.1): 4.0, ("ssgd", 1, 0.9, 0.1): 2.0, ("eager", 1, 0.9, 0.1): 3.0}
    scores |= {("omnivore", 2, 0.0, 0.1): 1.0, ("ssgd", 1, 0.9, 1.0): 0.5}
    search = FakeAuto(4, scores, {2: 0.5, 4: 0.25})
    search._halving({})
    first = [(p["algorithm"], p["groups"], p["momentum"], p["lr"]) for p in search.probes[:4]]
    assert first == [(name, 1, 0.9, 0.1) for name in AUTO_ALGORITHMS[:3]] + [("omnivore", 2, 0.0, 0.1)]
    assert search.eliminated == {"eager": 0, "sma": 0, "omnivore": 1}, "rung 0: 1 probe each; rung 1: 2 each"
    assert [search.count(name) for name in AUTO_ALGORITHMS] == [1, 4, 1, 3], "the winner's learning rates to the end"
    assert (search.best()["algorithm"], search.best()["lr"]) == ("ssgd", 1.0)


def test_halving_ranks_an_omnivore_that_missed_the_speedup_last_and_one_rank_halves_once():
    slow = FakeAuto(4, {("omnivore", 2, 0.0, 0.1): 0.1}, {2: 0.95})
    slow._halving({})
    assert slow.excluded == {2} and slow.count("omnivore") == 1 and slow.eliminated["omnivore"] == 0
    assert slow.best()["algorithm"] != "omnivore", "its lowest score does not count: g = 2 is not 10 % faster"
    single = FakeAuto(1, {("sma", 1, 0.9, 0.1): 1.0})
    single._halving({})
    assert single.eliminated == {"ssgd": 0} and [single.count(name) for name in ("sma", "ssgd")] == [4, 1]
