"""Training algorithms by name."""

from crossbow_mpi.algorithms.base import Algorithm
from crossbow_mpi.algorithms.eager import EagerSGD
from crossbow_mpi.algorithms.hogbatch import Hogbatch
from crossbow_mpi.algorithms.omnivore import Omnivore
from crossbow_mpi.algorithms.sma import SynchronousModelAveraging
from crossbow_mpi.algorithms.ssgd import SynchronousSGD

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (SynchronousSGD, SynchronousModelAveraging, EagerSGD, Omnivore, Hogbatch)
}

__all__ = ["ALGORITHMS", "Algorithm", "EagerSGD", "Hogbatch", "Omnivore", "SynchronousModelAveraging", "SynchronousSGD"]
