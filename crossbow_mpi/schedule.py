"""Learning-rate schedule: linear warm-up, then step drops at given epochs."""

from __future__ import annotations

from crossbow_mpi.config import Config


def learning_rate(config: Config, epoch_progress: float) -> tuple[float, int]:
    """Return the learning rate at a (fractional) epoch and the number of drops passed so far."""
    drops = sum(epoch_progress >= step for step in config.lr_steps)
    lr = config.lr * config.lr_gamma ** drops
    if epoch_progress < config.warmup_epochs:
        lr *= 0.1 + 0.9 * epoch_progress / config.warmup_epochs
    return lr, drops
