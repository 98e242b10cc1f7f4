"""Run pytest on every rank of an MPI job; ranks other than 0 print only when they fail."""

import os
import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, as `python -m pytest` has it
rank = MPI.COMM_WORLD.Get_rank()
args = [*sys.argv[1:], "-p", "no:cacheprovider"]
if rank == 0:
    sys.exit(pytest.main(args))
with tempfile.TemporaryFile("w+") as log:
    os.dup2(log.fileno(), sys.stdout.fileno())
    code = pytest.main(args)
    sys.stdout.flush()
    if code != 0:
        log.seek(0)
        sys.stderr.write(f"[rank {rank}] pytest exited {code}:\n{log.read()}")
    sys.exit(code)
