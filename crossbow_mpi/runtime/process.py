"""Process runtime: MPI start-up and launch checks, abort on failure, placement on the node, device, threads and
seeding."""

from __future__ import annotations

import os
import random
import sys
import threading
import traceback
from typing import Any

import numpy as np
import torch

from crossbow_mpi.config import ConfigError
from crossbow_mpi.data.datasets import DataError
from crossbow_mpi.runtime import signals
from crossbow_mpi.runtime.launchers import launcher_variables
from crossbow_mpi.runtime.signals import install_stop_signals as install_stop_signals
from crossbow_mpi.runtime.signals import stop_requested as stop_requested


def mpi():
    """Return the mpi4py MPI module, initialised with thread support."""
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    starting = "mpi4py.MPI" not in sys.modules
    from mpi4py import MPI

    if starting:
        signals.reinstall_stop_signals()
    return MPI


FORWARDING_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "orted", "prterun", "prted", "hydra_pmi_proxy")
"""The launchers that take a signal and pass it on to the ranks (srun's slurmstepd signals them itself)."""


def launcher_taking_sigusr1(pid: int | None = None, launchers: tuple[str, ...] = FORWARDING_LAUNCHERS) -> str | None:
    """Return the name of the launcher (this process's parent, or process `pid`) when it is one of `launchers` and
    has LLVM loaded, else None. LLVM takes SIGUSR1 over for its own use, so a SIGUSR1 sent to such an mpirun never
    reaches the ranks: Open MPI 4.1's orterun loaded it through hwloc's OpenCL plugin (and pocl) on a GPU machine
    (docs/failures.md)."""
    pid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/comm") as comm:
            name = comm.read().strip()
            return name if name.startswith(launchers) and "/libLLVM" in maps.read() else None
    except OSError:
        return None


def install_abort_on_failure() -> None:
    """Make an uncaught exception on any rank or thread abort the whole job instead of hanging it."""
    MPI = mpi()
    rank = MPI.COMM_WORLD.Get_rank()

    def abort(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        user_error = issubclass(exc_type, (ConfigError, DataError))  # a mistake one rank found alone: one line
        if user_error:
            text = f"crossbow_mpi: error: {exc}\n"
        sys.stderr.write(f"[rank {rank}] {text}[rank {rank}] aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2 if user_error else 1)

    sys.excepthook = abort
    threading.excepthook = lambda args: abort(args.exc_type, args.exc_value, args.exc_traceback)


def check_world_size(size: int, environ=os.environ) -> None:
    """Refuse an MPI world that is not the set of processes the launcher started (each process its own job)."""
    launcher = launcher_variables(environ)
    if launcher is not None and int(environ[launcher[0]]) != size:
        raise ConfigError(
            f"{launcher[0]}={environ[launcher[0]]} processes were launched, but MPI sees a world of "
            f"{size}: they did not join one job; start them with `srun --mpi=pmix` or with the "
            f"mpirun of the MPI that mpi4py was built with"
        )


def check_thread_level(provided: int) -> None:
    """Refuse an MPI without MPI_THREAD_MULTIPLE: the hang watchdog and eager-SGD call MPI from a thread."""
    MPI = mpi()
    if provided < MPI.THREAD_MULTIPLE:
        level = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise ConfigError(
            f"MPI provides MPI_THREAD_{level.get(provided, provided)}, not MPI_THREAD_MULTIPLE, which "
            f"the hang watchdog and eager-SGD need: on Cray MPICH export "
            f"MPICH_MAX_THREAD_SAFETY=multiple, elsewhere use an MPI built with thread support"
        )


def check_launch() -> None:
    """Check at start that the job's MPI world is what the launcher started and that it supports threads."""
    MPI = mpi()
    check_world_size(MPI.COMM_WORLD.Get_size())
    check_thread_level(MPI.Query_thread())


def node_placement(comm, environ=os.environ, shrunk: bool = False) -> tuple[int, int, int]:
    """Return this rank's index among the ranks of its node (as MPI reports it), their number, and its share of
    the CPUs it may run on: each CPU counts as 1/n when n ranks of the node may run on it. Warn where the
    launcher's local ranks disagree with MPI's, unless `comm` holds the survivors of a rank loss (`shrunk`), whose
    launcher numbered the ranks before it."""
    MPI = mpi()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        mine = sorted(os.sched_getaffinity(0))
        width = np.array([mine[-1] + 1], dtype=np.int64)
        node.Allreduce(MPI.IN_PLACE, width, op=MPI.MAX)
        allowed = np.zeros(int(width[0]), dtype=np.int64)
        allowed[mine] = 1
        sharing = np.empty_like(allowed)
        node.Allreduce(allowed, sharing, op=MPI.SUM)
        claimed = np.array([_launcher_local_rank(environ)], dtype=np.int64)
        claims = np.empty(local_size, dtype=np.int64)
        node.Allgather(claimed, claims)
    finally:
        node.Free()
    if not shrunk and (claims >= 0).any() and sorted(claims.tolist()) != list(range(local_size)):
        warn_on_local_rank_disagreement(local_rank, environ)
    return local_rank, local_size, max(1, int(sum(1 / sharing[cpu] for cpu in mine) + 1e-9))


def _launcher_local_rank(environ) -> int:
    """Return the local rank the launcher's variable gives this process, or -1."""
    launcher = launcher_variables(environ)
    name = next((name for name in launcher[1] if name in environ), None) if launcher else None
    return int(environ[name]) if name is not None and environ[name].isdigit() else -1


def warn_on_local_rank_disagreement(local_rank: int, environ=os.environ) -> None:
    """Name the launcher's local-rank variable when it disagrees with MPI's placement of this rank (called when the
    node's ranks do not claim distinct local ranks 0…n−1, e.g. an inherited SLURM_LOCALID=0; a launcher that
    numbers the node's ranks in another order than MPI is not a problem)."""
    launcher = launcher_variables(environ)
    for name in launcher[1] if launcher else ():
        if name in environ and environ[name] != str(local_rank):
            print(
                f"crossbow_mpi: warning: {name}={environ[name]}, but MPI places this rank at index {local_rank} "
                f"among its node's ranks; its GPU and CPU share follow MPI",
                file=sys.stderr,
                flush=True,
            )
            return


def select_device(requested: str, local_rank: int) -> torch.device:
    """Pick this rank's device: its local rank's GPU, or the CPU (`mixed`: the CPU for local ranks beyond the
    node's GPUs)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: no CUDA device is available")
    if requested == "mixed" and local_rank >= torch.cuda.device_count():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_threads(requested: int, cpu_share: int, announce: bool) -> int:
    """Set torch's intra-op threads: the requested number, or this rank's share of the CPUs it may run on; warn
    (when announcing) that more threads than those CPUs share them."""
    cpus = len(os.sched_getaffinity(0))
    if requested > cpus and announce:
        print(
            f"crossbow_mpi: warning: --threads {requested}, but this rank is bound to {cpus} CPU(s), "
            f"so its threads share them; launch with "
            f"`mpirun --bind-to none`, or `--map-by slot:PE={requested}` to bind {requested} cores to each rank",
            file=sys.stderr,
            flush=True,
        )
    threads = requested or cpu_share
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's global generators from the seed and the rank."""
    value = seed * 1_000_003 + rank
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def exit_promptly(code: int, finalize: bool = True) -> None:
    """End this process with `code` as soon as every rank got here: finalize MPI together (unless not
    `finalize`), then skip Python's teardown, so that no rank is still tearing down when the launcher reacts to
    the first non-zero exit (srun --kill-on-bad-exit kills the others, and reports their signal instead of the
    code)."""
    if finalize:
        mpi().Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rng_state() -> dict:
    """Return this process's Python, NumPy and torch generator states, as their own copies (`jsonable` writes
    them as JSON)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def jsonable(value: Any) -> Any:
    """`json.dumps`'s `default` for `rng_state`: NumPy arrays and tensors as lists (kept as arrays otherwise: a
    rollback copies them every step, where a list of their 6,000 numbers took longer)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def load_rng_state(state: dict) -> None:
    """Restore the generator states that `rng_state` returned (also after a JSON round trip)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = dict(state["numpy"], state=dict(state["numpy"]["state"]))
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"]:
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]])
