"""Stop signals: SIGTERM, SIGINT and SIGUSR1 become a request to checkpoint and stop. Standard library only, so
that `python -m crossbow_mpi.train` installs the handlers before it imports torch and MPI."""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_stop_requested = threading.Event()


def install_stop_signals() -> None:
    """Turn SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (preemption, SLURM's --signal) into a request to checkpoint and
    stop."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _request_stop)


def reinstall_stop_signals() -> None:
    """Take the stop signals back where Python still holds them: a library loaded later may have replaced the
    handlers in C, unseen by `signal.getsignal` (LLVM, loaded through hwloc's OpenCL plugin by a singleton MPI_Init,
    swallows SIGUSR1 and dies on SIGTERM without a checkpoint)."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is _request_stop:
            signal.signal(signum, _request_stop)


def _request_stop(signum, frame) -> None:
    _stop_requested.set()


def stop_requested() -> bool:
    """Tell whether this process received a stop signal."""
    return _stop_requested.is_set()
