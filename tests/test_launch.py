"""Launching: the world the launcher started, local ranks from MPI, threads from the affinity, and the batch
scripts run with faked schedulers (srun, scontrol, qstat, qsub) that record the commands the scripts build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossbow_mpi.config import ConfigError
from crossbow_mpi.runtime import process

from helpers import REPO, mpirun_command

SHORT_RUN = [
    "--dataset",
    "synthetic-mnist",
    "--model",
    "mlp",
    "--epochs",
    "0.02",
    "--eval-every",
    "0",
    "--target-accuracy",
    "0",
    "--learners",
    "1",
]
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "PRTE_", "MPI_LOCALRANKID")


def clean_env(**extra) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    return env


def our_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("crossbow_mpi:")]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


# --- the MPI world against what the launcher started ---------------------------------------------------------


@pytest.mark.slow
def test_processes_that_did_not_join_one_job_stop_with_one_line(tmp_path):
    # What plain `srun` does with Open MPI 5: every task starts as a one-rank job of its own.
    job = subprocess.run(
        [sys.executable, "-m", "crossbow_mpi.train", "--run-dir", str(tmp_path / "run"), *SHORT_RUN],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=clean_env(SLURM_STEP_NUM_TASKS="4"),
    )
    assert job.returncode == 2, job.stderr
    assert our_lines(job.stderr) == [our_lines(job.stderr)[0]] and "Traceback" not in job.stderr
    assert "SLURM_STEP_NUM_TASKS=4" in job.stderr and "srun --mpi=pmix" in job.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "environ, size",
    [
        ({}, 3),
        ({"SLURM_STEP_NUM_TASKS": "3"}, 3),
        # mpirun inside a Slurm step or allocation: its own variable counts, not the outer launcher's
        ({"OMPI_COMM_WORLD_SIZE": "16", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "32"}, 16),
        ({"PMI_SIZE": "8", "SLURM_STEP_NUM_TASKS": "1"}, 8),
    ],
)
def test_a_world_the_launcher_started_passes(environ, size):
    process.check_world_size(size, environ)


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"SLURM_STEP_NUM_TASKS": "16"}, "SLURM_STEP_NUM_TASKS=16"),
        ({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "1"}, "PMI_SIZE=2"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4"),
    ],
)
def test_a_world_other_than_the_launcher_started_is_refused(environ, named):
    with pytest.raises(ConfigError, match=named):
        process.check_world_size(1, environ)


def test_an_mpi_without_thread_multiple_is_refused_naming_the_cray_setting():
    MPI = process.mpi()
    process.check_thread_level(MPI.THREAD_MULTIPLE)
    with pytest.raises(ConfigError, match=r"MPI_THREAD_SERIALIZED.*MPICH_MAX_THREAD_SAFETY=multiple"):
        process.check_thread_level(MPI.THREAD_SERIALIZED)


# --- local rank from MPI ------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_local_rank_comes_from_mpi_not_an_inherited_slurm_localid(comm, monkeypatch, capsys):
    # mpirun of a Hydra MPI inside sbatch: every rank inherits the batch shell's SLURM_LOCALID=0.
    for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_SIZE", str(comm.size))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    local_rank, local_size, _ = process.node_placement(comm.mpi_comm)
    assert comm.allgather_json([local_rank, local_size]) == [[r, comm.size] for r in range(comm.size)]
    assert capsys.readouterr().err == ""

    # srun whose SLURM_LOCALID disagrees with MPI: MPI wins, and the rank says which variable disagreed.
    local_rank, _, _ = process.node_placement(
        comm.mpi_comm, {"SLURM_STEP_NUM_TASKS": str(comm.size), "SLURM_LOCALID": "0"}
    )
    assert local_rank == comm.rank
    warning = capsys.readouterr().err
    if comm.rank == 0:
        assert warning == ""
    else:
        assert warning.count("\n") == 1 and "SLURM_LOCALID=0" in warning and f"index {comm.rank}" in warning


# --- threads follow the affinity ----------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_cpu_shares_of_a_node_do_not_oversubscribe_its_cpus(comm):
    _, local_size, share = process.node_placement(comm.mpi_comm)
    allowed = comm.allgather_json(sorted(os.sched_getaffinity(0)))
    shares = comm.allgather_json(share)
    assert all(s >= 1 for s in shares)
    assert sum(shares) <= max(len(set().union(*map(set, allowed))), local_size)
    if comm.size == 1:
        assert share == len(os.sched_getaffinity(0))


def restricted_run(tmp_path: Path, name: str, threads: str) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / name
    cmd = [
        "taskset",
        "-c",
        "0",
        *mpirun_command(1),
        sys.executable,
        "-m",
        "crossbow_mpi.train",
        "--run-dir",
        str(run_dir),
        "--threads",
        threads,
        *SHORT_RUN,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=clean_env()), run_dir


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_threads_follow_the_ranks_binding(tmp_path):
    # Open MPI does not bind when told to oversubscribe; taskset restricts the rank to one core instead.
    job, run_dir = restricted_run(tmp_path, "default", "0")
    assert job.returncode == 0, job.stderr
    assert summary(run_dir)["threads_per_rank"] == 1
    assert our_lines(job.stderr) == []

    job, run_dir = restricted_run(tmp_path, "explicit", "2")
    assert job.returncode == 0, job.stderr
    assert summary(run_dir)["threads_per_rank"] == 2
    (warning,) = our_lines(job.stderr)
    assert "--threads 2" in warning and "bound to 1 CPU" in warning
    assert "--bind-to none" in warning and "--map-by slot:PE=2" in warning


# --- the batch scripts, with faked schedulers ---------------------------------------------------------------

SCRIPTS = [
    "launch/setup.sh",
    "launch/local.sh",
    "launch/common.sh",
    "launch/slurm.sbatch",
    "launch/pbs.sh",
    "launch/netns_nodes.sh",
    "launch/gpu_selftest.sh",
    "tests/run.sh",
    "tests/run_mpis.sh",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_pass_shellcheck(script):
    subprocess.run(["bash", "-n", str(REPO / script)], check=True, timeout=30)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    check = subprocess.run(["shellcheck", "-x", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert check.returncode == 0, check.stdout


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
    """Write an executable bash script `name` that logs its arguments, one JSON list per line, to $FAKE_LOG."""
    path = bin_dir / name
    path.write_text(
        "#!/usr/bin/env bash\n"
        f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' {name} \"$@\""
        ' >> "$FAKE_LOG"\n' + body + "\n"
    )
    path.chmod(0o755)


@pytest.fixture
def batch_dir(tmp_path):
    """A submission directory (the scripts run from the repository root: launch/ is linked), an empty venv, and a
    bin/ for the faked tools; returns (directory, environment, log of the faked tools' calls)."""
    (tmp_path / "launch").symlink_to(REPO / "launch")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    (tmp_path / "bin").mkdir()
    log = tmp_path / "calls.jsonl"
    env = clean_env(
        CROSSBOW_VENV=str(tmp_path / "venv"),
        FAKE_LOG=str(log),
        PATH=os.pathsep.join([str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]),
    )
    return tmp_path, env, log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


PREEMPTED = '{"event": "preempted", "iteration": 16, "time_s": 1.0}'
SRUN_ENDINGS = {
    # srun killed a rank in teardown after the checkpoint: the job's code is 137, the record says preempted
    "preempted": f"echo '{PREEMPTED}' >> \"$RUN_DIR/metrics.jsonl\"; exit 137",
    "crashed": "exit 137",
    "pmix": 'echo "$PMIX_MCA_gds" > "$RUN_DIR/pmix_gds"',
}


def run_slurm(batch_dir, ending: str, *args: str, scontrol: str = "", **extra_env: str) -> subprocess.CompletedProcess:
    root, env, _ = batch_dir
    run_dir = root / "runs" / "slurm-42"
    run_dir.mkdir(parents=True, exist_ok=True)
    fake_tool(root / "bin", "srun", SRUN_ENDINGS[ending])
    fake_tool(root / "bin", "scontrol", scontrol)
    env = dict(env, SLURM_JOB_ID="42", SLURM_CPUS_PER_TASK="8", RUN_DIR=str(run_dir), **extra_env)
    return subprocess.run(
        ["bash", "launch/slurm.sbatch", *args], capture_output=True, text=True, timeout=60, cwd=root, env=env
    )


def test_slurm_starts_one_pmix_job_with_its_cpus_and_requeues_on_the_runs_record(batch_dir):
    _, _, log = batch_dir
    job = run_slurm(batch_dir, "preempted", "--learners", "4")
    assert job.returncode == 137
    (srun, requeue) = calls(log)
    assert srun[:5] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "--cpus-per-task=8", "--cpu-bind=cores"]
    train = srun[srun.index("python") :]
    assert train == [
        "python",
        "-m",
        "crossbow_mpi.train",
        "--device",
        "cuda",
        "--threads",
        "8",
        "--run-dir",
        "runs/slurm-42",
        "--learners",
        "4",
    ]
    assert requeue == ["scontrol", "requeue", "42"]


@pytest.mark.parametrize("script", ["launch/local.sh", "launch/slurm.sbatch", "launch/pbs.sh"])
def test_the_scripts_refuse_a_bad_flag_in_one_line_and_start_no_rank(batch_dir, script):
    root, env, log = batch_dir
    (root / "launch").unlink()
    shutil.copytree(REPO / "launch", root / "launch")
    (root / "launch" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    for tool in ("mpirun", "srun", "qsub"):
        fake_tool(root / "bin", tool, "")
    fake_tool(root / "bin", "qstat", 'echo "    Resource_List.walltime = 01:00:00"')
    (root / "nodefile").write_text("node01\n")
    env |= {"SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "8", "PBS_JOBID": "7.server", "PBS_O_WORKDIR": str(root)}
    env |= {"PBS_NODEFILE": str(root / "nodefile"), "TRAIN_ARGS": "--sync-every 0"}
    flags = [] if script.endswith("pbs.sh") else ["--sync-every", "0"]
    job = subprocess.run(["bash", script, *flags], capture_output=True, text=True, timeout=60, cwd=root, env=env)
    assert (job.returncode, job.stdout, job.stderr) == (
        2,
        "",
        "crossbow_mpi: error: --sync-every must be positive, got 0\n",
    )
    assert not [call for call in calls(log) if "crossbow_mpi.train" in call]
    assert {path.name for path in root.iterdir()} <= {"bin", "launch", "nodefile", "venv", "calls.jsonl"}


def test_the_flag_check_passes_good_flags_leaves_help_to_the_ranks_and_refuses_an_unknown_flag(capsys):
    from crossbow_mpi.train import check

    assert check(["--help"]) == 0 and check(["--learners", "4", "--sync-every", "4"]) == 0
    assert capsys.readouterr() == ("", "")
    assert check(["--bogus"]) == 2
    assert capsys.readouterr().err == "crossbow_mpi: error: unrecognized arguments: --bogus\n"


def test_slurm_with_crossbow_ft_starts_mpirun_with_ulfm_in_the_allocation(batch_dir):
    root, _, log = batch_dir
    fake_tool(root / "bin", "mpirun", "exit 0")
    job = run_slurm(batch_dir, "crashed", CROSSBOW_FT="1", SLURM_NTASKS="16", SLURM_NTASKS_PER_NODE="8")
    assert job.returncode == 0, job.stderr
    (mpirun,) = calls(log)
    assert mpirun[:4] == ["mpirun", "--with-ft", "ulfm", "-n"] and "ppr:8:node:PE=8" in mpirun
    assert mpirun[mpirun.index("--run-dir") + 2 : mpirun.index("--run-dir") + 4] == ["--on-rank-loss", "continue"]


def test_slurm_keeps_the_runs_exit_code_when_the_requeue_fails(batch_dir):
    job = run_slurm(batch_dir, "preempted", scontrol="exit 1")
    assert job.returncode == 137, job.stderr
    assert "scontrol requeue 42 failed (exit 1)" in job.stderr and "runs/slurm-42" in job.stderr


def test_slurm_tells_pmix_to_use_the_hash_data_store(batch_dir):
    root, _, _ = batch_dir
    assert run_slurm(batch_dir, "pmix").returncode == 0
    assert (root / "runs" / "slurm-42" / "pmix_gds").read_text().strip() == "hash"


def test_slurm_resumes_and_does_not_requeue_a_crash_after_an_earlier_preemption(batch_dir):
    root, _, log = batch_dir
    run_dir = root / "runs" / "slurm-42"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint-000000016.h5").write_bytes(b"")
    (run_dir / "metrics.jsonl").write_text(PREEMPTED + "\n")
    job = run_slurm(batch_dir, "crashed")
    assert job.returncode == 137
    (srun,) = calls(log)
    assert srun[-1] == "--resume"


def test_slurm_array_task_adds_its_line_of_the_sweep_file(batch_dir):
    root, _, log = batch_dir
    (root / "sweep.txt").write_text("--lr 0.01\n--lr 0.05 --learners 8\n")
    job = run_slurm(batch_dir, "crashed", "--epochs", "10", CROSSBOW_SWEEP="sweep.txt", SLURM_ARRAY_TASK_ID="2")
    assert job.returncode == 137
    (srun,) = calls(log)
    assert srun[-7:] == ["runs/slurm-42", "--epochs", "10", "--lr", "0.05", "--learners", "8"]


PBS_MPIRUN = f"""trap 'echo '"'"'{PREEMPTED}'"'"' >> "$RUN_DIR/metrics.jsonl"; exit 75' USR1
for _ in $(seq 300); do sleep 0.1; done
exit 1"""


def test_pbs_signals_mpirun_before_the_walltime_and_submits_again(batch_dir):
    root, env, log = batch_dir
    nodefile = root / "nodefile"
    nodefile.write_text("node01\n" * 8 + "node02\n" * 8)
    fake_tool(root / "bin", "qstat", 'echo "    Resource_List.walltime = 00:02:03"')
    fake_tool(root / "bin", "qsub", "")
    fake_tool(root / "bin", "mpirun", PBS_MPIRUN)
    run_dir = root / "runs" / "pbs-7"
    run_dir.mkdir(parents=True)
    env = dict(
        env,
        PBS_JOBID="7.server",
        PBS_NODEFILE=str(nodefile),
        PBS_O_WORKDIR=str(root),
        TRAIN_ARGS="--learners 4 --lr 0.05",
        RUN_DIR=str(run_dir),
    )
    started = time.monotonic()
    job = subprocess.run(["bash", "launch/pbs.sh"], capture_output=True, text=True, timeout=60, cwd=root, env=env)
    assert job.returncode == 75, job.stderr
    assert 3 <= time.monotonic() - started < 20  # SIGUSR1 at 123 s - 120 s of margin
    (qstat, mpirun, qsub) = calls(log)
    assert qstat == ["qstat", "-f", "7.server"]
    assert mpirun == [
        "mpirun",
        "-np",
        "16",
        "--hostfile",
        str(nodefile),
        "--map-by",
        "ppr:8:node:PE=8",
        "--bind-to",
        "core",
        "python",
        "-m",
        "crossbow_mpi.train",
        "--device",
        "cuda",
        "--threads",
        "8",
        "--run-dir",
        "runs/pbs-7",
        "--learners",
        "4",
        "--lr",
        "0.05",
    ]
    assert qsub == ["qsub", "-V", "-v", "CROSSBOW_RUN_DIR=runs/pbs-7", "launch/pbs.sh"]


@pytest.mark.slow
def test_pbs_with_open_mpis_mpirun_checkpoints_before_the_walltime(batch_dir):
    # The real mpirun forwards the SIGUSR1 that the script's timeout sends it; the ranks checkpoint, and the
    # script reads their real record. Only the placement flags are dropped (this machine is not 2 x 8 GPUs).
    root, env, log = batch_dir
    nodefile = root / "nodefile"
    nodefile.write_text("localhost\n" * 2)
    fake_tool(root / "bin", "qstat", 'echo "    Resource_List.walltime = 00:02:20"')
    fake_tool(root / "bin", "qsub", "")
    real = " ".join(mpirun_command(2))
    fake_tool(
        root / "bin",
        "mpirun",
        f'while [ "$1" != python ]; do shift; done\nshift; exec {real} {sys.executable} "$@" --device cpu --threads 1',
    )
    env = dict(
        env,
        PBS_JOBID="8.server",
        PBS_NODEFILE=str(nodefile),
        PBS_O_WORKDIR=str(root),
        # far more epochs than fit before the signal, so that the signal always stops the run
        TRAIN_ARGS="--dataset synthetic-mnist --model mlp --epochs 10000 --target-accuracy 0",
    )
    job = subprocess.run(["bash", "launch/pbs.sh"], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert job.returncode == 75, job.stderr
    run_dir = root / "runs" / "pbs-8"
    assert summary(run_dir)["event"] == "preempted"
    assert list(run_dir.glob("checkpoint-*.h5"))
    assert calls(log)[-1] == ["qsub", "-V", "-v", "CROSSBOW_RUN_DIR=runs/pbs-8", "launch/pbs.sh"]


def test_pbs_under_torque_starts_ranks_per_node_times_nodes_not_one_per_core(batch_dir):
    root, env, log = batch_dir
    nodefile = root / "nodefile"
    nodefile.write_text("node01\n" * 64 + "node02\n" * 64)  # Torque: -l nodes=2:ppn=64
    fake_tool(root / "bin", "qstat", 'echo "    Resource_List.walltime = 04:00:00"')
    fake_tool(root / "bin", "mpirun", "exit 0")
    env = dict(env, PBS_JOBID="9.server", PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(root))
    job = subprocess.run(["bash", "launch/pbs.sh"], capture_output=True, text=True, timeout=60, cwd=root, env=env)
    assert job.returncode == 0, job.stderr
    mpirun = calls(log)[1]
    assert mpirun[:3] == ["mpirun", "-np", "16"]


@pytest.mark.parametrize("after", ["", "[teardown] NCCL WARN something printed after the verdict"])
@pytest.mark.parametrize("verdict, code", [("PASS: all parts passed", 0), ("FAIL: 1 failed", 1)])
def test_gpu_selftest_script_finds_the_verdict_wherever_it_stands(batch_dir, verdict, code, after):
    root, env, _ = batch_dir
    (root / "benchmarks").mkdir()
    for tool in ("nvidia-smi", "mpirun"):
        fake_tool(root / "bin", tool, "")
    selftest = f'echo "gpu_selftest: {verdict}"; echo "{after}"; exit {code}'
    fake_tool(root / "bin", "fake-python", f'case "$*" in *benchmarks.gpu_selftest*) {selftest};; esac')
    env = dict(env, PYTHON="fake-python", OUT=str(root / "out"))
    job = subprocess.run(
        ["bash", "launch/gpu_selftest.sh"], capture_output=True, text=True, timeout=60, cwd=root, env=env
    )
    assert job.returncode == code, job.stdout
    assert "crashed" not in job.stdout
