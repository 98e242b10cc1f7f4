"""Keep training when a rank dies (ULFM, `--on-rank-loss continue`): the survivors drop the step in flight, go on
from the newest step that all of them hold, record the loss and write a checkpoint; fewer than --min-ranks, or a
pipeline, exit 75, and --resume reshards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import h5py
import pytest
import torch

from crossbow_mpi import Trainer
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.runtime import ulfm
from crossbow_mpi.transports.partial_allreduce import PartialAllreduce

from helpers import REPO, mpirun_command, run_job

BATCH, LEARNERS = 16, 2
RUN = [
    *("--dataset", "synthetic-mnist", "--model", "mlp", "--epochs", "0.05", "--eval-every", "1000"),
    *("--target-accuracy", "0", "--learners", str(LEARNERS), "--batch-size", str(BATCH)),
    *("--on-rank-loss", "continue"),
]


def ulfm_job(ranks: int, kill: str, args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    """Run `python -m crossbow_mpi.train ARGS` under `mpirun --with-ft ulfm`, SIGKILLing ranks as `kill` says."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env[ulfm.KILL_VARIABLE] = kill
    mpirun, *rest = mpirun_command(ranks)
    cmd = [mpirun, "--with-ft", "ulfm", *rest, sys.executable, "-m", "crossbow_mpi.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_state(run_dir, part: str = "state") -> dict:
    with h5py.File(sorted(run_dir.glob("checkpoint-*.h5"))[-1]) as f:
        return json.loads(f["train"].attrs[part])


def ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "died" in line]


def test_continue_applies_to_every_algorithm_but_auto():
    with pytest.raises(ConfigError, match="--on-rank-loss continue applies to"):
        Config(algorithm="auto", on_rank_loss="continue", learners=1).validate(ALGORITHMS)
    with pytest.raises(ConfigError, match="--on-rank-loss continue needs a fixed --groups"):
        Config(algorithm="omnivore", groups="auto", on_rank_loss="continue").validate(ALGORITHMS)
    with pytest.raises(ConfigError, match="--on-rank-loss"):
        Config(on_rank_loss="retry").validate(ALGORITHMS)
    for name in ("sma", "ssgd", "eager", "elastic", "omnivore", "hogbatch"):
        Config(algorithm=name, on_rank_loss="continue").validate(ALGORITHMS)


@pytest.mark.mpi(min_size=1)
def test_min_ranks_above_the_jobs_ranks_is_refused(comm, shared_tmp):
    with pytest.raises(ConfigError, match=f"--min-ranks 99 exceeds the job's {comm.size} ranks"):
        Trainer(Config(run_dir=str(shared_tmp), min_ranks=99), comm)


def test_rollback_holds_the_last_two_steps_in_the_dropped_ones_tensors_and_hands_out_copies():
    rollback, state = ulfm.Rollback(True), {"x": [0], "t": torch.zeros(3), "views": [torch.zeros(2)]}
    places = []
    for iteration in range(5):
        state["x"][0] = iteration
        state["t"].fill_(iteration)
        rollback.before_step(iteration, lambda into: ulfm.copy_state(state, into))
        places.append(rollback.snapshots[iteration]["t"].data_ptr())
    assert sorted(rollback.snapshots) == [3, 4]
    assert places[2] == places[0] and places[3] == places[1] and places[0] != places[1]
    restored = rollback.at(3)
    assert restored["x"] == [3] and restored["t"].tolist() == [3.0] * 3
    restored["t"].fill_(9)
    assert rollback.at(3)["t"].tolist() == [3.0] * 3, "a restore's copy shares a tensor with the one kept"
    assert rollback.snapshots[3]["views"][0].data_ptr() != state["views"][0].data_ptr()
    off = ulfm.Rollback(False)
    off.before_step(0, lambda into: state)
    assert off.snapshots == {}


class Gathered:
    """A world whose ranks hold the given iterations' copies."""

    def __init__(self, *held: list[int]) -> None:
        self.held = held

    def allgather_json(self, mine: list[int]) -> list[list[int]]:
        return list(self.held)


def test_rollback_every_n_steps_also_after_a_start_a_write_and_a_restore():
    rollback, kept = ulfm.Rollback(True, every=4), []
    for iteration in range(1, 15):
        rollback.before_step(iteration, lambda into, i=iteration: {"i": i})
        kept.append(max(rollback.snapshots))
        if iteration == 5:  # an evaluation or a checkpoint after this step
            rollback.keep_next()
    assert kept == [1, 1, 1, 4, 4, 6, 6, 8, 8, 8, 8, 12, 12, 12]
    assert sorted(rollback.snapshots) == [8, 12]
    # survivors one step apart: the one in flight at 12 holds 8 and 12, the one in flight at 11 holds 4 and 8
    assert rollback.common(Gathered([8, 12], [4, 8])) == 8
    assert rollback.common(Gathered([8, 12], [1])) == -1
    assert rollback.at(8) == {"i": 8} and rollback.due
    rollback.before_step(9, lambda into: {"i": 9})  # the first step after the restore: copied, 12 dropped
    assert sorted(rollback.snapshots) == [8, 9] and not rollback.due


def test_a_step_stamp_is_a_line_on_rank_0_only_when_asked(tmp_path):
    stamps = tmp_path / "stamps"
    ulfm.stamp_step(3, 96, environ={})
    assert not stamps.exists()
    ulfm.stamp_step(3, 96, environ={ulfm.STAMPS_VARIABLE: str(stamps)})
    ulfm.stamp_step(4, 128, environ={ulfm.STAMPS_VARIABLE: str(stamps)})
    lines = [line.split() for line in stamps.read_text().splitlines()]
    assert [line[:2] for line in lines] == [["3", "96"], ["4", "128"]] and float(lines[0][2]) <= float(lines[1][2])


@pytest.mark.mpi(min_size=1)
def test_eager_keeps_the_gradients_no_round_carried_yet_and_a_restore_lands_them_in_the_first_round(comm):
    steps, late = 6, comm.size - 1
    partial, carried = PartialAllreduce(comm, "solo", 4, seed=3), torch.zeros(comm.size * steps, dtype=torch.float64)
    for step in range(steps):
        if comm.size > 1 and comm.rank == late:
            time.sleep(0.1)  # far longer than a round among the others: its eager rounds fire without it
        contribution = torch.zeros_like(carried)
        contribution[comm.rank * steps + step] = 1
        carried += partial.allreduce_sum_(contribution).total
    unlanded = partial.unlanded()
    if comm.size > 1 and comm.rank == late:
        assert unlanded, "its last gradient waits for a later round"
    everyone = torch.tensor(comm.allreduce_sum_numbers(sum(unlanded, torch.zeros_like(carried)).tolist()))
    assert torch.equal(carried + everyone, torch.ones_like(carried)), "each carried once, or kept"
    partial.drain()
    restored = PartialAllreduce(comm, "solo", 4, seed=3)
    restored.restore(unlanded)
    assert torch.equal(restored.allreduce_sum_(torch.zeros_like(carried)).total, everyone)
    restored.drain()


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("sma", ["--rollback-every", "4"]),
        ("eager", ["--rollback-every", "4", "--eager-mode", "solo", "--inject-imbalance", "slow-rank:2:3"]),  # 2 late
    ],
)
def test_a_synchronous_run_survives_a_killed_rank_and_takes_every_sample(tmp_path, algorithm, extra):
    run_dir = tmp_path / algorithm
    job = ulfm_job(3, "1:7", ["--run-dir", str(run_dir), "--algorithm", algorithm, *extra, *RUN])
    assert job.returncode == 0, job.stderr
    lost = [r for r in records(run_dir) if r.get("event") == "rank_lost"]
    assert len(lost) == 1, lost
    at = lost[0]["iteration"]
    # rank 1 dies before iteration 7 (eager's rounds run behind its steps, so the loss may surface in the round of
    # iteration 6): the survivors go back to the copy before iteration 4 (--rollback-every 4) and take 4-6 again
    assert at == 4, lost
    assert ours(job.stderr) == [f"rank(s) 1 died; going on with 2 ranks from iteration {at}"], job.stderr
    assert lost[0]["ranks"] == [1] and lost[0]["world_size"] == 2
    assert lost[0]["recovery_s"] < 10
    summary = records(run_dir)[-1]
    assert summary["event"] == "summary" and summary["world_size"] == 2 and summary["epochs"] >= 0.05
    # the dropped steps are taken again: `at` steps of 3 ranks, then only steps of 2, and no sample twice
    assert summary["samples"] == at * 3 * LEARNERS * BATCH + (summary["iterations"] - at) * 2 * LEARNERS * BATCH


@pytest.mark.slow
def test_a_rollback_never_takes_the_run_back_behind_an_evaluation(tmp_path):
    run_dir = tmp_path / "ssgd"
    job = ulfm_job(3, "1:13", ["--run-dir", str(run_dir), "--algorithm", "ssgd", *RUN])  # --rollback-every 8
    assert job.returncode == 0, job.stderr
    evaluated = [r["iteration"] for r in records(run_dir) if "event" not in r]
    lost = [r["iteration"] for r in records(run_dir) if r.get("event") == "rank_lost"]
    # every 1,000 samples: the first evaluation ends iteration 10 (at 11), so the copy before 11, not before 8
    assert evaluated[0] == 11 and lost == [11], (evaluated, lost)
    assert len(evaluated) == len(set(evaluated)), "an evaluation recorded twice"


@pytest.mark.slow
def test_ssgd_loses_rank_0_then_another_below_min_ranks_and_resume_reshards(tmp_path):
    run_dir = tmp_path / "ssgd"
    args = ["--run-dir", str(run_dir), "--algorithm", "ssgd", *RUN]
    job = ulfm_job(3, "0:3,1:6", [*args, "--min-ranks", "2", "--rank-loss-lr", "linear", "--rollback-every", "1"])
    assert job.returncode == ulfm.EXIT_RANK_LOST, job.stderr
    lost = [r for r in records(run_dir) if r.get("event") == "rank_lost"]
    assert [(r["ranks"], r["world_size"], r["iteration"]) for r in lost] == [([0], 2, 3), ([1], 1, 6)]
    assert [r["lr"] for r in lost] == pytest.approx([0.01 * 2 / 3, 0.01 / 3])
    assert len(ours(job.stderr)) == 2 and "--min-ranks 2" in ours(job.stderr)[-1], job.stderr
    assert checkpoint_state(run_dir)["iteration"] == 6  # written right after the second recovery
    resumed = run_job(1, [*args, "--resume"], timeout=150)
    assert resumed.returncode == 0, resumed.stderr
    assert records(run_dir)[-1]["world_size"] == 1


@pytest.mark.slow
def test_a_pipeline_that_loses_a_stage_exits_75_without_a_new_checkpoint(tmp_path):
    run_dir = tmp_path / "pipeline"
    job = ulfm_job(2, "1:3", ["--run-dir", str(run_dir), "--algorithm", "ssgd", "--pipeline-stages", "2", *RUN])
    assert job.returncode == ulfm.EXIT_RANK_LOST, job.stderr
    assert ours(job.stderr) == [
        "crossbow_mpi: error: rank(s) 1 died and a pipeline cannot lose a stage; resume with --resume on the ranks left"
    ], job.stderr
    assert not list(run_dir.glob("checkpoint-*.h5"))


def survived_rounds(job: subprocess.CompletedProcess, run_dir, lost: int, ranks: int, iteration: int) -> None:
    """Assert that an asynchronous run lost rank `lost` in round `iteration`, went on from that round's start on
    `ranks` ranks (the recovery checked that they hold the same z) and applied every update it counts once: the
    server's updates, each of one group step's samples, took every sample the run counts."""
    assert job.returncode == 0, job.stderr
    assert ours(job.stderr) == [f"rank(s) {lost} died; going on with {ranks} ranks from iteration {iteration}"]
    lost_records = [r for r in records(run_dir) if r.get("event") == "rank_lost"]
    assert [(r["ranks"], r["world_size"], r["iteration"]) for r in lost_records] == [([lost], ranks, iteration)]
    assert lost_records[0]["recovery_s"] < 10
    summary = records(run_dir)[-1]
    assert summary["event"] == "summary" and summary["world_size"] == ranks and summary["epochs"] >= 0.05
    assert checkpoint_state(run_dir, "algorithm")["version"] * LEARNERS * BATCH == summary["samples"]


ROUNDS = ["--round-samples", str(8 * LEARNERS * BATCH)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill, extra", [("1:4", []), ("0:4:1", ["--optimizer", "adamw", "--lr", "0.001"])]
)  # a worker at the round's start; the server's rank in the round
def test_elastic_survives_a_killed_rank(tmp_path, kill, extra):
    run_dir = tmp_path / "elastic"
    job = ulfm_job(3, kill, ["--run-dir", str(run_dir), "--algorithm", "elastic", *extra, *RUN, *ROUNDS])
    survived_rounds(job, run_dir, int(kill[0]), 2, 4)


@pytest.mark.slow
def test_hogbatch_drops_the_round_of_a_worker_killed_after_its_update(tmp_path):
    run_dir = tmp_path / "hogbatch"
    job = ulfm_job(3, "2:4:1", ["--run-dir", str(run_dir), "--algorithm", "hogbatch", *RUN, *ROUNDS])
    survived_rounds(job, run_dir, 2, 2, 4)


@pytest.mark.slow
def test_hogbatch_loses_a_worker_then_the_servers_rank(tmp_path):
    run_dir = tmp_path / "hogbatch"
    job = ulfm_job(4, "1:3,0:6:1", ["--run-dir", str(run_dir), "--algorithm", "hogbatch", *RUN, *ROUNDS])
    assert job.returncode == 0, job.stderr
    lost = [(r["ranks"], r["world_size"], r["iteration"]) for r in records(run_dir) if r.get("event") == "rank_lost"]
    assert lost == [([1], 3, 3), ([0], 2, 6)]
    assert "trained to the epoch limit" in job.stdout, "the survivors' rank 0 tells the outcome"
    assert "but MPI places this rank" not in job.stderr, "no launcher warning for the survivors' numbering"
    assert checkpoint_state(run_dir, "algorithm")["version"] * LEARNERS * BATCH == records(run_dir)[-1]["samples"]


@pytest.mark.slow
def test_omnivore_survivor_takes_the_server_over_with_its_optimizer_state(tmp_path):
    run_dir = tmp_path / "omnivore"
    args = ["--algorithm", "omnivore", "--groups", "3", "--optimizer", "adamw", "--lr", "0.001"]
    job = ulfm_job(3, "0:4:1", ["--run-dir", str(run_dir), *args, *RUN, *ROUNDS])
    survived_rounds(job, run_dir, 0, 2, 4)
    with h5py.File(sorted(run_dir.glob("checkpoint-*.h5"))[-1]) as f:  # AdamW counts every update it applied
        assert f["central/optimizer/step"][()] == checkpoint_state(run_dir, "algorithm")["version"]


@pytest.mark.slow
def test_omnivore_regroups_the_survivors(tmp_path):
    run_dir = tmp_path / "omnivore"
    job = ulfm_job(4, "3:5:1", ["--run-dir", str(run_dir), "--algorithm", "omnivore", "--groups", "2", *RUN, *ROUNDS])
    survived_rounds(job, run_dir, 3, 3, 5)
    assert checkpoint_state(run_dir, "choice") == {"algorithm": "omnivore", "groups": 1}
