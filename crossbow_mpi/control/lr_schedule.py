"""Learning-rate schedule: linear warm-up, then step drops at given epochs and HeteroGPU's time-based decay
(`GPUGDScheduler.cu`: lr·1/(1 + decay·(epoch − warm-up epochs))), on top of the base learning rate."""

from __future__ import annotations

from crossbow_mpi.config import Config


def learning_rate(base_lr: float, config: Config, epoch_progress: float) -> tuple[float, int]:
    """Return the learning rate at a (fractional) epoch and the number of drops passed so far."""
    drops = sum(epoch_progress >= step for step in config.lr_steps)
    lr = base_lr * config.lr_gamma**drops
    if epoch_progress < config.warmup_epochs:
        start = config.warmup_start
        lr *= start + (1 - start) * epoch_progress / config.warmup_epochs
    else:
        lr /= 1 + config.lr_decay * (epoch_progress - config.warmup_epochs)
    return lr, drops


class Schedule:
    """Give each step its learning rate from the run's base `hp.lr`; at a drop, let the algorithm react."""

    def __init__(self, config: Config):
        self.config = config

    def current_lr(self, run) -> float:
        """Return the learning rate at the run's position."""
        return learning_rate(run.hp.lr, self.config, run.epoch_progress)[0]

    def step_lr(self, run) -> tuple[float, bool]:
        """Return the next step's learning rate and whether a drop happens before it."""
        lr, drops = learning_rate(run.hp.lr, self.config, run.epoch_progress)
        dropped = drops != run.state.drops
        if dropped:
            run.engine.synchronize()
            run.algorithm.on_lr_drop()
            run.state.drops = drops
        return lr, dropped
