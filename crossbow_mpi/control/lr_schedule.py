"""Learning-rate schedule on top of the base learning rate: linear warm-up (by epochs, from `warmup_start`·lr, or by
iterations, from lr/warmup_steps), then step drops at given epochs, a constant rate, or a cosine decay to 0 over the
run's epochs (Loshchilov and Hutter's SGDR without restarts, as torch.optim.lr_scheduler.CosineAnnealingLR), and
HeteroGPU's time-based decay (`GPUGDScheduler.cu`: lr·1/(1 + decay·(epoch − warm-up epochs)))."""

from __future__ import annotations

import math

from crossbow_mpi.config import Config


def learning_rate(base_lr: float, config: Config, epoch_progress: float, iteration: int = 0) -> tuple[float, int]:
    """Return the learning rate at a (fractional) epoch and global iteration, and the number of drops passed."""
    drops = sum(epoch_progress >= step for step in config.lr_steps)
    lr = base_lr * config.lr_gamma**drops
    if config.lr_schedule == "cosine":
        lr *= 0.5 * (1 + math.cos(math.pi * min(epoch_progress / config.epochs, 1.0)))
    if epoch_progress < config.warmup_epochs:
        start = config.warmup_start
        lr *= start + (1 - start) * epoch_progress / config.warmup_epochs
    else:
        lr /= 1 + config.lr_decay * (epoch_progress - config.warmup_epochs)
    if iteration < config.warmup_steps:
        lr *= (iteration + 1) / config.warmup_steps
    return lr, drops


class Schedule:
    """Give each step its learning rate from the run's base `hp.lr`; at a drop, let the algorithm react."""

    def __init__(self, config: Config):
        self.config = config

    def current_lr(self, run) -> float:
        """Return the learning rate at the run's position."""
        return learning_rate(run.hp.lr, self.config, run.epoch_progress, run.state.iteration)[0]

    def step_lr(self, run) -> tuple[float, bool]:
        """Return the next step's learning rate and whether a drop happens before it."""
        lr, drops = learning_rate(run.hp.lr, self.config, run.epoch_progress, run.state.iteration)
        dropped = drops != run.state.drops
        if dropped:
            run.engine.synchronize()
            run.algorithm.on_lr_drop()
            run.state.drops = drops
        return lr, dropped
