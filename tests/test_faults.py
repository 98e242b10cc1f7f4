"""Preemption and divergence through the command line: a distinct exit code, a checkpoint, nothing lost."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from helpers import REPO, mpirun_command, run_job

pytestmark = pytest.mark.slow

RUN = [
    "--dataset",
    "synthetic-mnist",
    "--model",
    "mlp",
    "--epochs",
    "0.3",
    "--eval-every",
    "1000",
    "--target-accuracy",
    "0",
    "--learners",
    "2",
]


def final_z(run_dir):
    newest = sorted(run_dir.glob("checkpoint-*.h5"))[-1]
    with h5py.File(newest) as f:
        return f["central/z"][...], json.loads(f["train"].attrs["state"])["iteration"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final model and iteration count of an uninterrupted run of RUN."""
    run_dir = tmp_path_factory.mktemp("whole")
    whole = run_job(2, ["--run-dir", str(run_dir), *RUN], timeout=180)
    assert whole.returncode == 0, whole.stderr
    return final_z(run_dir)


def start_job(run_dir, *extra):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    cmd = [*mpirun_command(2), sys.executable, "-m", "crossbow_mpi.train", "--run-dir", str(run_dir), *RUN, *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(job, path):
    deadline = time.monotonic() + 90
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)


def resume_matches(run_dir, uninterrupted):
    resumed = run_job(2, ["--run-dir", str(run_dir), "--resume", *RUN], timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    z_resumed, iterations = final_z(run_dir)
    z_whole, whole_iterations = uninterrupted
    assert iterations == whole_iterations
    assert np.array_equal(z_resumed, z_whole)


def test_killed_rank_ends_the_job_and_resume_is_bit_identical(tmp_path, uninterrupted):
    run_dir = tmp_path / "killed"
    job = start_job(run_dir, "--checkpoint-every", "20")
    try:
        wait_for(job, run_dir / "checkpoint-000000020.h5")
        os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
        killed = time.monotonic()
        job.communicate(timeout=30)
        assert job.returncode != 0
        assert time.monotonic() - killed < 30
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert final_z(run_dir)[1] < uninterrupted[1]
    resume_matches(run_dir, uninterrupted)


def test_stop_signal_checkpoints_exits_75_and_resume_is_bit_identical(tmp_path, uninterrupted):
    stopped = tmp_path / "stopped"
    job = start_job(stopped)
    try:
        wait_for(job, stopped / "metrics.jsonl")
        job.send_signal(signal.SIGUSR1)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 75, err
    assert "continue with --resume" in out
    records = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "preempted"
    assert 0 < final_z(stopped)[1] < uninterrupted[1]
    resume_matches(stopped, uninterrupted)


def test_divergence_names_iteration_and_learners_and_keeps_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "diverged"
    job = run_job(2, ["--run-dir", str(run_dir), "--lr", "1e6", "--checkpoint-every", "2", *RUN], timeout=120)
    assert job.returncode == 3, job.stderr
    ours = [line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi:")]
    assert len(ours) == 1 and "diverged at iteration" in ours[0] and "learner" in ours[0], job.stderr
    assert "Traceback" not in job.stderr
    z, iteration = final_z(run_dir)
    diverged_at = int(ours[0].split("iteration ")[1].split(":")[0])
    assert iteration < diverged_at and np.isfinite(z).all()


def rank_pids(run_dir) -> dict[int, int]:
    """Map each rank of the job writing to run_dir to its process id."""
    pids = subprocess.run(
        ["pgrep", "-f", f"crossbow_mpi.train --run-dir {run_dir}"], capture_output=True, text=True
    ).stdout.split()
    ranks = {}
    for pid in map(int, pids):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(entry.split(b"=")[1])] = pid
    return ranks


def test_a_stopped_rank_is_named_and_the_job_aborts(tmp_path):
    run_dir = tmp_path / "hung"
    job = start_job(run_dir, "--collective-timeout", "4", "--epochs", "5")
    victim = None
    try:
        wait_for(job, run_dir / "metrics.jsonl")
        victim = rank_pids(run_dir)[1]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = job.communicate(timeout=40)
        assert job.returncode != 0
        assert time.monotonic() - stopped < 4 + 20
        assert "collective timeout: rank(s) 1 did not arrive within 4 s" in err, err
    finally:
        if victim is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, sig)
        if job.poll() is None:
            job.kill()
            job.wait()


def test_sigterm_requests_the_same_checkpoint_and_stop_as_sigusr1():
    probe = (
        "import os, signal, time\n"
        "from crossbow_mpi.runtime import process\n"
        "process.install_stop_signals()\n"
        "before = process.stop_requested()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.2)\n"
        "print(before, process.stop_requested())\n"
    )
    assert run_probe(probe) == ["False", "True"]


def run_probe(probe: str) -> list[str]:
    """Run `probe` in a fresh Python; return the words it printed."""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_mpi_start_takes_back_a_stop_signal_replaced_in_c():
    """On a GPU machine a singleton MPI_Init (Open MPI 4.1) loaded LLVM through hwloc's OpenCL plugin, which took
    SIGUSR1 over in C, unseen by `signal.getsignal`, and the stop signal was lost; starting MPI takes it back."""
    probe = (
        "import ctypes, os, signal, sys, time\n"
        "from crossbow_mpi.runtime import process\n"
        "process.install_stop_signals(); ctypes.CDLL(None).signal(signal.SIGUSR1, ctypes.c_void_p(1))\n"  # SIG_IGN
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "lost = not process.stop_requested()\n"
        "assert 'mpi4py.MPI' not in sys.modules\n"
        "process.mpi()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "print(lost, process.stop_requested())\n"
    )
    assert run_probe(probe) == ["True", "True"]


def test_a_launcher_with_llvm_loaded_is_named(tmp_path):
    """A launcher that maps a libLLVM file is named as taking SIGUSR1; another process, or this test's own parent, is
    not."""
    from crossbow_mpi.runtime import process

    library = tmp_path / "libLLVM-16.so.1"
    library.write_bytes(bytes(4096))
    holder = (
        "import mmap, sys, time\n"
        f"library = open({str(library)!r}, 'rb')\n"
        "mapped = mmap.mmap(library.fileno(), 4096, prot=mmap.PROT_READ)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    job = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        name = Path(sys.executable).name[:15]
        assert process.launcher_taking_sigusr1(job.pid, launchers=(name,)) == name
        assert process.launcher_taking_sigusr1(job.pid) is None  # not a launcher that forwards signals
    finally:
        job.kill()
        job.wait()
    assert process.launcher_taking_sigusr1() is None
