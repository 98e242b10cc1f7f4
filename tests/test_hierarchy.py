"""Hierarchical averaging (--hierarchy): the node-by-node sum against the flat one, on this machine's one node and
on a pretended split of its ranks into nodes of two ({0, 1}, {2, 3}), at any number of ranks."""

from __future__ import annotations

import json

import pytest
import torch

from crossbow_mpi import Config, Trainer
from crossbow_mpi.comm import MpiCommunicator, build_communicator
from crossbow_mpi.comm.hierarchical import HierarchicalCommunicator
from crossbow_mpi.config import ConfigError

from helpers import datasets, mlp, run_config


def pairs(rank: int) -> int:
    """Pretend that ranks 2i and 2i+1 share node i."""
    return rank // 2


def random_rows(comm, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + comm.rank)
    return torch.randn(numel, generator=generator)


def everyone(comm, tensor: torch.Tensor) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(b), dtype=tensor.dtype) for b in comm.allgather_bytes(tensor.numpy().tobytes())]


@pytest.mark.mpi(min_size=1)
def test_pretended_nodes_of_two_ranks_have_one_leader_each(comm):
    by_node = HierarchicalCommunicator(comm.mpi_comm, pairs)
    assert by_node.nodes == (comm.size + 1) // 2 and by_node.size == comm.size and by_node.rank == comm.rank
    assert by_node.node.allgather_json(comm.rank) == [r for r in range(comm.size) if pairs(r) == pairs(comm.rank)]
    assert (by_node.leaders is not None) == (comm.rank % 2 == 0)
    if by_node.leaders is not None:
        assert by_node.leaders.allgather_json(comm.rank) == list(range(0, comm.size, 2))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("numel", [1000, 300_000])  # small and large messages: MPI picks different algorithms
def test_sum_by_pretended_nodes_adds_each_node_first(comm, numel):
    mine = random_rows(comm, numel)
    rows = everyone(comm, mine)
    per_node = [rows[r] + rows[r + 1] if r + 1 < comm.size else rows[r] for r in range(0, comm.size, 2)]
    expected = per_node[0]
    for node_sum in per_node[1:]:
        expected = expected + node_sum
    reduction = HierarchicalCommunicator(comm.mpi_comm, pairs).allreduce_sum_(mine)
    assert reduction.total is mine and reduction.contributions == comm.size
    assert torch.equal(mine, expected)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("node_of", [pairs, None], ids=["pretended-nodes", "this-machine"])
def test_sum_by_node_equals_the_flat_sum(comm, node_of):
    """Bit for bit where every grouping of the additions is the same sum (two ranks or fewer), else up to
    float32 rounding."""
    flat = random_rows(comm, 300_000)
    by_node = flat.clone()
    MpiCommunicator(comm.mpi_comm).allreduce_sum_(flat)
    HierarchicalCommunicator(comm.mpi_comm, node_of).allreduce_sum_(by_node)
    if comm.size <= 2:
        assert torch.equal(by_node, flat)
    else:
        torch.testing.assert_close(by_node, flat, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(copy, by_node) for copy in everyone(comm, by_node)), "every rank holds the same sum"


@pytest.mark.mpi(min_size=1)
def test_auto_keeps_the_flat_sum_on_one_node_and_node_is_hierarchical(comm):
    cpu = torch.device("cpu")
    assert type(build_communicator(comm.mpi_comm, "mpi", cpu, "auto")) is MpiCommunicator
    assert type(build_communicator(comm.mpi_comm, "mpi", cpu, "flat")) is MpiCommunicator
    node = build_communicator(comm.mpi_comm, "auto", cpu, "node")
    assert isinstance(node, HierarchicalCommunicator) and node.nodes == 1 and node.node.size == comm.size


def test_node_hierarchy_with_nccl_is_a_user_error():
    from helpers import self_comm

    with pytest.raises(ConfigError, match="--hierarchy node sums over MPI"):
        build_communicator(self_comm().mpi_comm, "nccl", torch.device("cpu"), "node")
    with pytest.raises(ConfigError, match="--hierarchy: unknown value 'tree'"):
        Config(hierarchy="tree").validate(["sma"])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["ssgd", "sma"])
def test_training_by_pretended_nodes_equals_flat_training(comm, shared_tmp, algorithm):
    train, test = datasets(comm.size, 2)
    results = {}
    for name, scope in (
        ("flat", MpiCommunicator(comm.mpi_comm)),
        ("node", HierarchicalCommunicator(comm.mpi_comm, pairs)),
    ):
        cfg = run_config(shared_tmp / name, algorithm=algorithm, learners=2)
        results[name] = Trainer(cfg, scope).fit(mlp, train, test).central
        if comm.rank == 0:
            records = [json.loads(line) for line in (shared_tmp / name / "run" / "metrics.jsonl").open()]
            assert records[-1]["hierarchy"] == name
    if comm.size <= 2:
        assert torch.equal(results["node"], results["flat"])
    else:
        torch.testing.assert_close(results["node"], results["flat"], rtol=1e-4, atol=1e-6)
