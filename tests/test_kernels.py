"""The fused SMA and S-SGD steps against the in-place ones, and compiled learners (`--compile`); serial."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.algorithms import SynchronousModelAveraging, SynchronousSGD
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.replicas import kernels
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.replicas.kernels import build_fused_steps, cxx_compiler, fuse
from crossbow_mpi.replicas.learners import CentralModel, Learners
from crossbow_mpi.replicas.state import HyperParams
from crossbow_mpi.training.trainer import FitResult

from helpers import self_comm

needs_compiler = pytest.mark.skipif(cxx_compiler() is None, reason="no C++ compiler")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10))


def sma_step(fused: bool, dtype: torch.dtype, k: int = 3) -> tuple[torch.Tensor, ...]:
    """Return (w, v, the staged corrections before the sync, z, u) after one SMA step on random rows."""
    torch.manual_seed(0)
    layout = FlatLayout(mlp().to(dtype))
    central = CentralModel(mlp().to(dtype), layout)
    learners = Learners(lambda: mlp().to(dtype), layout, central, k)
    learners.weights.normal_()
    learners.momentum.normal_(std=0.01)
    central.u.normal_(std=0.01)
    sma = SynchronousModelAveraging(HyperParams.from_config(Config()), self_comm(), central, learners)
    if fused:
        fuse(sma, torch.device("cpu"))
    sma.allocate_message()
    learners.grads.normal_(std=1e-2)
    sma.local_step(slice(None), lr=0.05)
    corrections = sma.staged[:, : layout.num_params].clone()  # the sync sums the rows into the first
    sma.sync(lr=0.05)
    return learners.params, learners.momentum, corrections, central.z, central.u


def ssgd_step(fused: bool, dtype: torch.dtype, k: int = 3) -> tuple[torch.Tensor, ...]:
    """Return (z, u, the learners' weights) after one S-SGD step of k learners on random gradients."""
    torch.manual_seed(0)
    layout = FlatLayout(mlp().to(dtype))
    central = CentralModel(mlp().to(dtype), layout)
    learners = Learners(lambda: mlp().to(dtype), layout, central, k)
    central.u.normal_(std=0.01)
    ssgd = SynchronousSGD(HyperParams.from_config(Config()), self_comm(), central, learners)
    if fused:
        fuse(ssgd, torch.device("cpu"))
    learners.grads.normal_(std=1e-2)
    ssgd.step(lr=0.05)
    return central.z, central.u, learners.state_dict()["weights"]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_the_fused_step_gives_the_bits_of_the_in_place_step(algorithm, dtype):
    step = {"sma": sma_step, "ssgd": ssgd_step}[algorithm]
    assert (
        set(build_fused_steps(algorithm, torch.device("cpu")))
        == {
            "sma": {"fused_update", "fused_central"},
            "ssgd": {"fused_update"},
        }[algorithm]
    )
    for index, (in_place, fused_value) in enumerate(zip(step(False, dtype), step(True, dtype), strict=True)):
        assert torch.equal(fused_value, in_place), f"output {index} differs"


@needs_compiler
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_a_run_with_the_fused_step_ends_with_the_bits_of_a_run_without(tmp_path, algorithm):
    ends = [
        short_run(tmp_path, f"fused-{fused}", algorithm=algorithm, fused_step=fused)[0].central
        for fused in (False, True)
    ]
    assert torch.equal(*ends)


def test_a_fused_step_without_a_compiler_keeps_the_in_place_step(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert build_fused_steps("sma", torch.device("cpu")) == {}


def short_run(tmp: Path, name: str, **changes) -> tuple[FitResult, dict]:
    """Train the mlp for two epochs on one rank with the config changes; return the result and the summary record."""
    train = synthetic_dataset((1, 6, 6), 10, 512, seed=0)
    cfg = Config(
        run_dir=str(tmp / name),
        learners=2,
        batch_size=16,
        epochs=2,
        eval_every=0,
        target_accuracy=0,
        seed=3,
        lr=0.05,
        threads=1,
        **changes,
    )
    result = Trainer(cfg, self_comm()).fit(mlp, train, train)
    return result, json.loads((tmp / name / "metrics.jsonl").read_text().splitlines()[-1])


@needs_compiler
def test_compiled_learners_train_to_the_same_accuracy_and_record_the_compile_seconds(tmp_path):
    (_, eager), (_, compiled) = short_run(tmp_path, "eager"), short_run(tmp_path, "compiled", compile=True)
    assert "compile_s" not in eager and compiled["compile_s"] > 0
    assert abs(compiled["final_test_accuracy"] - eager["final_test_accuracy"]) < 0.05
    assert eager["final_test_accuracy"] > 0.5


def test_compile_without_a_compiler_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"--compile needs a C\+\+ compiler"):
        Trainer(Config(compile=True, run_dir=str(tmp_path / "run")), self_comm())


def test_a_cupy_that_cannot_compile_is_refused_at_start_in_one_line(monkeypatch):
    class CompileException(Exception):
        pass

    def kernel(*args, **kwargs):
        def run(*arrays):
            raise CompileException("nvrtc: error: failed to open libnvrtc.so.12\nmore")

        return run

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(Device=Device)
    cupy = types.SimpleNamespace(cuda=cuda, ElementwiseKernel=kernel, zeros=np.zeros, float32=np.float32)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    kernels._cupy_kernel.cache_clear()
    try:
        with pytest.raises(
            ConfigError, match=r"^--fused-step: CuPy cannot compile its kernels \(CompileException: nvrtc"
        ):
            kernels.build_fused_steps("sma", torch.device("cuda", 0))
        assert kernels.build_fused_steps("eager", torch.device("cuda", 0)) == {}
    finally:
        kernels._cupy_kernel.cache_clear()
