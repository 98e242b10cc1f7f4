"""Process runtime: MPI start-up, abort on failure, device, threads and seeding."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import traceback

import numpy as np
import torch

from crossbow_mpi.config import ConfigError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_stop_requested = threading.Event()

LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID")


def mpi():
    """Return the mpi4py MPI module, initialised with thread support."""
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def install_abort_on_failure() -> None:
    """Make an uncaught exception on any rank or thread abort the whole job instead of hanging it."""
    MPI = mpi()
    rank = MPI.COMM_WORLD.Get_rank()

    def abort(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[rank {rank}] {text}[rank {rank}] aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort
    threading.excepthook = lambda args: abort(args.exc_type, args.exc_value, args.exc_traceback)


def local_rank_and_size(comm) -> tuple[int, int]:
    """Return this rank's index among the ranks of its node, and their number."""
    node = comm.Split_type(mpi().COMM_TYPE_SHARED)
    try:
        local_size = node.Get_size()
        for name in LOCAL_RANK_VARIABLES:
            if name in os.environ:
                return int(os.environ[name]), local_size
        return node.Get_rank(), local_size
    finally:
        node.Free()


def select_device(requested: str, local_rank: int) -> torch.device:
    """Pick this rank's device: its local rank's GPU, or the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_threads(requested: int, local_size: int) -> int:
    """Set torch's intra-op threads: the requested number, or this node's cores shared among its ranks."""
    threads = requested or max(1, (os.cpu_count() or 1) // local_size)
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's global generators from the seed and the rank."""
    value = seed * 1_000_003 + rank
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def install_stop_signals() -> None:
    """Turn SIGTERM and SIGUSR1 (preemption, SLURM's --signal) into a request to checkpoint and stop."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: _stop_requested.set())


def stop_requested() -> bool:
    """Tell whether this rank received a stop signal."""
    return _stop_requested.is_set()


def rng_state() -> dict:
    """Return this process's Python, NumPy and torch generator states as JSON-serialisable values."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else [],
    }


def load_rng_state(state: dict) -> None:
    """Restore the generator states that `rng_state` returned (also after a JSON round trip)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = dict(state["numpy"], state=dict(state["numpy"]["state"]))
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"]:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
