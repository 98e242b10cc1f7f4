"""crossbow_mpi: small-batch training with several learners per device and synchronous model averaging."""

from __future__ import annotations

from typing import TYPE_CHECKING

from crossbow_mpi.config import Config, ConfigError

if TYPE_CHECKING:
    from crossbow_mpi.training.trainer import FitResult, Trainer

__all__ = ["Config", "ConfigError", "FitResult", "Trainer"]


def __getattr__(name: str):
    # Imported on first use: `python -m crossbow_mpi.train` installs its signal handlers before torch loads.
    if name in ("FitResult", "Trainer"):
        from crossbow_mpi.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'crossbow_mpi' has no attribute {name!r}")
