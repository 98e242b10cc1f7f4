"""What differs between MPI implementations (Open MPI's mpirun, MPICH's Hydra, srun): the launcher's variables."""

import os

import pytest

from crossbow_mpi.runtime import process


@pytest.mark.mpi(min_size=1)
def test_the_launchers_local_rank_variable_is_known_and_agrees_with_mpi(comm):
    launcher = process.launcher_variables()
    if launcher is None:
        pytest.skip("not started by a launcher (a singleton MPI process)")
    size_name, local_names = launcher
    assert int(os.environ[size_name]) == comm.size
    local_size = process.node_placement(comm.mpi_comm)[1]
    known = [name for name in local_names if name in os.environ]
    assert known, f"{size_name} is set, but none of {local_names}"
    # one node here: the launcher numbers the node's ranks 0…n−1, in an order that need not be MPI's
    assert sorted(comm.allgather_json(int(os.environ[known[0]]))) == list(range(local_size))
