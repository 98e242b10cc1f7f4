"""Every benchmark's quick mode runs and writes well-formed results (never checks speeds)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import REPO

COLUMNS = {
    "faults": {"fault_at", "path", "reached", "wall_s", "lost_s", "regain_s", "recovery_s", "step_ms"},
    "tta": {"layout", "phase", "role", "system", "k", "alpha", "b", "lr", "reached", "tta_s", "min", "max"}
    | {"epochs", "samples_per_s", "vs_ddp_best", "vs_ddp_same"},
    "stat_efficiency": {"phase", "algorithm", "aggregate", "k", "b", "lr", "alpha_rule", "alpha", "reached", "epochs"}
    | {"min", "max", "vs_ssgd", "accuracy", "tta_s"},
    "throughput": {"layout", "system", "samples_per_s", "vs_ddp"},
    "sync_cost": {
        "ranks",
        "model",
        "floats",
        "sma_step_us",
        "fused_step_us",
        "allreduce_us",
        "ratio",
        "memory_ratio",
        "peer_ratio",
    },
    "overhead": {"threads", "b", "crossbow_samples_per_s", "pytorch_samples_per_s", "crossbow_vs_pytorch"},
    "hw_limit": {
        "model",
        "config",
        "flops_per_sample",
        "samples_per_s",
        "achieved_gflops",
        "matmul_gflops",
        "fraction",
    },
    "memory": {"model", "algorithm", "b", "one_learner_bytes", "vs_bare", "added_learner_bytes", "vs_minimum"},
    "hybrid": {"model", "variant", "reached", "tta_s", "samples_per_s", "vs_dp"},
    "slow_link": {"link", "variant", "reached", "tta_s", "accuracy", "comm_bytes_per_sample", "vs_sma", "fewer_bytes"}
    | {"vs_local_sgd", "vs_torchft"},
    "tcp_links": {"link", "tcp_links", "allreduce_s", "link_share", "per_step_samples_per_s", "per_step_vs_one"}
    | {"h16_samples_per_s", "h16_vs_one", "rd_s", "rd_share", "socket_s", "socket_share"},
    "pair_sum": {"link", "size", "floats", "mpi_s", "rd_s", "pair_s", "pair_vs_mpi", "link_share", "same_bits"}
    | {"per_step_samples_per_s"},
    "lm": {"layout", "phase", "system", "k", "lr", "reached", "tta_s", "min", "max", "loss", "samples_per_s", "vs_ddp"},
    "eager_inherent": {"algorithm", "lr", "reached", "tta_s", "speedup", "samples_speedup", "ideal_speedup"}
    | {"eager_wait_ms"},
    "omnivore": {"imbalance", "algorithm", "reached", "tta_s", "speedup", "vs_best", "groups", "momentum", "lr"},
    "hetero": {
        "slowdown",
        "algorithm",
        "lr",
        "reached",
        "tta_s",
        "tta_min_s",
        "tta_max_s",
        "speedup",
        "samples_per_s",
        "bound_share",
        "settle_epochs",
        "update_balance",
    },
}
RECORD_KEYS = {
    "benchmark",
    "question",
    "quick",
    "reps",
    "date",
    "wall_s",
    "command",
    "machine",
    "load_average",
    "settings",
    "columns",
    "rows",
    "runs",
    "files",
    "code",
    "missing",
    "points",
    "goals",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", COLUMNS)
def test_quick_mode_writes_results(name, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails; a quick run took 83 s alone and over 150 s beside another test on 2 slow cores
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result.keys() >= RECORD_KEYS
    assert result["benchmark"] == name and result["quick"] is True and result["runs"] and not result["missing"]
    assert result["rows"] and all(COLUMNS[name] <= row.keys() for row in result["rows"])
    assert COLUMNS[name] <= set(result["columns"])
    table = done.stdout.rstrip().splitlines()[-len(result["rows"]) - 2 :]
    assert table[0].split() == result["columns"], "the table is not the last thing printed"
    if name == "stat_efficiency":
        assert (tmp_path / "stat_efficiency.png").stat().st_size > 0
    if name == "pair_sum":
        assert all(row["same_bits"] for row in result["rows"]), "the pair exchange's sum differs from MPI's"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.results_md",
            "--results",
            str(tmp_path),
            "--output",
            str(tmp_path / "RESULTS.md"),
        ],
        cwd=REPO,
        timeout=60,
        check=True,
    )
    rendered = (tmp_path / "RESULTS.md").read_text()
    assert f"## {name}" in rendered and "| " + " | ".join(result["columns"]) + " |" in rendered


def test_results_md_renders_the_stored_reports_and_leaves_out_the_gpu_self_tests(tmp_path):
    """benchmarks/results holds the GPU self-test's JSON beside the reports; it has no report's keys."""
    from benchmarks.results_md import render

    results = REPO / "benchmarks" / "results"
    assert (results / "gpu_selftest.json").exists()
    rendered = render(results, tmp_path / "RESULTS.md")
    assert "## hetero" in rendered and "## gpu_selftest" not in rendered


def fake_jobs(monkeypatch, outcomes: list[int]):
    """Make harness.mpirun exit with each of `outcomes` in turn, writing a run's metrics when it exits 0."""
    from benchmarks import harness

    calls = []

    def mpirun(ranks, args, timeout, env=None, wrap=None):
        calls.append(args)
        code = outcomes[len(calls) - 1]
        if code:
            raise harness.BenchmarkError(f"exited {code}: terminate called", code, hung=code == harness.TIMED_OUT)
        run_dir = args[args.index("--run-dir") + 1]
        records = [
            {"test_accuracy": 0.99, "samples_per_s": 100.0},
            {
                "event": "summary",
                "reached": True,
                "time_to_target_s": 5.0,
                "epochs": 1.0,
                "final_test_accuracy": 0.99,
            },
        ]
        with open(f"{run_dir}/metrics.jsonl", "w") as fh:
            fh.writelines(json.dumps(record) + "\n" for record in records)
        return ""

    monkeypatch.setattr(harness, "mpirun", mpirun)
    return harness, calls


def test_a_crashed_training_job_runs_again_and_the_crash_is_kept(monkeypatch):
    harness, calls = fake_jobs(monkeypatch, [134, 0])
    result = harness.train("ddp", 2, {"seed": 1}, timeout=10)
    assert len(calls) == 2 and result["reached"] and result["tta_s"] == 5.0
    assert len(result["crashes"]) == 1 and "terminate called" in result["crashes"][0]


def test_a_job_that_crashes_every_time_fails_the_benchmark_and_divergence_is_a_result(monkeypatch):
    harness, calls = fake_jobs(monkeypatch, [134, 134])
    with pytest.raises(harness.BenchmarkError, match="terminate called"):
        harness.train("ddp", 2, {"seed": 1}, timeout=10)
    from crossbow_mpi.train import EXIT_DIVERGED

    harness, calls = fake_jobs(monkeypatch, [EXIT_DIVERGED])
    assert harness.train("crossbow", 2, {"seed": 1}, timeout=10)["diverged"] and len(calls) == 1


def test_a_job_that_hangs_fails_the_benchmark_at_once(monkeypatch):
    """A hang is a defect, not a transient crash: running it again would cost its whole timeout again."""
    from benchmarks import harness

    with pytest.raises(harness.BenchmarkError, match="hung past 2 s") as err:
        harness.mpirun(1, ["-c", "import time; time.sleep(60)"], timeout=2)
    assert err.value.hung
    harness, calls = fake_jobs(monkeypatch, [harness.TIMED_OUT, 0])
    with pytest.raises(harness.BenchmarkError):
        harness.train("crossbow", 2, {"seed": 1}, timeout=10)
    assert len(calls) == 1


def test_a_runs_adaptive_batch_sizes_are_kept_and_other_changes_are_not():
    from benchmarks.harness import adapted_batch_sizes

    records = [
        {"event": "hyperparams", "time_s": 1.0, "changes": {"lr": [0.1, 0.2]}},
        {"event": "hyperparams", "time_s": 2.0, "changes": {"batch_size": [[64, 64], [80, 48]]}},
        {"epoch": 0.1, "test_accuracy": 0.5, "samples_per_s": 10.0},
        {"event": "hyperparams", "time_s": 3.0, "changes": {"batch_size": [[80, 48], [84, 44]]}},
    ]
    assert adapted_batch_sizes(records) == [[2.0, [80, 48]], [3.0, [84, 44]]]
    assert adapted_batch_sizes(records[:1]) == []


def test_batch_sizes_that_move_at_every_step_are_kept_once_a_second_with_the_count():
    from benchmarks.harness import batch_sizes

    changes = [[0.5, [80, 48]], [0.6, [84, 44]], [1.4, [85, 43]], [1.6, [84, 44]], [2.7, [85, 43]]]
    kept = batch_sizes(changes)
    assert kept["batch_changes"] == 5
    assert kept["batch_sizes"] == [[0.5, [80, 48]], [1.5, [85, 43]], [2.5, [84, 44]], [2.7, [85, 43]]]
    assert batch_sizes([]) == {} and batch_sizes(changes[:1])["batch_sizes"] == changes[:1]


def fake_training(clock: list[float], seconds: float = 60.0):
    """A runner for harness.PointStore that trains nothing: each call takes `seconds` of the fake `clock`, and a
    point's time to the target follows from its flags (over its time limit: not reached)."""
    calls = []

    def runner(trainer, ranks, flags, timeout):
        calls.append((trainer, ranks, flags))
        clock[0] += seconds
        tta_s = 10 + 1000 * flags.get("lr", 0) + 3 * flags["seed"] + len(trainer + str(flags.get("learners")))
        reached = tta_s <= flags.get("time_limit", float("inf"))
        return {
            "reached": reached,
            "tta_s": tta_s if reached else None,
            "epochs": 1.0 if reached else None,
            "final_accuracy": 0.99 if reached else 0.5,
            "samples_per_s": 100.0 * ranks,
        }

    return runner, calls


def test_the_point_store_skips_finished_runs_and_a_budget_stops_before_a_run_it_cannot_hold(tmp_path):
    from benchmarks import harness

    clock = [0.0]
    runner, calls = fake_training(clock)

    def chunk(budget_s):
        store = harness.PointStore(tmp_path / "b.points.jsonl", "b", budget_s, runner, lambda: clock[0])
        variants = {f"v{lr}": store.seeded("grid", "crossbow", 2, {"lr": lr}, timeout=100) for lr in range(5)}
        return harness.interleave(variants, 2, quiet=True)

    first = chunk(150)  # the first run fits by its timeout (100 s), the second by the first's 60 s, not a third
    assert [(run["variant"], run["rep"]) for run in first] == [("v0", 0), ("v1", 0)] and len(calls) == 2
    second = chunk(150)
    assert [flags["lr"] for _, _, flags in calls[2:]] == [2, 3] and len(second) == 4
    whole = chunk(None)
    assert len(calls) == 10 and [run["variant"] for run in whole] == [f"v{lr}" for lr in range(5)] * 2
    assert [run["rep"] for run in whole] == [0] * 5 + [1] * 5 and whole[:4] == second
    record = json.loads((tmp_path / "b.points.jsonl").read_text().splitlines()[0])
    assert record["flags"] == {"lr": 0} and record["seed"] == 1 and record["wall_s"] == 60
    assert {"date", "code", "machine", "load_average", "result"} <= record.keys()


def test_the_point_store_says_which_machine_measured_each_run_and_the_report_names_them_all(tmp_path):
    """A benchmark run in chunks may span machines; records older than the field count as not recorded."""
    from benchmarks import harness
    from benchmarks.results_md import stored_runs

    clock = [0.0]
    runner, _ = fake_training(clock)
    path = tmp_path / "m.points.jsonl"
    harness.PointStore(path, "m", None, runner, lambda: clock[0]).train("p", "crossbow", 2, {"lr": 1}, 1, 100)
    old = json.loads(path.read_text())
    path.write_text(path.read_text() + json.dumps({**old, "seed": 2, "machine": None}) + "\n")
    store = harness.PointStore(path, "m", None, runner, lambda: clock[0])
    assert store.train("p", "crossbow", 2, {"lr": 1}, 1, 100)["measured"]["machine"] == harness.machine()
    here = harness.machine_label(harness.machine())
    points = store.provenance()
    assert points["machines"] == {here: 1, "not recorded": 1}
    assert f"{here} (1); not recorded (1)" in stored_runs(points)[0] and stored_runs({"runs": 0}) == []


def test_the_point_store_starts_runs_only_in_the_phases_it_is_given_and_answers_the_others_from_its_file(tmp_path):
    from benchmarks import harness

    clock = [0.0]
    runner, calls = fake_training(clock)
    path = tmp_path / "p.points.jsonl"
    harness.PointStore(path, "p", None, runner, lambda: clock[0]).train("slow", "crossbow", 2, {"lr": 1}, 1, 100)
    store = harness.PointStore(path, "p", None, runner, lambda: clock[0], phases=frozenset({"fast"}))
    assert store.train("slow", "crossbow", 2, {"lr": 2}, 1, 100) is None and len(calls) == 1
    assert store.train("slow", "crossbow", 2, {"lr": 1}, 1, 100)["reached"]
    assert store.train("fast", "crossbow", 2, {"lr": 2}, 1, 100) is not None and len(calls) == 2
    assert store.asked == {"slow", "fast"} and not store.exhausted


@pytest.mark.parametrize(
    "name, first_missing, limit",
    [
        ("tta", ["grid 2/8 runs", "finalists and throughput not started"], "time_limit"),
        ("stat_efficiency", ["grid 2/4 runs", "finalists not started"], "epochs"),
    ],
)
def test_a_benchmark_in_chunks_says_what_is_missing_and_ends_as_one_long_run(
    name, first_missing, limit, tmp_path, monkeypatch
):
    import dataclasses
    import importlib

    from benchmarks import harness

    benchmark = importlib.import_module(f"benchmarks.{name}")
    quick = dataclasses.replace(benchmark.QUICK, lrs_at_16=(0.01, 0.02))
    if name == "tta":
        quick = dataclasses.replace(quick, compiled=("ddp", "ssgd"))
    monkeypatch.setattr(benchmark, "QUICK", quick)
    clock = [0.0]

    def run(path, budget_s):
        runner, calls = fake_training(clock)
        store = harness.PointStore(path, name, budget_s, runner, lambda: clock[0])
        return benchmark.measure(harness.Options(name, True, tmp_path, 2, store)), calls

    whole, whole_calls = run(tmp_path / "whole.jsonl", None)
    assert not whole.missing and len({flags.get(limit) for _, _, flags in whole_calls}) > 1, "nothing was pruned"
    partial, calls = run(tmp_path / "chunks.jsonl", 150)
    assert partial.missing == first_missing and not partial.settings["finalists"]
    chunks = 1
    while partial.missing:
        partial, more = run(tmp_path / "chunks.jsonl", 300)
        calls += more
        chunks += 1
    assert chunks >= 3 and calls == whole_calls and partial.rows == whole.rows
    if name == "tta":
        compiled = [row for row in whole.rows if row["role"] == "compiled"]
        assert sorted(row["system"] for row in compiled) == ["ddp", "ssgd"]
        assert sum(1 for _, _, flags in whole_calls if flags.get("compile")) == 2 * 2, "2 systems × 2 seeds"


def test_the_faults_benchmark_runs_in_chunks_with_one_checkpoint_interval_and_kills_at_the_baselines_share(
    tmp_path,
):
    """Every run, the fault-free one included, checkpoints at the same interval: the fault-free run's used to come
    from its own length, unknown when it started, so it checkpointed at every iteration."""
    from benchmarks import faults, harness

    clock, calls = [0.0], []

    def runner(path, ranks, flags, timeout):
        calls.append((path, flags))
        clock[0] += 60
        wall = {"none": 100.0, "ulfm": 110.0, "restart": 120.0}[path] + flags["seed"]
        recovery = 0.1 if path == "ulfm" else None
        regain = {"none": None, "ulfm": 0.5, "restart": 8.0 - flags["seed"]}[path]
        result = {"reached": True, "tta_s": wall - 5, "wall_s": wall, "iterations": 40, "recovery_s": recovery}
        return {"path": path, "fault_at": flags.get("fault_at"), **result, "regain_s": regain}

    def chunk(budget_s):
        store = harness.PointStore(tmp_path / "faults.jsonl", "faults", budget_s, runner, lambda: clock[0])
        return faults.measure(harness.Options("faults", True, tmp_path, 2, store))

    assert chunk(150).missing == ["faults 2/6 runs"]
    assert chunk(400).missing == []
    whole = chunk(None)
    assert len(calls) == 6 and {flags["checkpoint_every"] for _, flags in calls} == {faults.QUICK["checkpoint_every"]}
    assert [(path, flags.get("kill_at")) for path, flags in calls[:3]] == [
        ("none", None),
        ("ulfm", 20),
        ("restart", 20),
    ]
    assert [(row["path"], row["lost_s"]) for row in whole.rows] == [("none", None), ("ulfm", 10.0), ("restart", 20.0)]
    assert [row["regain_s"] for row in whole.rows] == [None, 0.5, 6.5]
    assert whole.goals["recovery"]["met"] and whole.goals["regain below restart"] == {
        "pairs": 2,
        "ulfm_ahead": 2,
        "met": True,
    }


def test_a_faults_regain_runs_from_the_kill_to_the_first_step_back_at_its_samples_and_misses_without_stamps():
    from benchmarks import faults

    ulfm = [(9, 80, 100.0), (10, 90, 101.0), (10, 90, 101.7), (11, 100, 101.8)]  # step 10 dropped, taken again
    restart = [(9, 80, 100.0), (10, 90, 101.0), (6, 50, 110.0), (7, 56, 110.5), (12, 86, 113.0), (13, 92, 113.5)]
    assert faults.regain_s(ulfm, 10) == pytest.approx(0.7)
    assert faults.regain_s(restart, 10) == pytest.approx(12.5)
    assert faults.regain_s(restart[:5], 10) is None and faults.regain_s(ulfm, 20) is None
    assert faults.step_ms(ulfm, 10) == pytest.approx(1000) and faults.step_ms(ulfm, None) == pytest.approx(900)
    assert faults.step_ms(ulfm[:1], None) is None
    pair = [{"seed": 1, "fault_at": 0.5, "path": "ulfm", "recovery_s": 0.1, "regain_s": 9.0}]
    pair.append({"seed": 1, "fault_at": 0.5, "path": "restart", "recovery_s": None, "regain_s": 6.0})
    found = faults.goals(pair)
    assert found["recovery"]["met"] is False and found["regain below restart"]["met"] is False


def fake_slow_links(clock: list[float], calls: list, seconds: float):
    """A runner for slow_link's point store: each call takes `seconds` of the fake `clock` and launches over the
    link it is given; local steps pay off (nesterov 100 s, central 200 s, per-step SMA 300 s), local SGD is
    faster than SMA at H = 4 only, the bytes per sample fall with H and the payload's width, and SMA nesterov
    fp32 diverges at H = 4."""

    def runner(trainer, ranks, flags, timeout, wrap=None, env=None):
        calls.append((trainer, flags, timeout))
        if wrap is not None:
            wrap(["mpirun", "-n", str(ranks), "--oversubscribe", "python"])
        clock[0] += seconds
        h = flags.get("sync_every") or flags.get("local_sgd_every") or flags.get("diloco_every") or 1
        width = {"fp32": 1, "bf16": 2, "int8": 4}[flags.get("sync_dtype", "fp32")]
        if trainer == "crossbow" and h == 4 and flags["outer_optimizer"] == "nesterov" and width == 1:
            return {"reached": False, "tta_s": None, "epochs": None, "diverged": True}  # as harness.train gives it
        if trainer == "crossbow":
            tta_s = 300 if h == 1 else 100 if flags["outer_optimizer"] == "nesterov" else 200
        else:
            tta_s = 50 if h == 4 else 150
        result = {"reached": True, "tta_s": tta_s, "epochs": 1.0, "final_accuracy": 0.99, "samples_per_s": 100.0}
        return {**result, "comm_bytes_per_sample": 1024 / h / width}

    return runner


def test_the_slow_link_grid_runs_in_chunks_every_links_goal_variants_first_and_computes_the_goals(
    tmp_path, monkeypatch
):
    from benchmarks import harness, slow_link
    from crossbow_mpi.algorithms import ALGORITHMS
    from crossbow_mpi.config import Config

    scripts = []
    monkeypatch.setattr(slow_link.Link, "script", lambda self, *args: scripts.append(args[:1] + args[3:]))
    monkeypatch.setattr(slow_link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slow_link.shutil, "which", lambda name: f"/usr/sbin/{name}")
    clock, calls = [0.0], []
    runner = fake_slow_links(clock, calls, 600)

    def run(budget_s):
        store = harness.PointStore(tmp_path / "s.jsonl", "slow_link", budget_s, runner, lambda: clock[0])
        return slow_link.measure(harness.Options("slow_link", False, tmp_path, 3, store))

    every = slow_link.variants(slow_link.FULL)
    first = [name for name in every if name in slow_link.FULL.first]
    assert len(first) == len(slow_link.GOAL_VARIANTS) - (not slow_link.TORCHFT) and list(every)[: len(first)] == first
    averaged = every["sma H=4 average int8"].flags
    assert (averaged["outer_optimizer"], averaged["outer_lr"], averaged["outer_momentum"]) == ("sgd", 1.0, 0.0)
    assert [name for name in every if "delay" in name] == [f"sma H={h} nesterov fp32 F=4 delay=1" for h in (16, 64)]
    for variant in (variant for variant in every.values() if variant.trainer == "crossbow"):
        Config.from_dict({**slow_link.FLAGS, **variant.flags}).validate(ALGORITHMS)  # the trainer takes it
    keys = {key for variant in every.values() for key in variant.flags}

    def names(made: list) -> list[str]:
        projected = [{key: flags[key] for key in keys & flags.keys()} for _, flags, _ in made]
        return [next(name for name, variant in every.items() if variant.flags == flags) for flags in projected]

    partial = run(2400)  # the first run fits by its timeout (2400 s), then 3 more by its 600 s
    assert names(calls) == first[:4]
    assert partial.missing[0] == f"100mbit goal variants 4/{len(first) * 3} runs" and len(partial.missing) == 6
    assert scripts == [("up", slow_link.SUBNET), ("rate", "100mbit"), ("down",)]
    assert partial.goals["time"]["met"] is None and partial.goals["peers H=16"]["met"] is None, "per-step SMA last"
    scripts.clear()
    whole = run(None)
    assert not whole.missing and len(calls) == len(every) * 3 * 3
    assert all(flags["time_limit"] == 1800 and timeout == 2400 for _, flags, timeout in calls)
    assert all(flags["hierarchy"] == "flat" for trainer, flags, _ in calls if trainer == "crossbow")
    rates = slow_link.FULL.rates
    stages = (first, [name for name in every if name not in first])
    order = [name for stage in stages for _ in rates for _ in range(3) for name in stage]
    assert names(calls) == order, "every link's goal variants first, 3 seeds interleaved, then the rest"
    assert [args for args in scripts if args[0] == "rate"] == [("rate", rate) for _ in stages for rate in rates]
    goals = whole.goals
    assert goals["time"]["vs_sma"] == 3 and goals["time"]["met"] is True
    assert goals["bytes"]["fewer_bytes"] == 256 and goals["bytes"]["variant"].startswith("sma H=64")
    assert goals["peers H=4"]["met"] is False and goals["peers H=16"]["met"] is True
    assert goals["peers H=16"]["local-sgd H=16"] == 150 and goals["peers H=16"]["tta_s"] == 100
    sma_16 = next(row for row in whole.rows if row["link"] == "100mbit" and row["variant"] == "sma H=16 central bf16")
    assert sma_16["vs_local_sgd"] == 0.75 and sma_16["vs_sma"] == 1.5 and sma_16["fewer_bytes"] == 32
    diverged = next(row for row in whole.rows if row["variant"] == "sma H=4 nesterov fp32")
    assert diverged["reached"] == "0/3" and diverged["comm_bytes_per_sample"] is diverged["fewer_bytes"] is None
    scripts.clear()
    again = run(None)
    assert again.rows == whole.rows and len(calls) == len(every) * 9 and not scripts, "every run is stored"


def test_tcp_links_launches_over_the_nodes_with_n_connections_and_bounds_by_the_rate(tmp_path, monkeypatch):
    from benchmarks import slow_link, tcp_links

    scripts = []
    monkeypatch.setattr(slow_link.Link, "script", lambda self, *args: scripts.append(args[:1] + args[3:]))
    monkeypatch.setattr(slow_link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slow_link.shutil, "which", lambda name: f"/usr/sbin/{name}")
    assert tcp_links.launch(None, 2) == {"wrap": None, "env": {"OMPI_MCA_btl_tcp_links": "2"}}
    held = tcp_links.launch(None, 1, tcp_links.RECURSIVE_DOUBLING)["env"]
    assert held["OMPI_MCA_btl_tcp_links"] == "1" and held["OMPI_MCA_coll_tuned_allreduce_algorithm"] == "3"
    link = slow_link.Link("10mbit", tmp_path)
    launched = tcp_links.launch(link, 1)
    assert launched["env"] == {"OMPI_MCA_btl_tcp_links": "1"} and not scripts, "the nodes are made at the first launch"
    command = ["/x/mpirun", "-n", "2", "--oversubscribe", "/x/python", "-m", "benchmarks.tcp_links"]
    wrapped = launched["wrap"](command)
    assert scripts == [("up", slow_link.SUBNET), ("rate", "10mbit")]
    assert wrapped[:5] == ["bash", str(slow_link.SCRIPT), "head", link.prefix, "/x/mpirun"]
    assert "--oversubscribe" not in wrapped and wrapped[-5:] == ["-n", "2", *command[4:]]
    assert tcp_links.bound_s("10mbit", 431080) == 431080 * 4 * 8 / 10e6  # 2 ranks: each sends the message once
    assert tcp_links.bound_s("1gbit", 10, ranks=4) == 6 / 4 * 40 * (8 / 1e9)  # 2 (P - 1) / P of 40 bytes at 1 Gbit/s
    assert tcp_links.bound_s("host", 10) is None
    assert link.on(1, ["x"]) == ["ip", "netns", "exec", f"{link.prefix}-1", "x"] and link.address(1).endswith(".3")


def test_the_plain_tcp_exchange_times_each_call_and_a_failed_side_is_one_line():
    from benchmarks import harness, tcp_links

    assert len(tcp_links.socket_exchange(None, 2, 100_000, 3, 60)["seconds"]) == 3
    elsewhere = SimpleNamespace(address=lambda node: "203.0.113.1", on=lambda node, command: command)  # not ours
    with pytest.raises(harness.BenchmarkError, match=r"socket_exchange failed: OSError: .*assign requested address"):
        tcp_links.socket_exchange(elsewhere, 1, 10, 1, 60)


def test_omnivore_runs_the_auto_criterion_first_and_continues_in_order_across_chunks(tmp_path, monkeypatch):
    import dataclasses

    from benchmarks import harness, omnivore

    imbalances = {"slow rank": "slow-rank:3:2", "random": "random:30", "none": ""}
    monkeypatch.setattr(omnivore, "QUICK", dataclasses.replace(omnivore.QUICK, imbalances=imbalances))
    clock = [0.0]

    def run(path, budget_s):
        fake, calls = fake_training(clock)

        def runner(trainer, ranks, flags, timeout):  # tuned variants pay for their search, Omnivore less
            result = fake(trainer, ranks, flags, timeout)
            return {**result, "tta_s": result["tta_s"] + 5 * ("probe_seconds" in flags) + 2 * ("groups" in flags)}

        store = harness.PointStore(path, "omnivore", budget_s, runner, lambda: clock[0])
        return omnivore.measure(harness.Options("omnivore", True, tmp_path, 2, store)), calls

    whole, whole_calls = run(tmp_path / "whole.jsonl", None)
    each = [None] * len(omnivore.ALGORITHMS)
    criterion = [(spec, seed) for seed in (1, 2) for spec in ("", "random:30") for _ in each]
    slow = [("slow-rank:3:2", seed) for seed in (1, 2) for _ in each]
    assert [(flags["inject_imbalance"], flags["seed"]) for _, _, flags in whole_calls] == criterion + slow
    assert not whole.missing
    partial, calls = run(tmp_path / "chunks.jsonl", 150)
    assert partial.missing == ["auto criterion 2/24 runs", "slow rank 0/12 runs"]
    while partial.missing:
        partial, more = run(tmp_path / "chunks.jsonl", 300)
        calls += more
    assert calls == whole_calls and partial.rows == whole.rows
    rows = {(row["imbalance"], row["algorithm"]): row for row in whole.rows}
    for imbalance in imbalances:
        fixed = rows[(imbalance, "(b) ssgd")]["tta_s"]
        assert rows[(imbalance, "(b) ssgd")]["vs_best"] == 1.0
        assert rows[(imbalance, "(b) auto")]["vs_best"] == pytest.approx((fixed + 5) / fixed)
        assert rows[(imbalance, "(b) omnivore auto")]["vs_best"] == pytest.approx((fixed + 7) / fixed)


@pytest.mark.parametrize("stable_below, tried", [(0.006, [0.02, 0.01, 0.005]), (0.0, [0.02, 0.01, 0.005, 0.0025])])
def test_a_setting_that_diverges_at_every_grid_rate_tries_lower_ones_until_one_trains(stable_below, tried, tmp_path):
    from benchmarks import harness, stat_efficiency

    clock = [0.0]
    fake, calls = fake_training(clock)

    def runner(trainer, ranks, flags, timeout):
        if flags["lr"] > stable_below:
            calls.append((trainer, ranks, flags))
            return {"reached": False, "tta_s": None, "epochs": None, "diverged": True}
        return fake(trainer, ranks, flags, timeout)

    store = harness.PointStore(tmp_path / "s.jsonl", "stat_efficiency", None, runner, lambda: clock[0])
    report = stat_efficiency.measure(harness.Options("stat_efficiency", True, tmp_path, 1, store))
    ssgd = [flags["lr"] for _, _, flags in calls if flags["algorithm"] == "ssgd"]
    assert ssgd[:-1] == tried, "the grid's rate, then the rates below it (the last call: the finalist)"
    final = [row for row in report.rows if row["phase"] == "final" and row["algorithm"] == "ssgd"]
    assert not report.missing and len(final) == 1
    if stable_below:
        assert final[0]["lr"] == tried[-1] and final[0]["reached"] == "1/1"


@pytest.mark.slow
def test_the_torchft_peer_syncs_with_diloco_every_h_steps_and_writes_ddp_peers_records(tmp_path):
    pytest.importorskip("torchft")
    from benchmarks import harness

    from helpers import mpirun_command

    flags = ["--dataset", "synthetic-mnist", "--epochs", "0.02", "--target-accuracy", "0", "--diloco-every", "4"]
    env = {**harness.MPI_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(harness._free_port())}
    command = [*mpirun_command(2), sys.executable, "-m", "benchmarks.torchft_peer", "--run-dir", str(tmp_path), *flags]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["algorithm"] == "torchft-diloco H=4" and summary["iterations"] == 10
    assert done.stderr.count("should_commit completed should_commit=true") == 2 * 2  # 2 syncs, on each replica
    lenet_bytes = 431_080 * 4
    assert summary["comm_bytes"] == 2 * lenet_bytes  # 2 syncs, each 2 (P − 1) / P of the parameters


class BudgetedStore:
    """A point store whose budget holds `runs` training runs; a run's time to accuracy is 1 / its lr."""

    def __init__(self, runs: int):
        self.left = runs

    def train(self, phase, trainer, ranks, flags, seed, timeout, limit):
        if self.left == 0:
            return None
        self.left -= 1
        return {"reached": True, "tta_s": 1 / flags["lr"], "epochs": 1.0, "final_accuracy": 0.99, "samples_per_s": 1.0}


def test_hetero_races_the_goals_slowdown_first_and_chooses_only_from_a_complete_grid():
    from benchmarks import hetero

    assert hetero.race_order(hetero.FULL) == ["×2", "×1.5", "×4"]
    grid = len(hetero.FULL.variants) * len(hetero.FULL.lr_grid)
    partial = SimpleNamespace(store=BudgetedStore(grid - 1))
    best, runs = hetero.tune(partial, hetero.FULL, "×2")
    assert len(runs) == grid - 1 and best == {}, "a learning rate chosen from part of the grid"
    best, runs = hetero.tune(SimpleNamespace(store=BudgetedStore(grid)), hetero.FULL, "×2")
    assert len(runs) == grid
    assert {race: lr for race, (lr, _) in best.items()} == {("×2", name): 0.05 for name in hetero.FULL.variants}


def test_hetero_bounds_a_slowdown_of_own_balanced_by_balanced_runs_measured_beside_it(tmp_path):
    import dataclasses

    from benchmarks import harness, hetero

    assert "×4" in hetero.OWN_BALANCED and hetero.GOAL not in hetero.OWN_BALANCED
    budget = dataclasses.replace(hetero.FULL, variants=("ssgd",))
    balanced_rates = iter([10.0, 6.0])
    measured = []

    def runner(trainer, ranks, flags, timeout):
        balanced = flags["inject_imbalance"] == ""
        measured.append(balanced)
        rate = next(balanced_rates) if balanced else 1.0
        return {"reached": True, "tta_s": 1.0, "epochs": 1.0, "final_accuracy": 0.99, "samples_per_s": rate}

    options = SimpleNamespace(store=harness.PointStore(tmp_path / "points.jsonl", "hetero", runner=runner))
    best: dict = {}
    runs: list[dict] = []
    for factor in ("×2", "×4"):
        chosen = {(factor, "ssgd"): (0.02, hetero.variant_flags(budget, "ssgd", budget.imbalances[factor], 0.02))}
        best.update(chosen)
        runs += harness.interleave(hetero.final_runs(options, budget, factor, chosen), 1, quiet=True)
    assert measured == [False, True, False, True], "the same balanced flags were not measured again beside ×4"
    rows = {row["slowdown"]: row for row in hetero.final_rows(budget, best, runs, hetero.balanced_rates(budget, runs))}
    assert rows["×2"]["bound_samples_per_s"] == 10.0 * (1 + 1 / 2) / 2
    assert rows["×4"]["bound_samples_per_s"] == 6.0 * (1 + 1 / 4) / 2


@pytest.mark.parametrize(
    "flag, why",
    [
        (["--reps", "0"], "must be above 0"),
        (["--budget-minutes", "-1"], "must be above 0"),
        (["--phases", "a,"], "an empty phase name"),
    ],
)
def test_a_refused_benchmark_flag_is_one_line_and_writes_nothing(flag, why, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.hetero", *flag, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and f"argument {flag[0]}: {why}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_throughput_runs_sma_right_after_its_ddp_peer_and_compares_each_repetition_with_it(monkeypatch):
    from benchmarks import harness, throughput

    order: list[str] = []

    def interleave(variants, reps, quiet=False):
        order.extend(variants)
        rate = {"ddp 1 rank x 2 threads": 100.0, "crossbow sma k=2 1 rank x 2 threads": 90.0}
        return [
            {"variant": name, "rep": rep, "samples_per_s": rate.get(name, 100.0 + rep)}
            for rep in range(reps)
            for name in variants
        ]

    monkeypatch.setattr(harness, "interleave", interleave)
    report = throughput.measure(SimpleNamespace(quick=False, reps=2))
    peer = order.index("ddp 1 rank x 2 threads")
    assert order[peer + 1 : peer + 3] == ["crossbow sma k=2 1 rank x 2 threads", "crossbow sma k=4 1 rank x 2 threads"]
    assert len(order) == len(set(order)) == 10
    rows = {(row["layout"], row["system"]): row for row in report.rows}
    assert rows["1 rank x 2 threads", "crossbow sma k=2"]["worst_rep_vs_ddp"] == 0.9
    assert rows["1 rank x 2 threads", "crossbow sma k=4"]["worst_rep_vs_ddp"] == 1.0


@pytest.mark.slow
def test_the_hw_limit_bare_loop_runs_compiled_and_channels_last(monkeypatch):
    import torch

    from benchmarks.hw_limit import bare_samples_per_s
    from crossbow_mpi.data import build_dataset
    from crossbow_mpi.models import build_model
    from crossbow_mpi.runtime import process

    train_set, _ = build_dataset("synthetic-mnist", str(REPO / "datasets" / "mnist"), seed=1)

    def model_fn():
        return build_model("lenet", train_set.input_shape, train_set.num_classes)

    compiled, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn.__name__) or compile_(fn, **options))
    world = process.mpi().COMM_SELF
    rate = bare_samples_per_s(model_fn, train_set, 2, world, batch_size=8, channels_last=True, compiled=True)
    assert 0 < rate < float("inf") and compiled == ["model_loss"], compiled


def test_a_failed_job_ends_the_benchmark_with_its_output_and_no_traceback(tmp_path, monkeypatch):
    from benchmarks import harness

    def measure(options):
        raise harness.BenchmarkError("-m benchmarks.x on 2 ranks hung past 9 s:\nlast line of its output", hung=True)

    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__file__=str(REPO / "benchmarks" / "fake.py")))
    monkeypatch.setattr(sys, "argv", ["fake.py", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exited:
        harness.main(measure)
    why = exited.value.code
    assert why == "benchmarks.fake: -m benchmarks.x on 2 ranks hung past 9 s:\nlast line of its output", why
    assert not list((tmp_path / "out").iterdir()), "a failed benchmark wrote a result"
