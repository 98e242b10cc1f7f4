"""Injected load imbalance, for tests and benchmarks of straggler-tolerant algorithms.

random:MS[:N]          every step, N ranks (default: 1 or 2, drawn) chosen by a shared-seed RNG sleep MS ms
slow-rank:R:FACTOR     rank R takes FACTOR times as long as its own compute on every step
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from crossbow_mpi.config import ConfigError


@dataclass(frozen=True)
class Imbalance:
    """A rule saying how long each rank sleeps after computing its gradients at a step."""

    kind: str
    milliseconds: float = 0.0
    count: int | None = None
    slow_rank: int = 0
    factor: float = 1.0
    seed: int = 0

    def delay(self, iteration: int, rank: int, world_size: int, compute_seconds: float) -> float:
        """Return the seconds this rank sleeps at this iteration (the same draw on every rank)."""
        if self.kind == "slow-rank":
            return (self.factor - 1.0) * compute_seconds if rank == self.slow_rank else 0.0
        draw = random.Random(self.seed * 1_000_003 + iteration)
        count = self.count if self.count is not None else draw.randint(1, 2)
        slow = draw.sample(range(world_size), min(count, world_size))
        return self.milliseconds / 1000.0 if rank in slow else 0.0


def parse_imbalance(spec: str, seed: int, world_size: int | None = None) -> Imbalance | None:
    """Parse `--inject-imbalance`; None for an empty spec; ConfigError naming what is wrong."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        if parts[0] == "random" and len(parts) in (2, 3):
            imbalance = Imbalance(
                "random", milliseconds=float(parts[1]), count=int(parts[2]) if len(parts) == 3 else None, seed=seed
            )
            if imbalance.milliseconds < 0 or (imbalance.count is not None and imbalance.count < 1):
                raise ValueError
        elif parts[0] == "slow-rank" and len(parts) == 3:
            imbalance = Imbalance("slow-rank", slow_rank=int(parts[1]), factor=float(parts[2]), seed=seed)
            if imbalance.slow_rank < 0 or imbalance.factor < 1:
                raise ValueError
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--inject-imbalance: invalid value {spec!r} "
            "(expected random:MS[:N] or slow-rank:R:FACTOR with FACTOR >= 1)"
        ) from None
    if world_size is not None and imbalance.kind == "slow-rank" and imbalance.slow_rank >= world_size:
        raise ConfigError(f"--inject-imbalance: rank {imbalance.slow_rank} does not exist in a job of {world_size}")
    return imbalance
