"""The planner: its model's formulas against hand-computed values, its projection's shape, and its CLI."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from crossbow_mpi import plan
from crossbow_mpi.planner import measure, perf_model
from crossbow_mpi.planner.perf_model import EpochCurve, Network, Workload

from helpers import REPO

FREE = Network(0.0, 0.0)


def test_ring_allreduce_and_send_costs():
    network = Network(1e-5, 1e-9)
    assert network.allreduce_s(1e6, 4) == pytest.approx(6e-5 + 1.5e-3)  # 2(P-1)α + 2(P-1)/P·n·β
    assert network.allreduce_s(1e6, 1) == 0.0
    assert network.send_s(1e3) == pytest.approx(1e-5 + 1e-6)
    assert network.send_s(0) == 0.0


def test_tree_allreduce_and_the_faster_of_the_two():
    ring, tree, auto = (Network(1e-5, 1e-9, algorithm) for algorithm in perf_model.ALLREDUCES)
    assert tree.allreduce_s(1e6, 4) == pytest.approx(4 * (1e-5 + 1e-3))  # 2·⌈log2 P⌉·(α + n·β)
    assert tree.allreduce_s(1e6, 5) == pytest.approx(6 * (1e-5 + 1e-3))  # a partial level costs a whole one
    assert tree.allreduce_s(1e6, 1) == 0.0
    # bandwidth-bound: the ring's 1.56 ms beats the tree's 4.04 ms at 1 MB on 4 ranks
    assert auto.allreduce_s(1e6, 4) == pytest.approx(ring.allreduce_s(1e6, 4)) == pytest.approx(6e-5 + 1.5e-3)
    # latency-bound: at 1 kB on 1024 ranks the ring's 2046 latencies cost 20.5 ms, the tree's 20 levels 0.22 ms
    assert auto.allreduce_s(1e3, 1024) == pytest.approx(20 * (1e-5 + 1e-6))
    assert ring.allreduce_s(1e3, 1024) == pytest.approx(2046e-5 + 2046 / 1024 * 1e-6)


def test_a_link_in_gbit_per_s_and_microseconds():
    infiniband = Network.from_link(100, 1)
    assert infiniband.seconds_per_byte == pytest.approx(8e-11) and infiniband.latency_s == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="--bandwidth"):
        Network.from_link(0, 1)


def test_the_allreduce_fit_recovers_alpha_and_beta():
    truth = Network(2e-5, 3e-10)
    sizes = [4.0**i for i in range(2, 10)]
    fitted = perf_model.fit_ring_allreduce(sizes, [truth.allreduce_s(n, 4) for n in sizes], 4)
    assert fitted.latency_s == pytest.approx(2e-5) and fitted.seconds_per_byte == pytest.approx(3e-10)
    with pytest.raises(ValueError):
        perf_model.fit_ring_allreduce([8.0, 8.0], [1.0, 1.0], 2)


def test_pipeline_bubble_and_step():
    assert perf_model.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert perf_model.bubble_fraction(1, 8) == 0
    # 4 micro-batches of 2 samples through 2 stages: 3 in the slower stage's 4 ms slot, one through both (2 + 4 ms)
    assert perf_model.pipeline_step_s([1e-3, 2e-3], [100], 8, 4, FREE) == pytest.approx(3 * 4e-3 + 6e-3)
    # the first activation and the last gradient cross the cut: 2 × α
    assert perf_model.pipeline_step_s([1e-3, 2e-3], [100], 8, 4, Network(1e-4, 0)) == pytest.approx(18.2e-3)
    # each stage's slot adds the host work of the 200-byte activation and gradient it handles, 0.1 + 0.2 ms;
    # each crossing waits half a poll, 0.5 ms
    link = perf_model.LinkCost(host_s_fixed=1e-4, host_s_per_byte=1e-6, poll_delay_s=5e-4)
    assert perf_model.pipeline_step_s([1e-3, 2e-3], [100], 8, 4, FREE, link) == pytest.approx(
        3 * 4.3e-3 + (2.3e-3 + 4.3e-3) + 2 * 5e-4
    )
    # a middle stage handles the messages of both its cuts
    assert perf_model.pipeline_step_s([1e-3] * 3, [100, 100], 8, 4, FREE, perf_model.LinkCost(1e-4)) == pytest.approx(
        3 * 2.2e-3 + (2.1e-3 + 2.2e-3 + 2.1e-3)
    )
    # a link slower than every stage sets the slot: 20 ms per 200-byte message
    assert perf_model.pipeline_step_s([1e-3, 2e-3], [100], 8, 4, Network(0, 1e-4)) == pytest.approx(
        3 * 20e-3 + 6e-3 + 2 * 20e-3
    )


def test_the_link_fit_recovers_the_host_work_per_message():
    fitted = perf_model.fit_link([0, 1000, 4000], [2e-5 + n * 1e-8 for n in (0, 1000, 4000)], poll_delay_s=3e-4)
    assert fitted.host_s_fixed == pytest.approx(2e-5) and fitted.host_s_per_byte == pytest.approx(1e-8)
    assert fitted.poll_delay_s == 3e-4 and fitted.host_s(500) == pytest.approx(2.5e-5)
    with pytest.raises(ValueError, match="two message sizes"):
        perf_model.fit_link([8, 8], [1e-5, 1e-5], 0.0)


def test_a_step_charges_the_training_loops_overhead():
    work = dataclasses.replace(workload(), step_overhead_s=1e-3)
    # 16 samples of 1 ms, the overhead, the update of 4 MB at 0.1 ns/byte
    assert perf_model.dp_step_s(work, 1, FREE) == pytest.approx(16e-3 + 1e-3 + 4e-4)
    # 3 micro-batches in a 2.2 ms slot, one through both stages, the overhead, the update of the 2 MB shard
    assert perf_model.hybrid_step_s(work, 2, 2, FREE) == pytest.approx(3 * 2.2e-3 + 4.4e-3 + 1e-3 + 2e-4)


def test_workloads_saved_before_the_link_and_overhead_were_measured_load_without_them(tmp_path):
    saved = json.loads((REPO / "benchmarks/results/plan/lenet-validate.json").read_text())
    _, cut, work = plan.read_workload(REPO / "benchmarks/results/plan/lenet-validate.json")
    assert cut == "time" and work.link != perf_model.LinkCost() and work.step_overhead_s > 0
    for field in ("link", "step_overhead_s"):  # as files saved before these were measured hold them
        del saved["workload"][field]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    _, cut, work = plan.read_workload(tmp_path / "old.json")
    assert cut == "time" and work.link == perf_model.LinkCost() and work.step_overhead_s == 0.0


def test_epoch_curve_fit_and_speedup():
    curve = perf_model.fit_epochs([16, 64, 256], [2 * (1 + b / 100) for b in (16, 64, 256)])
    assert curve.min_epochs == pytest.approx(2) and curve.noise_batch == pytest.approx(100)
    # E(25)/E(100) = 1.25/2, four workers at the same step time
    assert perf_model.speedup(4, 25, 1.0, 1.0, EpochCurve(1, 100)) == pytest.approx(0.625 * 4)
    with pytest.raises(ValueError, match="does not grow"):
        perf_model.fit_epochs([16, 64], [5, 3])


def workload(batch=16, micro_batches=4) -> Workload:
    return Workload(
        batch=batch,
        sample_s=1e-3,
        param_bytes=4_000_000,
        stages={2: ([5.5e-4, 5.5e-4], [4000], [2_000_000, 2_000_000])},
        micro_batches=micro_batches,
        update_s_per_byte=1e-10,
    )


def test_a_free_network_and_no_efficiency_loss_scale_linearly():
    cells = perf_model.project(workload(), FREE, EpochCurve(1, math.inf), [1, 2, 8, 1024], [1])
    assert [c.speedup for c in cells] == pytest.approx([1, 2, 8, 1024])


def test_hybrid_overtakes_dp_as_the_allreduce_and_the_batch_grow():
    network = Network(5e-6, 1e-9)
    cells = perf_model.project(workload(), network, EpochCurve(1, 256), [2**i for i in range(11)], [1, 2])
    dp = {c.devices: c.speedup for c in cells if c.stages == 1}
    hybrid = {c.devices: c for c in cells if c.stages == 2}
    steps = [c.step_s for c in cells if c.stages == 1]
    assert steps == sorted(steps), "a DP step cannot get cheaper with more devices"
    ratios = [hybrid[n].speedup / dp[n] for n in sorted(hybrid) if n >= 4]
    assert ratios == sorted(ratios), "once both allreduce, hybrid's advantage grows with N"
    assert ratios[0] < 1 < ratios[-1]
    # one device: 16 samples + the update; M = 2: 3 micro-batches of 4 samples in a stage's slot, one through both
    # stages, the first activation and the last gradient (16 kB each), + half the update
    assert hybrid[2].mp_speedup == pytest.approx(
        (16e-3 + 4e-4) / (3 * 4 * 5.5e-4 + 2 * 4 * 5.5e-4 + 2 * (5e-6 + 1.6e-5) + 2e-4)
    )
    assert not hybrid[2].pal_criterion and hybrid[1024].pal_criterion


def test_the_efficiency_file_gives_the_ssgd_runs_that_reached_the_target(tmp_path):
    rows = [
        {"algorithm": "ssgd", "aggregate": 16, "epochs": 3.0},
        {"algorithm": "sma", "aggregate": 16, "epochs": 9.0},
        {"algorithm": "ssgd", "aggregate": 64, "epochs": 6.0},
        {"algorithm": "ssgd", "aggregate": 1024, "epochs": None},
    ]
    (tmp_path / "eff.json").write_text(json.dumps({"rows": rows}))
    curve, _ = plan.epoch_curve(tmp_path / "eff.json")
    assert curve.epochs(16) == pytest.approx(3) and curve.epochs(64) == pytest.approx(6)
    grid = [{"phase": "grid", "algorithm": "ssgd", "aggregate": b, "epochs": e} for b, e in ((16, 4.0), (64, 9.0))]
    (tmp_path / "chunked.json").write_text(json.dumps({"rows": [{**row, "phase": "grid"} for row in rows] + grid}))
    curve, _ = plan.epoch_curve(tmp_path / "chunked.json")  # no finalists yet: the grid's fewest at each batch
    assert curve.epochs(16) == pytest.approx(3) and curve.epochs(64) == pytest.approx(6)
    final = [{"phase": "final", "algorithm": "ssgd", "aggregate": b, "epochs": e} for b, e in ((16, 5.0), (64, 7.0))]
    (tmp_path / "final.json").write_text(json.dumps({"rows": final + grid}))
    curve, _ = plan.epoch_curve(tmp_path / "final.json")  # the finalists' medians, not the grid's
    assert curve.epochs(16) == pytest.approx(5) and curve.epochs(64) == pytest.approx(7)
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a stat-efficiency"):
        plan.epoch_curve(tmp_path / "bad.json")


def test_the_repositorys_efficiency_file_that_cannot_be_fitted_yet_gives_the_default(tmp_path, monkeypatch):
    one = {"rows": [{"phase": "grid", "algorithm": "ssgd", "aggregate": 16, "epochs": 3.0}]}
    (tmp_path / "partial.json").write_text(json.dumps(one))
    monkeypatch.setattr(measure, "EFFICIENCY_FILE", tmp_path / "partial.json")
    curve, source = plan.epoch_curve(None)
    assert curve == perf_model.DEFAULT_EPOCHS and source.startswith("default (E(B) needs")
    with pytest.raises(ValueError, match=r"E\(B\) needs"):  # a file the user names must fit
        plan.epoch_curve(tmp_path / "partial.json")


def test_interleaved_measures_in_rounds_of_every_key():
    taken = []
    results = plan.interleaved(lambda key: taken.append(key) or f"{key}{len(taken)}", [(2, 1), (4, 4)], 3)
    assert taken == [(2, 1), (4, 4)] * 3
    assert results == {(2, 1): ["(2, 1)1", "(2, 1)3", "(2, 1)5"], (4, 4): ["(4, 4)2", "(4, 4)4", "(4, 4)6"]}


def test_median_of_repeated_measurements_goes_field_by_field():
    works = [dataclasses.replace(workload(), sample_s=s, stages={2: ([s, 2 * s], [4000], [8, 8])}) for s in (3, 1, 2)]
    median = plan.median_of([(work, Network(a, 1e-9, "tree"), a) for work, a in zip(works, (5, 9, 7), strict=True)])
    assert median == (
        dataclasses.replace(workload(), sample_s=2, stages={2: ([2, 4], [4000], [8, 8])}),
        Network(7, 1e-9, "tree"),
        7,
    )
    assert plan.median_of([1.0, 4.0]) == 2.5 and plan.median_of([16, 16]) == 16
    assert plan.spread([9.4e-3, 8.8e-3, 9.1e-3], 1e3) == "8.8–9.4"


def test_the_median_workload_takes_each_m_from_the_repetitions_that_cut_as_most_did():
    cut = {"most": ([1.0, 2.0], [4000], [8, 8]), "other": ([1.5, 1.5], [2000], [4, 12])}
    works = [
        dataclasses.replace(workload(), sample_s=s, stages={2: ([t * s for t in cut[c][0]], *cut[c][1:])})
        for s, c in ((3, "most"), (1, "other"), (5, "most"))
    ]
    # sample_s over all three; the stages over the two that cut at 4000 bytes
    assert plan.median_workload(works) == dataclasses.replace(
        workload(), sample_s=3, stages={2: ([4.0, 8.0], [4000], [8, 8])}
    )


def test_a_validation_row_projects_from_the_median_runs_and_keeps_each_step():
    work = dataclasses.replace(workload(), update_s_per_byte=0.0)
    runs = [
        (dataclasses.replace(work, sample_s=s), FREE, step, 1.0)
        for s, step in ((2e-3, 0.05), (1e-3, 0.02), (1e-3, 0.04))
    ]
    row = plan.validation_row(1, 1, runs)
    # 16 samples of the median 1 ms against the median step of 40 ms
    assert row["projected_step_ms"] == pytest.approx(16) and row["measured_step_ms"] == pytest.approx(40)
    assert row["measured_runs_ms"] == pytest.approx([50, 20, 40]) and row["error"] == pytest.approx(-0.6)
    assert "20–50ms" in plan.validation_table([row]) and "median of 3 runs" in plan.validation_table([row])


def test_validation_runs_the_sizes_in_rounds_and_the_overhead_in_pairs(monkeypatch):
    trained, steps = [], iter([0.05, 0.03, 0.04, 0.07, 0.02, 0.01, 0.05, 0.06])
    monkeypatch.setattr(measure, "measure_workload", lambda *_: workload())
    monkeypatch.setattr(measure, "sweep_allreduce", lambda *_, **__: FREE)
    monkeypatch.setattr(measure, "train_step_s", lambda _, n, m, __: trained.append((n, m)) or next(steps))
    args = plan.build_parser().parse_args(["--validate"])
    rows = plan.validate(args, workload(), reps=2)
    # (4, 4) does not run: the workload has no 4 stages
    assert [(r["ranks"], r["stages"]) for r in rows] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert trained == [(2, 1), (2, 2), (4, 1), (4, 2)] * 2
    runs = [[round(ms) for ms in r["measured_runs_ms"]] for r in rows]
    assert runs == [[50, 20], [30, 10], [40, 50], [70, 60]]
    # 16 ms of compute and 0.4 ms of update per step, the median of 19 - 16.4 and 29 - 16.4
    steps = iter([0.019, 0.029])
    assert plan.measure_step_overhead(args, reps=2).step_overhead_s == pytest.approx(7.6e-3)


def run_plan(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossbow_mpi.plan", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--micro-batches", "32"], "--micro-batches"),
        (["--bandwidth", "100"], "together"),
        (["--ranks", "1"], "--ranks"),
        (["--reps", "0"], "--reps"),
        (["--efficiency", "/nonexistent.json"], "no such file"),
        (["--measure-efficiency", "--efficiency", "benchmarks/results/stat_efficiency.json"], "not both"),
        (["--target-accuracy", "2"], "--target-accuracy"),
        (["--workload", "/nonexistent.json"], "no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = run_plan(*args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_quick_plan_projects_validates_and_plots(tmp_path):
    network = ("--bandwidth", "100", "--latency", "1")
    done = run_plan("--quick", "--validate", "--cut", "time", *network, "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((tmp_path / "plan.json").read_text())
    cells = {(c["devices"], c["stages"]) for c in record["projection"]}
    assert {(1, 1), (1024, 1), (1024, 2), (1024, 4)} <= cells
    assert [(r["ranks"], r["stages"]) for r in record["validation"]] == [(2, 1), (2, 2)]
    assert all(r["measured_step_ms"] > 0 and r["projected_step_ms"] > 0 for r in record["validation"])
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert "SU_MP(M) > SU_DP(N)/SU_DP(N/M)" in done.stdout

    again = run_plan("--workload", str(tmp_path / "plan.json"), *network, "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-2000:]
    projected = json.loads((tmp_path / "again" / "plan.json").read_text())
    assert projected["projection"] == record["projection"]
    assert projected["workload"]["cut"] == "time" and projected["workload"]["stages"] == record["workload"]["stages"]


@pytest.mark.slow
def test_measured_efficiency_is_a_results_file_that_the_plan_fits(tmp_path):
    done = run_plan(
        *("--quick", "--measure-efficiency", "--model", "mlp", "--dataset", "synthetic-mnist"),
        *("--target-accuracy", "0.2", "--efficiency-epochs", "0.1", "--bandwidth", "100", "--latency", "1"),
        *("--out", str(tmp_path)),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "efficiency.json").read_text())["rows"]
    assert [(r["algorithm"], r["aggregate"]) for r in rows] == [("ssgd", 16), ("ssgd", 64)]
    curve = json.loads((tmp_path / "plan.json").read_text())["epoch_curve"]
    assert curve["source"] == str(tmp_path / "efficiency.json")
    for row in rows:  # two points: the line goes through both
        assert EpochCurve(curve["min_epochs"], curve["noise_batch"]).epochs(row["aggregate"]) == pytest.approx(
            row["epochs"]
        )
