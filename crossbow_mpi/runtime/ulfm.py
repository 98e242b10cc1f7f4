"""Surviving a lost rank with ULFM (User-Level Failure Mitigation, the MPI Forum's fault-tolerance proposal that
Open MPI 5 implements under `mpirun --with-ft ulfm`): tell a rank loss from other MPI errors, revoke the scopes,
shrink the world to its survivors, and the test-only kill injection and step stamps."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from crossbow_mpi.runtime import process
from crossbow_mpi.tensor_bytes import to_bytes

EXIT_RANK_LOST = 75
"""Exit code of a job that lost ranks and cannot go on (fewer than --min-ranks left, or a pipeline): resume it
with --resume, which reshards to the ranks it is given (75 is also the code of a preempted run)."""
KILL_VARIABLE = "CROSSBOW_KILL_AT"
"""Test-only fault injection: `R:I[,R:I…]` makes COMM_WORLD rank R SIGKILL itself before iteration I; `R:I:S`, in
iteration I (an asynchronous algorithm's round) after its S-th local step there (its update applied)."""
STAMPS_VARIABLE = "CROSSBOW_STEP_STAMPS"
"""Benchmark-only: a file to which COMM_WORLD rank 0 appends `iteration samples unix-seconds` before each step, so
that benchmarks/faults.py can tell how long a fault kept a run from the progress it had made."""

_rank: int | None = None
"""This process's rank among the survivors, once the world was shrunk."""


class RankLost(Exception):
    """The job lost ranks and this run cannot continue on the survivors."""


def is_rank_loss(err: BaseException | None) -> bool:
    """Tell whether an MPI error says that a peer died, or that a survivor revoked the scope after seeing one;
    also an error raised from one (a thread's, such as the model server's, raised again by the main thread)."""
    MPI = process.mpi()
    failures = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    if isinstance(err, MPI.Exception):
        return err.Get_error_class() in failures
    return err is not None and is_rank_loss(err.__cause__)


def revoke(comms) -> None:
    """Revoke every MPI communicator given, so that every survivor blocked in any of them returns an error."""
    MPI = process.mpi()
    for comm in comms:
        with contextlib.suppress(MPI.Exception):  # already revoked
            comm.Revoke()


def shrink(world) -> tuple[object, list[int]]:
    """Return the communicator of the survivors of `world` (collective over them), and the COMM_WORLD ranks of
    the ranks that `world` held and the survivors do not."""
    global _rank
    MPI = process.mpi()
    survivors = world.Shrink()
    _rank = survivors.Get_rank()
    base = MPI.COMM_WORLD.Get_group()
    before = MPI.Group.Translate_ranks(world.Get_group(), list(range(world.Get_size())), base)
    after = MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())), base)
    return survivors, sorted(set(before) - set(after))


def shrunk() -> bool:
    """Tell whether this process's world was shrunk: MPI_Finalize is then skipped, since its collective
    teardown over COMM_WORLD, which still names the dead ranks, is not what ULFM guarantees."""
    return _rank is not None


def leader(world_rank: int) -> bool:
    """Tell whether this process speaks for the job: rank 0 of the survivors, or of COMM_WORLD before a loss."""
    return (world_rank if _rank is None else _rank) == 0


def digest(tensor: torch.Tensor) -> str:
    """Return the SHA-256 of a tensor's bytes."""
    return hashlib.sha256(to_bytes(tensor)).hexdigest()


def inject_kill(iteration: int, step: int = 0, environ=os.environ) -> None:
    """SIGKILL this process when `CROSSBOW_KILL_AT` names its COMM_WORLD rank, this iteration and this rank's
    local steps in it so far (`step`; 0 and absent: before the iteration)."""
    spec = environ.get(KILL_VARIABLE)
    if not spec:
        return
    rank = process.mpi().COMM_WORLD.Get_rank()
    for item in spec.split(","):
        target, at, *within = (int(part) for part in item.split(":"))
        if (target, at, *(within or [0])) == (rank, iteration, step):
            os.kill(os.getpid(), signal.SIGKILL)


def stamp_step(iteration: int, samples: int, environ=os.environ) -> None:
    """On COMM_WORLD rank 0, append this step's line to the file `CROSSBOW_STEP_STAMPS` names, if any."""
    path = environ.get(STAMPS_VARIABLE)
    if path and process.mpi().COMM_WORLD.Get_rank() == 0:
        with open(path, "a") as stamps:
            stamps.write(f"{iteration} {samples} {time.time():.6f}\n")


class Rollback:
    """Copies of the run's state (when `enabled`) before every `every`-th step and before the first step after
    `keep_next`, the last two of them. A collective can complete on some survivors and fail on others, so
    survivors may be one step apart: the newest copy that every survivor holds is one of these."""

    def __init__(self, enabled: bool, every: int = 1) -> None:
        self.enabled, self.every = enabled, every
        self.snapshots: dict[int, dict] = {}
        self.due = True

    def keep_next(self) -> None:
        """Copy the state before the next step, whatever its iteration (after records or a checkpoint were
        written, so that a rollback never takes the run back behind them)."""
        self.due = True

    def before_step(self, iteration: int, snapshot: Callable[[dict | None], dict], samples: int = 0) -> None:
        """When enabled and due, keep `snapshot(into)`, the state before this iteration's step (sharing nothing with
        the live run: `Run.detached_snapshot`; `into`: a copy dropped here, whose tensors it may reuse), and the
        newest copy before it; then stamp the step (`samples`: trained on so far) and inject the test's kill, if any
        (both also when not enabled: benchmarks/faults.py kills aborting runs)."""
        if self.enabled and (self.due or iteration % self.every == 0):
            previous = max((i for i in self.snapshots if i < iteration), default=None)
            dropped = [held for i, held in self.snapshots.items() if i != previous]
            self.snapshots = {} if previous is None else {previous: self.snapshots[previous]}
            self.snapshots[iteration] = snapshot(dropped[-1] if dropped else None)
            self.due = False
        stamp_step(iteration, samples)
        inject_kill(iteration)

    def common(self, world) -> int:
        """Return the newest iteration whose copy every rank of `world` holds (-1: none; collective)."""
        held = [set(iterations) for iterations in world.allgather_json(sorted(self.snapshots))]
        return max(set.intersection(*held), default=-1)

    def at(self, iteration: int) -> dict:
        """Return a copy of the state before `iteration`'s step (a restore may keep its tensors; those kept here
        are reused), and copy the state before the next step."""
        self.due = True
        return copy_state(self.snapshots[iteration])


def copy_state(state: Any, into: Any = None) -> Any:
    """Return a deep copy of `state` whose tensors are clones: a view copies its own elements, where `copy.deepcopy`
    copies its view's whole storage (the flat buffer) once per view; a list of numbers (a generator's state) is
    copied whole. A tensor is copied into its place in `into` (a copy of a like state that nothing else holds)
    where one of its shape, type and device is there: no memory to allocate and fault in."""
    if isinstance(state, torch.Tensor):
        if isinstance(into, torch.Tensor) and (into.shape, into.dtype, into.device) == (
            state.shape,
            state.dtype,
            state.device,
        ):
            return into.copy_(state)
        return state.detach().clone()
    if type(state) in ATOMS:
        return state
    if type(state) is dict:
        into = into if type(into) is dict else {}
        return {key: copy_state(value, into.get(key)) for key, value in state.items()}
    if type(state) in (list, tuple):
        if set(map(type, state)) <= ATOMS:  # a set of the types: 3x faster than a generator over 6,000 numbers
            return type(state)(state)
        places = into if type(into) is type(state) and len(into) == len(state) else [None] * len(state)
        return type(state)(copy_state(value, place) for value, place in zip(state, places, strict=True))
    return copy.deepcopy(state)


ATOMS = frozenset((int, float, bool, str, type(None)))
