"""Training algorithms by name."""

from crossbow_mpi.algorithms.base import Algorithm
from crossbow_mpi.algorithms.eager import EagerSGD
from crossbow_mpi.algorithms.elastic import ElasticAveraging
from crossbow_mpi.algorithms.hogbatch import Hogbatch
from crossbow_mpi.algorithms.omnivore import Omnivore
from crossbow_mpi.algorithms.sma import SynchronousModelAveraging
from crossbow_mpi.algorithms.ssgd import SynchronousSGD

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (SynchronousSGD, SynchronousModelAveraging, EagerSGD, Omnivore, Hogbatch, ElasticAveraging)
}

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "EagerSGD",
    "ElasticAveraging",
    "Hogbatch",
    "Omnivore",
    "SynchronousModelAveraging",
    "SynchronousSGD",
]
