"""`--sync-dtype`: the sync message cast for the wire and summed in float32, flat and by node; `comm_bytes`."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from crossbow_mpi import Trainer
from crossbow_mpi.comm import MpiCommunicator
from crossbow_mpi.comm.hierarchical import HierarchicalCommunicator
from crossbow_mpi.comm.int8 import BLOCK, Feedback
from crossbow_mpi.config import ConfigError

from helpers import datasets, digest, mlp, mlp_bn, resume_between_syncs, run_config
from reference import relative_error


def pairs(rank: int) -> int:
    return rank // 2


def everyone(comm, tensor: torch.Tensor) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(b), dtype=tensor.dtype) for b in comm.allgather_bytes(tensor.numpy().tobytes())]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 1001])
@pytest.mark.parametrize("pair, chunk_bytes", [(None, None), (True, None), (True, 40)])
def test_cast_sum_adds_the_cast_payloads_in_float32_and_every_rank_gets_the_same_bits(
    comm, monkeypatch, dtype, numel, pair, chunk_bytes
):
    from crossbow_mpi.comm import mpi

    if chunk_bytes is not None:
        monkeypatch.setattr(mpi, "PAIR_CHUNK_BYTES", chunk_bytes)  # two ranks' exchange in chunks of 20 values
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank)) * 3
    rows = everyone(comm, mine)
    expected = torch.stack([row.to(dtype).float() for row in rows]).sum(0).to(dtype).float()
    reduction = MpiCommunicator(comm.mpi_comm, pair=pair).allreduce_cast_(mine, dtype)
    assert reduction.total is mine and torch.equal(mine, expected)
    assert all(torch.equal(copy, mine) for copy in everyone(comm, mine))


@pytest.mark.mpi(min_size=4)
def test_by_node_only_the_sum_across_nodes_is_cast(comm):
    mine = torch.randn(999, generator=torch.Generator().manual_seed(comm.rank))
    rows = everyone(comm, mine)
    node_sums = [rows[r] + rows[r + 1] if r + 1 < comm.size else rows[r] for r in range(0, comm.size, 2)]
    expected = torch.stack([s.bfloat16().float() for s in node_sums]).sum(0).bfloat16().float()
    HierarchicalCommunicator(comm.mpi_comm, pairs).allreduce_cast_(mine, torch.bfloat16)
    assert torch.equal(mine, expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("outer", ["central", "nesterov"])
@pytest.mark.parametrize(
    "wire, fewer, close",
    [("bf16", (2, 2), 1e-2), ("int8", (3.5, 4), 5e-2)],  # int8: a byte a value, 4 bytes a block, fp32 buffers
)
def test_smaller_syncs_send_fewer_bytes_and_stay_close_to_fp32(comm, shared_tmp, outer, wire, fewer, close):
    train, test = datasets(comm.size, 2)
    results, records = {}, {}
    for dtype in ("fp32", wire):
        cfg = run_config(shared_tmp / dtype, learners=2, sync_every=2, outer_optimizer=outer, sync_dtype=dtype)
        results[dtype] = Trainer(cfg, comm).fit(mlp, train, test).central
        if comm.rank == 0:
            records[dtype] = [json.loads(line) for line in (shared_tmp / dtype / "run" / "metrics.jsonl").open()][-1]
    assert 0 < relative_error(results[wire], results["fp32"]) < close
    if comm.rank == 0:
        assert records[wire]["comm_bytes"] > 0
        assert fewer[0] <= records["fp32"]["comm_bytes"] / records[wire]["comm_bytes"] <= fewer[1]


def huge_running_var() -> nn.Module:
    model = mlp_bn()
    model[2].running_var.fill_(1e6)
    return model


@pytest.mark.mpi(min_size=2)
def test_fp16_refuses_a_model_beyond_its_range_naming_the_layer(comm, shared_tmp):
    train, test = datasets(comm.size, 1)
    cfg = run_config(shared_tmp, learners=1, sync_dtype="fp16")
    with pytest.raises(ConfigError, match=r"--sync-dtype fp16: 2\.running_var holds values beyond .* at start-up"):
        Trainer(cfg, comm).fit(huge_running_var, train, test)
    assert not (shared_tmp / "run").exists()  # refused before anything was written


class Counting(nn.Module):
    """Adds `by` to a float buffer at every training pass: beyond float16's range after one pass with 1e5."""

    def __init__(self, by: float = 1e5):
        super().__init__()
        self.by = by
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += self.by
        return x


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["sma", "elastic"])
def test_fp16_refuses_a_message_beyond_its_range_at_the_first_sync_naming_the_layer(comm, shared_tmp, algorithm):
    train, test = datasets(comm.size, 1)
    cfg = run_config(shared_tmp, learners=1, sync_dtype="fp16", algorithm=algorithm)
    with pytest.raises(ConfigError, match=r"--sync-dtype fp16: 1\.seen holds values beyond .* at the first sync"):
        Trainer(cfg, comm).fit(lambda: nn.Sequential(mlp(), Counting()), train, test)
    comm.barrier()
    assert not (shared_tmp / "run").exists()  # what the run wrote before its first sync is gone


@pytest.mark.mpi(min_size=2)
def test_a_resume_refused_at_its_first_fp16_sync_leaves_every_file_as_it_was(comm, shared_tmp):
    train, test = datasets(comm.size, 1)
    fp16 = dict(learners=1, sync_dtype="fp16", sync_every=2, checkpoint_every=1, keep_checkpoints=1)
    Trainer(run_config(shared_tmp, **fp16), comm).fit(lambda: nn.Sequential(mlp(), Counting(1.0)), train, test)
    run = shared_tmp / "run"
    if comm.rank == 0:
        (run / "checkpoint-000000099.h5.tmp").write_bytes(b"left by a killed run")
    before = digest(run) if comm.rank == 0 else None
    cfg = run_config(shared_tmp, **fp16, epochs=2, resume=True)
    with pytest.raises(ConfigError, match=r"1\.seen holds values beyond .* at the first sync"):
        Trainer(cfg, comm).fit(lambda: nn.Sequential(mlp(), Counting()), train, test)
    if comm.rank == 0:
        assert digest(run) == before  # its config.json, a checkpoint and the pruning of the old one are undone


def int8_reference(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """crossbow_mpi.comm.int8's cast in float64: return q s of x + residual and leave the new residual in place."""
    y = (x + residual).view(-1, BLOCK)
    scales = y.abs().amax(1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    sent = (torch.round(y / scales[:, None]).clamp(-127, 127) * scales[:, None]).view(-1)
    residual.copy_(y.view(-1) - sent)
    return sent


def ring_int8_reference(rows: list[torch.Tensor], residuals: list[torch.Tensor], owned: list[torch.Tensor]):
    """The int8 ring in float64: every rank's payload cast with its residual, each chunk's sum cast by its owner."""
    p, n = len(rows), rows[0].numel()
    chunk = BLOCK * -(-n // (p * BLOCK))
    sent = [
        int8_reference(torch.cat([row, row.new_zeros(p * chunk - n)]), e)
        for row, e in zip(rows, residuals, strict=True)
    ]
    sums = torch.stack(sent).sum(0).view(p, chunk)
    return torch.cat([int8_reference(sums[r], owned[r]) for r in range(p)])[:n]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("numel", [1, 1001])
def test_int8_syncs_follow_the_float64_equations_and_feed_their_errors_back(comm, numel):
    feedback, p = Feedback(), comm.size
    chunk = BLOCK * -(-numel // (p * BLOCK))
    residuals = [torch.zeros(p * chunk, dtype=torch.float64) for _ in range(p)]
    owned = [torch.zeros(chunk, dtype=torch.float64) for _ in range(p)]
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank)) * 3
    rows = [row.double() for row in everyone(comm, mine)]
    exact, delivered = torch.stack(rows).sum(0), torch.zeros(numel, dtype=torch.float64)
    for _ in range(8):
        expected = ring_int8_reference(rows, residuals, owned)
        got = mine.clone()
        MpiCommunicator(comm.mpi_comm).allreduce_int8_(got, feedback)
        assert relative_error(got.double(), expected) < 1e-5
        assert relative_error(got.double(), exact) < 0.05
        delivered += got.double()
    quantum = exact.abs().max() / 127
    assert (delivered - 8 * exact).abs().max() < 3 * p * quantum  # the errors do not add up over the syncs


@pytest.mark.mpi(min_size=2)
def test_an_int8_run_resumed_between_syncs_keeps_its_residuals_and_its_bits(comm, shared_tmp):
    local = {"sync_every": 5, "outer_optimizer": "nesterov", "sync_dtype": "int8", "epochs": 2}
    whole, resumed, _ = resume_between_syncs(comm, shared_tmp, local)
    assert resumed.iterations == whole.iterations and torch.equal(resumed.central, whole.central)
