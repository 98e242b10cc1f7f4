"""Two nodes × two ranks on one machine: nodes made of network and UTS namespaces (launch/netns_nodes.sh), started
by Open MPI's mpirun from a hostfile through that script instead of ssh. Needs root, iproute2 and Open MPI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from crossbow_mpi.runtime.ulfm import KILL_VARIABLE

from helpers import REPO

pytestmark = pytest.mark.slow

NODES = 2
RANKS_PER_NODE = 2
SCRIPT = REPO / "launch" / "netns_nodes.sh"
TRAIN = ["--dataset", "synthetic-mnist", "--model", "mlp", "--learners", "2", "--eval-every", "3000"]
TARGET = 0.5


class Cluster:
    """The namespaces of one test: `PREFIX-head`, where mpirun runs, and nodes `PREFIX-0`, `PREFIX-1`."""

    def __init__(self, tmp_path):
        self.prefix = f"cbt{os.getpid() % 100000}"
        self.subnet = f"10.214.{os.getpid() % 250}"
        self.hostfile = tmp_path / "hostfile"
        self.hostfile.write_text("".join(f"{self.prefix}-{i} slots={RANKS_PER_NODE}\n" for i in range(NODES)))

    def script(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)

    def mpirun(self, args: list[str]) -> list[str]:
        """Return the command that runs `python ARGS` on every slot of the hostfile, from the head namespace."""
        network = f"{self.subnet}.0/24"
        return [
            "bash", str(SCRIPT), "head", self.prefix,
            shutil.which("mpirun"), "-n", str(NODES * RANKS_PER_NODE), "--hostfile", str(self.hostfile),
            "--mca", "plm_rsh_agent", f"{SCRIPT} rsh",
            "--mca", "oob_tcp_if_include", network, "--mca", "btl_tcp_if_include", network,
            sys.executable, *args,
        ]  # fmt: skip

    def run(self, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(self.mpirun(args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ENV)
        assert done.returncode == 0, done.stderr[-3000:]
        return done


ENV = dict(
    os.environ,
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    PYTHONUNBUFFERED="1",
    PYTHONPATH=str(REPO),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("no `ip` (iproute2) or `unshare` on PATH")
    mpirun = shutil.which("mpirun")
    if mpirun is None or "Open MPI" not in subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout:
        pytest.skip("the namespace nodes are reached through Open MPI's plm_rsh_agent")
    nodes = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        made = nodes.script("up", nodes.prefix, str(NODES), nodes.subnet)
        if made.returncode != 0:
            pytest.skip(f"cannot make network namespaces: {made.stderr.strip().splitlines()[-1:]}")
        yield nodes
    finally:
        nodes.script("down", nodes.prefix, str(NODES))


def summary_and_z(run_dir):
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    with h5py.File(sorted(run_dir.glob("checkpoint-*.h5"))[-1]) as f:
        return summary, f["central/z"][...]


def test_each_node_numbers_its_ranks_from_zero(cluster):
    probe = (
        "import socket; from crossbow_mpi.runtime import process; "
        "print(socket.gethostname(), process.node_placement(process.mpi().COMM_WORLD)[0], flush=True)"
    )
    lines = cluster.run(["-c", probe], timeout=120).stdout.split("\n")
    placed = sorted(line.split() for line in lines if line.startswith(cluster.prefix))
    assert placed == [[f"{cluster.prefix}-{n}", str(r)] for n in range(NODES) for r in range(RANKS_PER_NODE)]


def test_auto_sums_by_node_reaches_the_target_and_equals_the_flat_sum(cluster, tmp_path):
    results = {}
    for hierarchy in ("auto", "flat"):
        run_dir = tmp_path / hierarchy
        # lr 0.05 reaches the target in about 0.15 epochs, lr 0.01 (the default) in 0.35
        args = ["--run-dir", str(run_dir), "--hierarchy", hierarchy, "--target-accuracy", str(TARGET), "--epochs", "1"]
        args += ["--lr", "0.05"]
        cluster.run(["-m", "crossbow_mpi.train", *TRAIN, *args])
        results[hierarchy] = summary_and_z(run_dir)
    (by_node, z_by_node), (flat, z_flat) = results["auto"], results["flat"]
    assert by_node["hierarchy"] == "node" and flat["hierarchy"] == "flat"
    assert by_node["reached"] and by_node["final_test_accuracy"] >= TARGET
    assert by_node["iterations"] == flat["iterations"]
    np.testing.assert_array_equal(z_by_node, z_flat)  # two ranks per node, two nodes: the same additions


def test_losing_a_node_ends_the_job_within_30_seconds(cluster, tmp_path):
    run_dir = tmp_path / "lost"
    args = ["-m", "crossbow_mpi.train", *TRAIN, "--run-dir", str(run_dir), "--epochs", "50", "--target-accuracy", "0"]
    job = subprocess.Popen(cluster.mpirun(args), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "config.json").exists():  # every rank passed its start-up checks
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.5)
        time.sleep(3)
        assert cluster.script("kill", f"{cluster.prefix}-1").returncode == 0
        killed = time.monotonic()
        job.wait(timeout=60)
        ended = time.monotonic() - killed
        stderr = job.stderr.read().decode()
        # Open MPI's launcher ends the job on losing a node's daemon, saying so; its own exit status is then
        # sometimes 0 (seen with Open MPI 5.0.11), so its message counts as the failure it reports.
        reported = job.returncode != 0 or "lost communication with a remote daemon" in stderr
        assert ended < 30 and reported, stderr[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()


def test_the_ranks_of_a_node_killed_under_ulfm_leave_the_other_node_training(cluster, tmp_path):
    # Killing the whole namespace node (its Open MPI daemon too) ends the job even under --with-ft ulfm with the
    # 5.0.11 wheel (docs/clusters.md): what survives is the loss of every rank of a node, its daemon alive.
    run_dir = tmp_path / "survived"
    args = ["-m", "crossbow_mpi.train", *TRAIN, "--run-dir", str(run_dir), "--epochs", "0.05", "--target-accuracy", "0"]
    command = cluster.mpirun([*args, "--on-rank-loss", "continue", "--algorithm", "ssgd"])
    at = command.index("--hostfile")
    command[at:at] = ["--with-ft", "ulfm", "-x", KILL_VARIABLE]
    env = dict(ENV, **{KILL_VARIABLE: "2:5,3:5"})  # node 1's ranks
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lost = [r for r in records if r.get("event") == "rank_lost"]
    assert sorted(rank for r in lost for rank in r["ranks"]) == [2, 3] and lost[-1]["world_size"] == 2, lost
    assert records[-1]["event"] == "summary" and records[-1]["world_size"] == 2
