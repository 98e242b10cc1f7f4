"""crossbow_mpi: small-batch training with several learners per device and synchronous model averaging."""

from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.training.trainer import FitResult, Trainer

__all__ = ["Config", "ConfigError", "FitResult", "Trainer"]
