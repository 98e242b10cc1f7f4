"""The fused SMA step against the in-place one, and compiled learners (`--compile`); serial, one process each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.algorithms import SynchronousModelAveraging
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.flat import FlatLayout
from crossbow_mpi.kernels import build_sma_update, cxx_compiler
from crossbow_mpi.learners import CentralModel, Learners
from crossbow_mpi.state import HyperParams

from conftest import self_comm

needs_compiler = pytest.mark.skipif(cxx_compiler() is None, reason="no C++ compiler")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10))


def ulps(a: torch.Tensor, b: torch.Tensor, *terms: torch.Tensor) -> torch.Tensor:
    """Return |a − b| in units in the last place of the largest of a, b and the terms that sum to them."""
    scale = torch.stack([t.abs() for t in (a, b, *terms)]).amax(0)
    _, exponent = torch.frexp(scale)  # scale = m 2^e, 1/2 <= m < 1
    return (a - b).abs() / torch.ldexp(torch.full_like(scale, torch.finfo(a.dtype).eps), exponent - 1)


def sma_step(fused_update, k: int = 3) -> tuple[torch.Tensor, ...]:
    """Return (w, v, staged corrections, w before, v before) of one local step of SMA on random rows."""
    torch.manual_seed(0)
    layout = FlatLayout(mlp())
    central = CentralModel(mlp(), layout)
    learners = Learners(mlp, layout, central, k)
    learners.weights.normal_()
    learners.momentum.normal_(std=0.01)
    sma = SynchronousModelAveraging(HyperParams.from_config(Config()), self_comm(), central, learners)
    sma.fused_update = fused_update
    sma.allocate_message()
    before = learners.params.clone(), learners.momentum.clone()
    learners.grads.normal_(std=1e-2)
    sma.local_step(slice(None), lr=0.05)
    return learners.params, learners.momentum, sma.staged[:, : layout.num_params], *before


FUSED_ULPS = {"v": 4, "w": 2}
"""Measured bound of the fused step's distance to the in-place step, per element, in ulps of the largest term:
torch.compile's C++ rounds μ v − η (g + λ w) without the in-place step's multiply-adds (3.6 ulps seen for v)."""


@needs_compiler
def test_the_fused_step_is_within_a_few_ulps_of_the_in_place_step_per_element():
    w, v, c, w_before, v_before = sma_step(None)
    fused = build_sma_update(torch.device("cpu"))
    fw, fv, fc, *_ = sma_step(fused)
    assert torch.equal(fc, c), "the correction α (w − z) rounds alike"
    assert ulps(fv, v, 0.9 * v_before, 0.9 * v_before - v).max() <= FUSED_ULPS["v"], "v ← μ v − η (g + λ w)"
    assert ulps(fw, w, w_before, v, c).max() <= FUSED_ULPS["w"], "w ← w + v − c"
    assert not torch.equal(fw, w) or not torch.equal(fv, v), "both ran the in-place step"


def test_a_fused_step_without_a_compiler_keeps_the_in_place_step(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert build_sma_update(torch.device("cpu")) is None


def compile_run(tmp: Path, compile: bool) -> dict:
    train = synthetic_dataset((1, 6, 6), 10, 512, seed=0)
    cfg = Config(
        run_dir=str(tmp / f"compile-{compile}"),
        compile=compile,
        learners=2,
        batch_size=16,
        epochs=2,
        eval_every=0,
        target_accuracy=0,
        seed=3,
        lr=0.05,
        threads=1,
    )
    Trainer(cfg, self_comm()).fit(mlp, train, train)
    return json.loads((tmp / f"compile-{compile}" / "metrics.jsonl").read_text().splitlines()[-1])


@needs_compiler
def test_compiled_learners_train_to_the_same_accuracy_and_record_the_compile_seconds(tmp_path):
    eager, compiled = compile_run(tmp_path, False), compile_run(tmp_path, True)
    assert "compile_s" not in eager and compiled["compile_s"] > 0
    assert abs(compiled["final_test_accuracy"] - eager["final_test_accuracy"]) < 0.05
    assert eager["final_test_accuracy"] > 0.5


def test_compile_without_a_compiler_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="--compile needs a C.. compiler"):
        Trainer(Config(compile=True, run_dir=str(tmp_path / "run")), self_comm())
