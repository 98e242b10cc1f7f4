"""What differs between MPI implementations (Open MPI's mpirun, MPICH's Hydra, srun): the launcher's variables."""

import os

import pytest

from crossbow_mpi.runtime import launchers, process


@pytest.mark.mpi(min_size=1)
def test_the_launchers_local_rank_variable_is_known_and_agrees_with_mpi(comm):
    launcher = launchers.launcher_variables()
    if launcher is None:
        pytest.skip("not started by a launcher (a singleton MPI process)")
    size_name, local_names = launcher
    assert int(os.environ[size_name]) == comm.size
    local_size = process.node_placement(comm.mpi_comm)[1]
    known = [name for name in local_names if name in os.environ]
    assert known, f"{size_name} is set, but none of {local_names}"
    # one node here: the launcher numbers the node's ranks 0…n−1, in an order that need not be MPI's
    assert sorted(comm.allgather_json(int(os.environ[known[0]]))) == list(range(local_size))


@pytest.mark.mpi(min_size=1)
def test_the_launchers_rank_is_mpis_so_that_a_refused_flag_is_printed_once_before_mpi_starts(comm):
    if launchers.launcher_variables() is None:
        pytest.skip("not started by a launcher (a singleton MPI process)")
    assert launchers.launched() == (comm.rank, comm.size)


def test_a_process_without_a_launchers_rank_is_rank_0_of_1():
    assert launchers.launched({}) == (0, 1)
    assert launchers.launched({"PMI_SIZE": "4", "PMI_RANK": "3", "SLURM_STEP_NUM_TASKS": "1"}) == (3, 4)
    assert launchers.launched({"SLURM_STEP_NUM_TASKS": "2"}) == (0, 2)
