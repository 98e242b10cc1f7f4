"""Stop signals in every phase: before training, during the optimizer's probes, SIGTERM and SIGINT through
launch/local.sh; stale checkpoint temporaries; each stop exits 75 with one line and a checkpoint to resume from."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, mpirun_command, run_job

RUN = ["--dataset", "synthetic-mnist", "--model", "mlp", "--threads", "1", "--learners", "2"]
RUN += ["--eval-every", "1000", "--target-accuracy", "0"]
LONG = [*RUN, "--epochs", "50"]
"""Far more epochs than fit before the signal, so that the signal always stops the run."""
SHORT = [*RUN, "--epochs", "0.05"]
STOP_WITHIN_S = 30
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")


def start(command: list[str], env=ENV) -> subprocess.Popen:
    """Start the command in a session of its own (as a terminal's foreground job), with SIGINT's default action:
    a suite started in the background (`cmd &`) ignores SIGINT, and a shell cannot trap what it inherits ignored."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    return subprocess.Popen(command, cwd=REPO, env=env, preexec_fn=default_sigint, **pipes)


def train_command(run_dir, *flags: str) -> list[str]:
    return [*mpirun_command(2), sys.executable, "-m", "crossbow_mpi.train", "--run-dir", str(run_dir), *flags]


def records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_record(job: subprocess.Popen, run_dir, wanted, timeout: float = 120) -> None:
    """Wait until the run writes a record for which `wanted` holds."""
    deadline = time.monotonic() + timeout
    while not any(wanted(r) for r in records(run_dir)):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)


def stop_with(job: subprocess.Popen, signum: int, group: bool = False) -> tuple[str, str, float]:
    """Send the signal to the job (`group`: to its process group, as a terminal's Ctrl-C); return the job's output
    and the seconds it took to end."""
    sent = time.monotonic()
    if group:
        os.killpg(job.pid, signum)
    else:
        job.send_signal(signum)
    try:
        out, err = job.communicate(timeout=STOP_WITHIN_S + 30)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return out, err, time.monotonic() - sent


def assert_stopped(run_dir, out: str, err: str, seconds: float, returncode: int) -> None:
    """Exit 75 in time, one line, a complete checkpoint and the preempted record, no temporary left."""
    assert returncode == 75, err
    assert seconds < STOP_WITHIN_S, seconds
    (line,) = out.splitlines()
    assert line.startswith("stopped by a signal after ") and line.endswith("continue with --resume"), out
    assert sorted(run_dir.glob("checkpoint-*.h5")) and not list(run_dir.glob("*.tmp"))
    assert records(run_dir)[-1]["event"] == "preempted"


def resume(run_dir, *flags: str) -> list[dict]:
    """Resume to the end; return the records the resumed run wrote."""
    before = len(records(run_dir))
    done = run_job(2, ["--run-dir", str(run_dir), "--resume", *flags], timeout=180)
    assert done.returncode == 0, done.stderr
    return records(run_dir)[before:]


@pytest.mark.slow
def test_a_signal_during_the_optimizer_search_stops_it_and_the_resumed_run_searches_again(tmp_path):
    run_dir = tmp_path / "run"
    search = ["--algorithm", "omnivore", "--groups", "auto"]
    job = start(train_command(run_dir, *LONG, *search, "--probe-seconds", "3"))  # a search of 9 probes or more
    wait_for_record(job, run_dir, lambda r: r.get("decision") == "probe")
    out, err, seconds = stop_with(job, signal.SIGUSR1)
    assert_stopped(run_dir, out, err, seconds, job.returncode)
    stopped = records(run_dir)
    assert not any(r.get("decision") == "choice" for r in stopped)
    assert stopped[-1]["iteration"] == 0 and sum(r.get("decision") == "probe" for r in stopped) < 9
    resumed = resume(run_dir, *SHORT, *search, "--probe-seconds", "0.2")
    assert [r["decision"] for r in resumed if r.get("event") == "optimizer"][-1] == "choice"
    assert resumed[-1]["event"] == "summary" and resumed[-1]["iterations"] > 0


@pytest.mark.slow
def test_a_signal_during_a_retune_stops_at_that_step_and_the_resumed_run_trains_on(tmp_path):
    run_dir = tmp_path / "run"
    search = ["--algorithm", "omnivore", "--groups", "auto", "--probe-seconds", "0.5", "--optimizer-epoch", "2"]
    job = start(train_command(run_dir, *LONG, *search))

    def retuning(record: dict) -> bool:
        decisions = [r.get("decision") for r in records(run_dir)]
        return "choice" in decisions and decisions[decisions.index("choice") + 1 :].count("probe") > 0

    wait_for_record(job, run_dir, retuning)
    out, err, seconds = stop_with(job, signal.SIGUSR1)
    assert_stopped(run_dir, out, err, seconds, job.returncode)
    stopped = records(run_dir)
    assert not any(r.get("decision") == "retune" for r in stopped) and stopped[-1]["iteration"] > 0
    assert resume(run_dir, *SHORT, *search)[-1]["event"] == "summary"


@pytest.mark.slow
def test_a_signal_before_training_stops_with_a_checkpoint_of_iteration_0(tmp_path):
    run_dir = tmp_path / "run"
    job = start(train_command(run_dir, *LONG))
    deadline = time.monotonic() + 60
    while not catch_sigusr1(job.pid):  # then the ranks import torch, start MPI and load the data
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.01)
    out, err, seconds = stop_with(job, signal.SIGUSR1)
    assert_stopped(run_dir, out, err, seconds, job.returncode)
    assert records(run_dir) == [records(run_dir)[-1]] and records(run_dir)[-1]["iteration"] == 0
    assert resume(run_dir, *SHORT)[-1]["event"] == "summary"


def catch_sigusr1(launcher: int) -> bool:
    """Tell whether the launcher started its two ranks and each has a handler for SIGUSR1."""
    ranks = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    caught = []
    for pid in ranks:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        mask = int(status.split("SigCgt:")[1].split()[0], 16)
        caught.append(bool(mask >> (signal.SIGUSR1 - 1) & 1))
    return len(caught) == 2 and all(caught)


def local_sh(tmp_path) -> tuple[list[str], dict]:
    """launch/local.sh in a copy of launch/ whose setup.sh does nothing, and an environment for it."""
    root = tmp_path / "root"
    shutil.copytree(REPO / "launch", root / "launch")
    (root / "launch" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "activate").write_text("")
    env = dict(
        ENV,
        CROSSBOW_VENV=str(root / "venv"),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    return ["bash", str(root / "launch" / "local.sh")], env


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["TERM", "ctrl-c"])
def test_sigterm_and_ctrl_c_to_local_sh_checkpoint_and_exit_75(tmp_path, signum, group):
    run_dir = tmp_path / "run"
    command, env = local_sh(tmp_path)
    job = start([*command, "--run-dir", str(run_dir), *LONG], env)
    wait_for_record(job, run_dir, lambda r: "test_accuracy" in r)
    out, err, seconds = stop_with(job, signum, group)
    assert_stopped(run_dir, out, err, seconds, job.returncode)
    assert records(run_dir)[-1]["iteration"] > 0
    assert resume(run_dir, *SHORT)[-1]["event"] == "summary"


@pytest.mark.slow
def test_stale_checkpoint_temporaries_are_removed_at_start_and_nothing_else(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = run_dir / "checkpoint-000000040.h5.tmp"
    others = [run_dir / "notes.h5.tmp", run_dir / "checkpoint-000000040.h5.tmp.keep", run_dir / "checkpoint-4.h5.tmp"]
    for path in [stale, *others]:
        path.write_bytes(b"partial")
    done = run_job(2, ["--run-dir", str(run_dir), *SHORT], timeout=180)
    assert done.returncode == 0, done.stderr
    assert not stale.exists() and all(path.exists() for path in others)
    assert "removed checkpoint-000000040.h5.tmp" in done.stderr
    stale.write_bytes(b"partial")
    resume(run_dir, *SHORT)
    assert not stale.exists() and all(path.exists() for path in others)


@pytest.mark.slow
def test_ctrl_c_to_a_single_process_run_checkpoints_and_exits_75(tmp_path):
    run_dir = tmp_path / "run"
    job = start([sys.executable, "-m", "crossbow_mpi.train", "--run-dir", str(run_dir), *LONG])
    wait_for_record(job, run_dir, lambda r: "test_accuracy" in r)
    out, err, seconds = stop_with(job, signal.SIGINT, group=True)
    assert_stopped(run_dir, out, err, seconds, job.returncode)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
