"""The imbalance spec is parsed once, where the job size is known (the import graph is checked by
test_layers.py)."""

from __future__ import annotations

import pytest

from crossbow_mpi import Config, Trainer
from crossbow_mpi.runtime import imbalance
from crossbow_mpi.runtime.imbalance import parse_imbalance
from crossbow_mpi.training import trainer


@pytest.mark.mpi(min_size=1)
def test_the_imbalance_spec_is_parsed_once_where_the_job_size_is_known(comm, monkeypatch):
    calls = []

    def counting(spec, seed, world_size=None):
        calls.append(world_size)
        return parse_imbalance(spec, seed, world_size)

    monkeypatch.setattr(imbalance, "parse_imbalance", counting)
    monkeypatch.setattr(trainer, "parse_imbalance", counting)
    assert Trainer(Config(inject_imbalance="random:1"), comm).imbalance.milliseconds == 1.0
    assert calls == [comm.size]
