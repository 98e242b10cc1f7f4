"""What the launcher tells a process through its environment. Standard library only, so that
`python -m crossbow_mpi.train` reads it before it imports torch and MPI."""

from __future__ import annotations

import os

LAUNCHERS = (
    ("OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),  # Open MPI's mpirun
    ("PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),  # Hydra (MPICH, Intel MPI) and other PMI launchers
    ("SLURM_STEP_NUM_TASKS", ("SLURM_LOCALID",)),  # srun
)
"""Each launcher's variable for the number of processes it started and its variables for a process's index on
its node; innermost launcher first, since a process also inherits the variables of the launchers around the one
that started it (a batch shell's SLURM_LOCALID=0 reaches every rank that a Hydra mpirun starts in it)."""
RANKS = {"OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "PMI_SIZE": "PMI_RANK", "SLURM_STEP_NUM_TASKS": "SLURM_PROCID"}
"""Each launcher's variable for a process's index among those it started."""


def launcher_variables(environ=os.environ) -> tuple[str, tuple[str, ...]] | None:
    """Return the size and local-rank variable names of the launcher that started this process, if any."""
    return next((launcher for launcher in LAUNCHERS if launcher[0] in environ), None)


def launched(environ=os.environ) -> tuple[int, int]:
    """Return this process's index as its launcher numbered it, and how many it started ((0, 1) without a launcher;
    index 0 where the launcher does not say)."""
    launcher = launcher_variables(environ)
    if launcher is None:
        return 0, 1
    rank = environ.get(RANKS[launcher[0]], "0")
    return int(rank) if rank.isdigit() else 0, int(environ[launcher[0]])
