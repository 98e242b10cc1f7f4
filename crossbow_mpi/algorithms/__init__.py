"""Training algorithms by name."""

from crossbow_mpi.algorithms.base import Algorithm
from crossbow_mpi.algorithms.sma import SynchronousModelAveraging
from crossbow_mpi.algorithms.ssgd import SynchronousSGD

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (SynchronousSGD, SynchronousModelAveraging)}

__all__ = ["ALGORITHMS", "Algorithm", "SynchronousModelAveraging", "SynchronousSGD"]
