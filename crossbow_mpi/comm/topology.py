"""The job's process scopes, built once: who controls, who averages one model, who steps together, who holds
which part of one model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from crossbow_mpi.comm import Communicator, MpiCommunicator
from crossbow_mpi.config import ConfigError


@dataclass(frozen=True)
class Topology:
    """Named scopes of the ranks; every component receives only the scope it needs.

    Today every rank holds a whole model, so `data` spans the world and `stage` is this rank alone; `group` spans
    the world too, except with Omnivore's compute groups (`grouped`).
    """

    world: Communicator
    """Control plane: every rank (configuration checks, stop votes, heartbeats, checkpoints, the tuner)."""
    data: Communicator
    """The ranks that average one model (shard): the transport of the sync, the sampler's and evaluation's scope."""
    group: Communicator
    """The ranks that take each step together (a compute group)."""
    stage: Communicator
    """The ranks that hold the stages of one model replica."""
    local_rank: int
    """This rank's index among the ranks of its node."""
    local_size: int
    """How many ranks run on this node."""

    @classmethod
    def data_parallel(cls, world: MpiCommunicator, data: Communicator, local_rank: int, local_size: int) -> Topology:
        """Return the topology where every rank holds a whole model and `data` (world's ranks) averages them."""
        assert data.size == world.size
        return cls(
            world=world,
            data=data,
            group=data,
            stage=world.split(world.rank),
            local_rank=local_rank,
            local_size=local_size,
        )

    @classmethod
    def pipeline(
        cls,
        world: MpiCommunicator,
        stages: int,
        data_comm: Callable[[object], Communicator],
        local_rank: int,
        local_size: int,
    ) -> Topology:
        """Return the topology of world.size / stages pipelines, each on `stages` consecutive ranks: `stage` holds
        one pipeline's ranks in stage order, `data` (built by `data_comm` from an MPI communicator) the ranks
        that hold the same stage; ValueError when the stages do not divide the ranks."""
        if world.size % stages:
            raise ValueError(f"--pipeline-stages {stages} does not divide the {world.size} ranks")
        return cls(
            world=world,
            data=data_comm(world.mpi_comm.Split(world.rank % stages, world.rank)),
            group=world,
            stage=world.split(world.rank // stages, world.rank),
            local_rank=local_rank,
            local_size=local_size,
        )

    @classmethod
    def grouped(
        cls, world: MpiCommunicator, data: Communicator, groups: int, local_rank: int, local_size: int
    ) -> Topology:
        """Return the data-parallel topology with `groups` compute groups of consecutive ranks (collective);
        ConfigError, the same on every rank, when they do not split the ranks evenly."""
        if world.size % groups:
            raise ConfigError(f"--groups {groups} does not divide the {world.size} ranks into equal groups")
        topology = cls.data_parallel(world, data, local_rank, local_size)
        group = world.split(world.rank // (world.size // groups), world.rank)
        return dataclasses.replace(topology, group=group)

    def close(self) -> None:
        """Release what the scopes hold beside MPI (NCCL communicators), each scope once (collective)."""
        for scope in {id(scope): scope for scope in (self.data, self.group, self.stage)}.values():
            scope.close()
